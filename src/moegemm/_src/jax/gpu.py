"""GPU executor: runs a ``KernelCall`` as an XLA custom call of jaxlib's Triton launcher (the
``triton_kernel_call`` target, the one jax-triton lowers to), the kernel compiled by Triton's own compiler.

Why not jax-triton's ``triton_call`` (docs/design.md, 'JAX front end'): jax-triton 0.3.1 compiles
``@triton.jit`` kernels only, so no Gluon kernel (the warp-specialized GEMMs) could run, and jaxlib's launcher
passes Triton's global scratch as a null pointer (its TODO b/381242007), so no kernel could make a TMA descriptor
on the device. Here the scratch is one more output of the custom call, sized by the compiled kernel
(``global_scratch_size`` a program), and passed as the parameter after the kernel's own: jaxlib appends its null
scratch and profile pointers after the parameters it is given, so ours lands in the kernel's global-scratch slot,
the null in its profile slot (unused without Triton's instrumentation) and the last null is past the kernel's
parameter list.

A ``KernelCall``'s ``meta`` holds every non-array argument. The kernel's constexpr parameters are compiled in; its
other ints are passed at run time, specialized as Triton's own launcher does (16-divisibility, 1 compiled in), so
a kernel runs as its PyTorch launch does: the warp-specialized kernels with their sizes compiled in as constants
fail to compile on small shapes (an LLVM assertion in ConvertTritonGPUToLLVM, 2026-11-27). The other meta keys
(num_warps, num_stages, maxnreg) are compile options. Compiled kernels are cached per specialization.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
from jax._src import dispatch
from jax.interpreters import mlir

from moegemm._src.jax.launch import Executor, KernelCall, gpu_target

# Triton's pointer types of the array dtypes the kernels take.
_TRITON_TYPES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "bool": "i1",
}
_POINTER_ALIGN = 16  # every XLA buffer is 16-byte aligned (jaxlib checks it at launch)


def _gpu_triton():
    from jax._src.lib import gpu_triton

    return gpu_triton


@functools.cache
def available() -> str | None:
    """None when the GPU path can run, else the reason it cannot."""
    import triton

    if bool(triton.knobs.runtime.interpret):
        return "TRITON_INTERPRET=1 is set, so the kernels are interpreter objects Triton cannot compile"
    if not any(d.platform == "gpu" for d in jax.devices()):
        return f"JAX has no GPU device (default backend: {jax.default_backend()})"
    try:
        launcher = _gpu_triton()
    except ImportError as e:
        return f"this jaxlib has no Triton launcher (jax._src.lib.gpu_triton: {e}); install jax[cuda]"
    if not hasattr(launcher, "TritonKernelCall"):
        return "jaxlib's Triton launcher has no CUDA plugin (jax._src.lib.gpu_triton); install jax[cuda]"
    return None


@functools.cache
def _compute_capability() -> int:
    cc = str(getattr(jax.devices("gpu")[0], "compute_capability", "9.0"))
    major, minor = cc.split(".")
    return int(major) * 10 + int(minor)


def _int_type(value: int) -> str:
    """Triton's type of a runtime int argument (its launcher's rule)."""
    return "i32" if -(2**31) <= value < 2**31 else "u64" if value >= 2**63 else "i64"


def _runtime_ints(kernel, n_arrays: int, meta: dict) -> list[tuple[str, int]]:
    """(name, value) of the parameters after the arrays that are not constexpr: Triton's launcher passes them at
    run time, specialized on 16-divisibility, and compiles a value of 1 in as a constant."""
    return [
        (p.name, meta[p.name])
        for p in kernel.params[n_arrays:]
        if not p.is_constexpr and p.name in meta and meta[p.name] != 1
    ]


@functools.lru_cache(maxsize=1024)
def _compile(kernel, pointer_types: tuple[str, ...], meta: tuple[tuple[str, object], ...], cc: int):
    """The CompiledKernel of ``kernel`` with its leading parameters pointers of ``pointer_types``, its
    constexpr parameters (and ints equal to 1) from ``meta``, its other ints runtime arguments specialized as
    Triton's launcher does (divisibility by 16); the other meta entries are compile options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    except ImportError:  # a Triton without Gluon
        GluonASTSource = GluonJITFunction = None

    meta = dict(meta)
    name = kernel.fn.__name__
    params = kernel.params
    if len(pointer_types) > len(params):
        raise TypeError(f"{name}: {len(pointer_types)} arrays for {len(params)} parameters")
    runtime = dict(_runtime_ints(kernel, len(pointer_types), meta))
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(params):
        if i < len(pointer_types):
            signature[p.name] = pointer_types[i]
            attrs[(i,)] = [["tt.divisibility", _POINTER_ALIGN]]
        elif p.name in runtime:
            signature[p.name] = _int_type(runtime[p.name])
            if runtime[p.name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in meta or p.has_default:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = meta[p.name] if p.name in meta else p.default
        else:
            raise TypeError(f"{name}: parameter {p.name!r} has no array and no value in the launch")
    options = {k: v for k, v in meta.items() if k not in {p.name for p in params}}
    gluon = GluonJITFunction is not None and isinstance(kernel, GluonJITFunction)
    source = (GluonASTSource if gluon else ASTSource)(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", cc, 32), options=options)


class _Launch(NamedTuple):
    """A KernelCall's static part, the primitive's parameter (hashable; the arrays are the operands)."""

    kernel: object
    grid: tuple[int, int, int]
    meta: tuple[tuple[str, object], ...]
    aliases: tuple[tuple[int, int], ...]
    zeroed_outputs: tuple[int, ...]
    outs: int  # the KernelCall's outputs; a scratch output follows where the kernel takes one


def _compiled(launch: _Launch, avals):
    pointer_types = tuple("*" + _TRITON_TYPES[jnp.dtype(a.dtype).name] for a in avals)
    return _compile(launch.kernel, pointer_types, launch.meta, _compute_capability())


_triton_call_p = jax.extend.core.Primitive("moegemm_triton_call")
_triton_call_p.multiple_results = True
_triton_call_p.def_impl(functools.partial(dispatch.apply_primitive, _triton_call_p))


@_triton_call_p.def_abstract_eval
def _abstract_eval(*avals, launch: _Launch, out_avals: tuple):
    del avals, launch
    return out_avals


def kernel_parameters(launch: _Launch, in_avals, out_avals, scratch_align: int) -> list[tuple]:
    """The launch's parameters in the order jaxlib passes them to the kernel: ("array", bytes to zero, pointer
    alignment) per input then output buffer, ("scalar", value, type) per runtime int, and last the scratch
    output's array (``out_avals`` past ``launch.outs``), which lands in the kernel's hidden global-scratch slot."""
    n_in = len(in_avals)
    buffers = (*in_avals, *out_avals[: launch.outs])
    params = []
    for i, aval in enumerate(buffers):
        zero = i >= n_in and i - n_in in launch.zeroed_outputs
        nbytes = math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize
        params.append(("array", nbytes if zero else 0, _POINTER_ALIGN))
    for _, value in _runtime_ints(launch.kernel, len(buffers), dict(launch.meta)):
        params.append(("scalar", value, _int_type(value)))
    if len(out_avals) > launch.outs:
        params.append(("array", 0, max(_POINTER_ALIGN, scratch_align)))
    return params


def _lower(ctx, *args, launch: _Launch, out_avals: tuple):
    gpu_triton = _gpu_triton()
    compiled = _compiled(launch, (*ctx.avals_in, *out_avals[: launch.outs]))
    md = compiled.metadata
    kernel = gpu_triton.TritonKernel(
        md.name,
        md.num_warps,
        getattr(md, "num_ctas", 1),
        md.shared,
        compiled.asm["ptx"],
        "",
        _compute_capability(),
    )
    params = [
        gpu_triton.create_array_parameter(a, b)
        if kind == "array"
        else gpu_triton.create_scalar_parameter(a, b)
        for kind, a, b in kernel_parameters(
            launch, ctx.avals_in, out_avals, getattr(md, "global_scratch_align", 1) or 1
        )
    ]
    kernel_call = gpu_triton.TritonKernelCall(kernel, *launch.grid, params)
    rule = jax.ffi.ffi_lowering(
        "triton_kernel_call",
        api_version=2,
        backend_config=zlib.compress(kernel_call.to_proto(md.name, b"")),
        operand_output_aliases=dict(launch.aliases),
    )
    return rule(ctx, *args)


mlir.register_lowering(_triton_call_p, _lower, platform="cuda")


def launch_of(call: KernelCall) -> tuple[_Launch, tuple]:
    """(the primitive's static launch, the output avals) of ``call``; a scratch output is appended where the
    compiled kernel takes Triton's global scratch (``global_scratch_size`` bytes a program)."""
    out_shapes = call.out_shape if isinstance(call.out_shape, tuple) else (call.out_shape,)
    out_avals = tuple(jax.core.ShapedArray(s.shape, jnp.dtype(s.dtype)) for s in out_shapes)
    grid = tuple(call.grid) + (1,) * (3 - len(call.grid))
    launch = _Launch(
        call.kernel,
        grid,
        tuple(sorted(call.meta.items())),
        tuple(sorted(call.input_output_aliases.items())),
        tuple(call.zeroed_outputs),
        len(out_shapes),
    )
    md = _compiled(launch, (*call.args, *out_avals)).metadata
    scratch = (getattr(md, "global_scratch_size", 0) or 0) * math.prod(grid) * getattr(md, "num_ctas", 1)
    if scratch:
        out_avals = (*out_avals, jax.core.ShapedArray((scratch,), jnp.dtype(jnp.uint8)))
    return launch, out_avals


def run(call: KernelCall):
    launch, out_avals = launch_of(call)
    outs = _triton_call_p.bind(*call.args, launch=launch, out_avals=out_avals)
    return tuple(outs[: launch.outs]) if isinstance(call.out_shape, tuple) else outs[0]


EXECUTOR = Executor("triton", available, gpu_target, run)
