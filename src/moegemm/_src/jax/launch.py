"""One description of each kernel launch, shared by the GPU path (``gpu.py``) and the interpreter path.

``m_grouped_mm_call`` / ``k_grouped_mm_call`` turn JAX arrays and static shapes into a ``KernelCall``: the
kernel's input arrays in parameter order (the output pointers left out: the executors append them),
grid, every other argument in ``meta`` (sizes, strides, constexprs, compile options) and the output shape. The
GPU executor compiles the kernel's constexpr parameters in and passes its other ints at run time with Triton's
divisibility specialization, as the PyTorch launches do. Both
executors (:class:`Executor`) consume exactly this object, so the interpreter tests exercise the GPU glue.
JAX arrays are contiguous row-major: strides are computed from shapes, and a transposed weight is
passed as the untransposed array with swapped strides (no copy).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from moegemm._src import plan
from moegemm._src.kernels.k_grouped import k_grouped_mm_kernel
from moegemm._src.kernels.m_grouped import m_grouped_mm_kernel

# SM count used when the device does not report one (H100 SXM).
DEFAULT_PROGRAMS = 132

# Where a launch runs (``name`` is the configs.TABLE target, ``programs`` caps the persistent grid).
Target = plan.Target
# Odd and small, so the persistent stride loop is exercised (as in the PyTorch glue).
INTERPRET = plan.INTERPRET


def capabilities(target: Target) -> plan.Capabilities:
    """What the FP8 launches on ``target`` plan with: the GPU executor passes Triton's global scratch and runs
    Gluon kernels (``moegemm._src.jax.gpu``), the interpreter neither; no host descriptors either way."""
    return plan.JAX if target.name == "interpret" else plan.JAX_GPU


@functools.cache
def gpu_target() -> Target:
    """Target of the first GPU, from device attributes only (no sync, no kernel launch)."""
    device = jax.devices("gpu")[0]
    cc = str(getattr(device, "compute_capability", ""))
    try:
        programs = int(device.core_count)
    except (AttributeError, TypeError, ValueError):
        programs = DEFAULT_PROGRAMS
    return Target("sm90" if cc == "9.0" else "cuda", str(device.device_kind), programs)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One kernel launch: ``kernel[grid](*args, *outs, **meta)`` with outs of ``out_shape``.

    ``out_shape`` is one ShapeDtypeStruct (the launch returns one array) or a tuple of them (it
    returns a tuple). Outputs start uninitialized, except those in ``zeroed_outputs`` (zeros) and
    those aliased to an input (that input's values).
    """

    kernel: Any
    grid: tuple[int, ...]
    args: tuple  # jax arrays in kernel parameter order, outputs excluded
    out_shape: jax.ShapeDtypeStruct | tuple[jax.ShapeDtypeStruct, ...]
    meta: dict  # constexprs (sizes and strides included) plus num_warps / num_stages
    input_output_aliases: dict[int, int]  # {args index: output index}
    zeroed_outputs: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Executor:
    """One way to run a KernelCall: ``run(call)`` launches it on ``target()``.

    ``available()`` is None where it can run, else the reason it cannot. One per backend
    (``gpu.EXECUTOR``, ``_interpret.EXECUTOR``); hashable, so the custom_vjp rules take it
    as a static argument.
    """

    name: str
    available: Callable[[], str | None]
    target: Callable[[], Target]
    run: Callable[[KernelCall], jax.Array]


def _plan(problem: plan.Problem, target: Target) -> plan.Plan:
    """The BF16/FP16/FP32 launches' plan: without the scratch, as they were tuned and tested from JAX (with it the
    wgrad would pick the TMA-only candidates, measured with TMA, which these launches do not take; docs/design.md,
    'JAX front end')."""
    return plan.plan(problem, target, plan.JAX)


def _launch_options(
    op: str, M: int, N: int, K: int, G: int, dtype, target: Target, G_total: int | None = None
) -> dict:
    """The tile config the plan picks for a launch of ``op`` (with a group offset, for the rows the local
    groups can expect: plan._config_rows), with the grid cap and dtype flags both kernels take."""
    problem = plan.Problem(op, M, N, K, G, jnp.dtype(dtype).name, g_total=G_total)
    return dict(
        config=_plan(problem, target).config,
        num_programs_cap=target.programs,
        fp32_inputs=dtype == jnp.float32,
        interpret=target.name == "interpret",
    )


def _offset_arg(group_offset: jax.Array | None, group_sizes: jax.Array) -> jax.Array:
    """The kernels' group_offset_ptr argument: the offset as int32 [1], or (no offset, never read)
    group_sizes filling the slot."""
    if group_offset is None:
        return group_sizes
    return jnp.asarray(group_offset, jnp.int32).reshape(1)


