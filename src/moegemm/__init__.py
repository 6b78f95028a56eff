"""moegemm: grouped GEMMs for Mixture-of-Experts training, one Triton source for PyTorch and JAX.

Front ends: ``moegemm.torch`` (custom ops, autograd, GroupedLinear) and ``moegemm.jax``
(ragged_dot drop-in, custom_vjp, Flax hook). Kernels: ``moegemm._src.kernels``.
"""

__version__ = "0.1.0"
