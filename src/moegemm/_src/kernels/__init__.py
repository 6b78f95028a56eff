"""Framework-free Triton kernels: pointers, strides and constexprs only.

Each kernel module exposes a ``@triton.jit`` kernel and a launcher description
(grid + meta-parameters derived from static shapes) that the PyTorch and JAX
front ends share.
"""