def m_grouped_mm_call(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_w: bool,
    out_dtype,
    target: Target,
    group_offset: jax.Array | None = None,
) -> KernelCall:
    """out [M, N] = for g: x[rows(g)] @ W[g], W = w [G, K, N], or w [G, N, K] read transposed.

    With ``group_offset`` (int32 scalar on the device), group_sizes has G_total entries and w holds
    groups [offset, offset + G); rows of other groups come out 0 (expert parallelism, no row copies).
    """
    M, K = x.shape
    if transpose_w:
        G, N, _ = w.shape
        stride_wg, stride_wk, stride_wn = N * K, 1, K
    else:
        G, _, N = w.shape
        stride_wg, stride_wk, stride_wn = K * N, N, 1
    g_total = None if group_offset is None else group_sizes.shape[0]  # None: no offset
    G_total = G if g_total is None else g_total
    # JAX arrays are contiguous: every row is 16-byte aligned where K and N are, which the kernel's
    # half_tiles_fit checks on the GPU (the interpreter runs half-high tiles on any shape).
    problem = plan.Problem(
        plan.M_GROUPED,
        M,
        N,
        K,
        G,
        jnp.dtype(x.dtype).name,
        g_total=g_total,
        max_stride=max(K, 1, stride_wk, stride_wn, N),
        w_k_contiguous=stride_wk == 1 and stride_wn != 1,
        rows_aligned=True,
    )
    launch = _plan(problem, target)
    sizes = dict(
        M=M,
        N=N,
        K=K,
        G=G,
        G_TOTAL=G_total,
        stride_xm=K,
        stride_xk=1,
        stride_om=N,
        stride_on=1,
        stride_bg=0,
        stride_bn=0,
    )
    sizes |= dict(stride_wg=stride_wg, stride_wk=stride_wk, stride_wn=stride_wn)
    out_shape = jax.ShapeDtypeStruct((M, N), jnp.dtype(out_dtype))
    # No bias (HAS_BIAS=False): the kernel never reads bias_ptr; x fills that slot. TMA_STORE stays off: these
    # launches plan without the scratch (``_plan``).
    # The expert block's pointers (gather, act, row_scale, act_out, ds) are not read without its options.
    args = (x, w, group_sizes, _offset_arg(group_offset, group_sizes), x, group_sizes, x, x, x, x)
    return KernelCall(m_grouped_mm_kernel, launch.grid, args, out_shape, {**launch.meta, **sizes}, {})


def k_grouped_mm_call(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    c: jax.Array | None,
    *,
    out_dtype,
    target: Target,
    group_offset: jax.Array | None = None,
    num_groups: int | None = None,
) -> KernelCall:
    """out [G, K, N] = for g: (c[g] +) a[rows(g)]^T @ b[rows(g)]; c, when given, is aliased to out.

    With ``group_offset``, group_sizes has G_total entries and out holds the ``num_groups`` groups
    [offset, offset + num_groups), their rows read in place (expert parallelism).
    """
    M, K = a.shape
    N = b.shape[1]
    G_total = group_sizes.shape[0]
    G = G_total if group_offset is None else num_groups
    g_total = None if group_offset is None else G_total  # None: no offset
    problem = plan.Problem(
        plan.K_GROUPED,
        M,
        N,
        K,
        G,
        jnp.dtype(a.dtype).name,
        out_itemsize=jnp.dtype(out_dtype).itemsize,
        g_total=g_total,
        accumulate=c is not None,
    )
    launch = _plan(problem, target)
    # Without accumulation the kernel never reads c_ptr, without A_COLSUM it never writes a_colsum_ptr; any
    # pointer fills those slots. No TMA_STORE: these launches plan without the scratch
    # (``_plan``).
    args = (
        a,
        b,
        group_sizes,
        _offset_arg(group_offset, group_sizes),
        a if c is None else c,
        a,
        group_sizes,
        group_sizes,
    )
    sizes = dict(
        M=M,
        N=N,
        K=K,
        G=G,
        G_TOTAL=G_total,
        stride_am=K,
        stride_ak=1,
        stride_bm=N,
        stride_bn=1,
        stride_sg=0,
        stride_sk=0,
    )
    sizes |= dict(stride_og=K * N, stride_ok=N, stride_on=1)
    out_shape = jax.ShapeDtypeStruct((G, K, N), jnp.dtype(out_dtype))
    aliases = {} if c is None else {4: 0}
    return KernelCall(k_grouped_mm_kernel, launch.grid, args, out_shape, {**launch.meta, **sizes}, aliases)
