"""custom_vjp rules around the kernel executors (the JAX glue). Inputs are validated by ``moegemm.jax.api``.

Two differentiable primitives, each closed under differentiation (higher-order grads reuse them):

- ``m_grouped_mm(x, w, sizes, offset)``: ``out[rows(g)] = x[rows(g)] @ W[g]``, W = w, or w^T per
  group when ``transpose_w`` (w stored [G, N, K]; read through swapped strides, never copied).
  dx = m_grouped_mm(dy, w, not transpose_w); dW = k_grouped_mm(x, dy), stored transposed as
  k_grouped_mm(dy, x). With ``fp8_options`` (:class:`Fp8Options`, W = w [G, K, N]) the same op runs in FP8:
  see below.
- ``k_grouped_mm(a, b, sizes, offset, c)``: ``out[g] = c[g] + a[rows(g)]^T @ b[rows(g)]`` (c optional).
  da = m_grouped_mm(b, dout, transpose_w=True); db = m_grouped_mm(a, dout); dc = dout.

``offset`` (int32 scalar or None) is expert parallelism: sizes covers all groups and the op's groups
are [offset, offset + G_local), read and written in place; rows of other groups are 0 in every
m-grouped output, so the rules above hold unchanged.

Both take the resolved ``Executor`` (``api`` resolves the backend string once) as a static argument.
Group sizes are integer inputs with no cotangent. Empty groups read no rows, so their weight
gradient is exactly zero and their rows' input gradient is exactly zero.

FP8. Quantized operands (``moegemm.jax.Fp8Array``) are not differentiable; the api calls
:func:`m_grouped_fp8` and :func:`k_grouped_fp8` on their parts. Those, and :func:`quantize_activation`
/ :func:`quantize_weight` (one to three kernel launches), take the Executor or None (the jax.numpy
twin, ``moegemm.jax.reference``), so one definition serves the GPU, the interpreter and the reference.
Storage (``moegemm._src.jax.launch_fp8`` has it): ``QuantizedParts`` are four arrays, data, scale,
data_t, scale_t (the last two None without a transposed copy). A weight's data_t is [G, K, padded(N)].

The FP8 training path, ``m_grouped_mm(lhs [M, K], rhs [G, K, N], ..., fp8_options=Fp8Options(...))``,
quantizes both operands in its forward (lhs with its transposed copy for the wgrad; rhs as a
[G, K, N] "weight", whose transposed copy [G, N, K] is the fprop operand and whose plain copy is the
dgrad operand: K-major either way, as FP8 wgmma needs), saves only the FP8 parts the backward reads,
and in the backward quantizes dy (with its transposed copy) and runs dgrad and wgrad in FP8::

    out  = m_grouped_fp8(x_q, rhs_q^T)          rows(g) @ rhs[g]
    dlhs = m_grouped_fp8(dy_q, rhs_q)           dy[rows(g)] @ rhs[g]^T
    drhs = k_grouped_fp8(x_q^T, dy_q^T)         x[rows(g)]^T @ dy[rows(g)]

The quantization is straight-through: the gradients are those of the FP8 products, as in
TransformerEngine and DeepSeek-V3's recipe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moegemm._src import fp8
from moegemm._src.jax import launch as _launch
from moegemm._src.jax import launch_fp8 as lf
from moegemm._src.jax.launch import Executor
from moegemm._src.kernels import quantize_fp8 as qk
from moegemm.jax import reference

AmaxReduce = Callable[[jax.Array], jax.Array] | None


def _m_grouped_mm_impl(x, w, group_sizes, group_offset, out_dtype, transpose_w, executor: Executor):
    M, K = x.shape
    N = w.shape[1] if transpose_w else w.shape[2]
    if M == 0 or N == 0 or K == 0 or w.shape[0] == 0:
        return jnp.zeros((M, N), out_dtype)
    call = _launch.m_grouped_mm_call(
        x,
        w,
        group_sizes,
        transpose_w=transpose_w,
        out_dtype=out_dtype,
        target=executor.target(),
        group_offset=group_offset,
    )
    return executor.run(call)


def _k_grouped_mm_impl(a, b, group_sizes, group_offset, c, out_dtype, num_groups, executor: Executor):
    (M, K), N, G = a.shape, b.shape[1], num_groups
    if M == 0 or N == 0 or K == 0 or G == 0:
        return jnp.zeros((G, K, N), out_dtype) if c is None else c
    call = _launch.k_grouped_mm_call(
        a,
        b,
        group_sizes,
        c,
        out_dtype=out_dtype,
        target=executor.target(),
        group_offset=group_offset,
        num_groups=num_groups,
    )
    return executor.run(call)


class QuantizedParts(NamedTuple):
    data: jax.Array
    scale: jax.Array
    data_t: jax.Array | None
    scale_t: jax.Array | None


def _as_fp8(bytes_: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(bytes_, jnp.dtype(dtype))


def _quantize_rows(
    x: jax.Array,
    group_sizes: jax.Array | None,
    G: int,
    rows_per_group: int,
    recipe: str,
    dtype,
    transpose: bool,
    executor: Executor,
    amax_reduce: AmaxReduce,
    *,
    weight: bool,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """The launches that quantize the rows of x [R, C] in G groups: by group_sizes (activations), or of
    rows_per_group rows each (a weight [G, N, K] seen as [G * N, K], ``weight``), as
    ``moegemm._src.torch.launch_fp8.launch_quantize_fp8`` does for PyTorch. Returns (data [R, C], scale,
    data_t or None, the transposed launch's scale output or None); layouts in ``_launch_fp8``."""
    run, target = executor.run, executor.target()
    R = x.shape[0]
    t_layout = (
        dict(t_local_n=fp8.padded(rows_per_group)) if weight else dict(t_columns=fp8.transposed_columns(R, G))
    )
    if recipe == "rowwise":
        data, scale = run(
            lf.quantize_rows_call(x, group_sizes, 1 if weight else G, dtype=dtype, target=target)
        )
        if not transpose:
            return data, scale, None, None
        qt, scale_t = run(
            lf.quantize_cols_call(x, group_sizes, G, rows_per_group, dtype=dtype, target=target, **t_layout)
        )
        return data, scale, _as_fp8(qt, dtype), scale_t
    amax = None
    scaling = qk.BLOCK_128X128 if weight else qk.BLOCK_1X128
    if recipe == "tensorwise":
        scaling = qk.TENSOR
        amax = run(lf.group_amax_call(x, group_sizes, G, rows_per_group, target))
        if amax_reduce is not None:
            amax = amax_reduce(amax)
    common = dict(scaling=scaling, dtype=dtype, target=target, amax=amax)
    data, scale, _, _ = run(lf.quantize_tiles_call(x, group_sizes, G, rows_per_group, write_q=True, **common))
    if not transpose:
        return data, scale, None, None
    qt, scale_t = run(
        lf.quantize_tiles_call(
            x, group_sizes, G, rows_per_group, write_q=False, q=data, s=scale, **t_layout, **common
        )
    )
    return data, scale, _as_fp8(qt, dtype), scale_t


def quantize_activation(
    x: jax.Array,
    group_sizes: jax.Array | None,
    recipe: str,
    dtype,
    transpose: bool,
    executor: Executor | None,
    amax_reduce: AmaxReduce = None,
) -> QuantizedParts:
    """Activations x [M, K] in G groups (``moegemm._src.fp8`` layouts; blockwise scale [cdiv(K, 128), M]).

    ``amax_reduce`` (tensorwise) combines the per-group amax across shards before any value is cast.
    """
    M, K = x.shape
    G = 1 if group_sizes is None else group_sizes.shape[0]
    if executor is None or M == 0 or K == 0:
        data, scale, data_t, scale_t = reference._quantize_activation(
            x, group_sizes, recipe, dtype, transpose, amax_reduce=amax_reduce
        )
        return QuantizedParts(data, scale, data_t, scale_t)
    data, scale, data_t, scale_t = _quantize_rows(
        x, group_sizes, G, M, recipe, dtype, transpose, executor, amax_reduce, weight=False
    )
    if data_t is not None and recipe == "tensorwise":
        scale_t = scale  # one scale per group serves both copies
    return QuantizedParts(data, scale, data_t, scale_t)


def quantize_weight(
    w: jax.Array,
    recipe: str,
    dtype,
    transpose: bool,
    executor: Executor | None,
    amax_reduce: AmaxReduce = None,
) -> QuantizedParts:
    """A weight w [G, N, K]: data [G, N, K], data_t [G, K, padded(N)] (``moegemm._src.fp8`` scales)."""
    G, N, K = w.shape
    if executor is None or G * N * K == 0:
        data, scale, data_t, scale_t = reference._quantize_weight(
            w, recipe, dtype, transpose, amax_reduce=amax_reduce
        )
        if data_t is not None:  # the storage of a weight's transposed copy has 16-byte rows
            data_t = jnp.pad(data_t, ((0, 0), (0, 0), (0, fp8.padded(N) - N)))
        return QuantizedParts(data, scale, data_t, scale_t)
    data, scale, data_t, scale_t = _quantize_rows(
        w.reshape(G * N, K), None, G, N, recipe, dtype, transpose, executor, amax_reduce, weight=True
    )
    data = data.reshape(G, N, K)
    if recipe == "rowwise":
        scale = scale.reshape(G, N)
    elif data_t is not None:  # tensorwise: the same scales; blockwise: the 128x128 blocks transposed
        scale_t = scale if recipe == "tensorwise" else jnp.swapaxes(scale, 1, 2)
    return QuantizedParts(data, scale, data_t, scale_t)


def m_grouped_fp8(
    x: jax.Array,
    sx: jax.Array,
    w: jax.Array,
    sw: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    recipe: str,
    out_dtype,
    executor: Executor | None,
    fast_accum: bool = False,
) -> jax.Array:
    """out [M, N] = for g: (x * sx)[rows(g)] @ ((w * sw)[g, :, :K])^T; w [G, N, Kw >= K] (a transposed
    copy's storage has padded rows). Rows of groups outside the launch's are 0. fast_accum: the
    tensor cores accumulate all of K (tensorwise/rowwise; the twin is exact either way)."""
    M, Kx = x.shape
    G, N, Kw = w.shape
    if executor is None or M == 0 or N == 0 or Kx == 0 or G == 0:
        if Kw != Kx:
            w = w[:, :, :Kx]
        return reference._m_grouped_mm_fp8(
            x, sx, w, sw, group_sizes, recipe, out_dtype, group_offset=group_offset
        )
    call = lf.m_grouped_mm_fp8_call(
        x,
        sx,
        w,
        sw,
        group_sizes,
        recipe=recipe,
        out_dtype=out_dtype,
        target=executor.target(),
        w_row_stride=Kw,
        group_offset=group_offset,
        fast_accum=fast_accum,
    )
    return executor.run(call)


def k_grouped_fp8(
    M: int,
    a_t: jax.Array,
    sa: jax.Array,
    b_t: jax.Array,
    sb: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    c: jax.Array | None,
    num_groups: int,
    recipe: str,
    out_dtype,
    executor: Executor | None,
    fast_accum: bool = False,
) -> jax.Array:
    """out [G, Ka, Nb] = for g: (c[g] +) (a * sa)[rows(g)]^T @ (b * sb)[rows(g)], from transposed copies."""
    K, N = a_t.shape[0], b_t.shape[0]
    if executor is None or M == 0 or K == 0 or N == 0 or num_groups == 0:
        return reference._k_grouped_mm_fp8(
            M,
            a_t,
            sa,
            b_t,
            sb,
            group_sizes,
            recipe,
            out_dtype,
            c=c,
            group_offset=group_offset,
            num_groups=num_groups,
        )
    call = lf.k_grouped_mm_fp8_call(
        M,
        a_t,
        sa,
        b_t,
        sb,
        group_sizes,
        c,
        recipe=recipe,
        out_dtype=out_dtype,
        target=executor.target(),
        group_offset=group_offset,
        num_groups=num_groups,
        fast_accum=fast_accum,
    )
    return executor.run(call)


def fprop(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    recipe: str,
    dtype,
    out_dtype,
    executor: Executor | None,
    *,
    lhs_transpose: bool,
    lhs_amax_reduce: AmaxReduce = None,
    rhs_amax_reduce: AmaxReduce = None,
    fast_accum: bool = False,
    rhs_q: QuantizedParts | None = None,
) -> tuple[jax.Array, QuantizedParts, QuantizedParts]:
    """(out [M, N], x_q, w_q) of ragged_dot(lhs [M, K], rhs [G, K, N]) in FP8: rhs is quantized as a
    [G, K, N] weight with its transposed copy [G, N, padded(K)], the K-major fprop operand (whose plain
    copy is the dgrad operand), unless ``rhs_q`` is that quantization already; lhs with its transposed copy
    when the wgrad will need it."""
    x_q = quantize_activation(lhs, group_sizes, recipe, dtype, lhs_transpose, executor, lhs_amax_reduce)
    w_q = rhs_q if rhs_q is not None else quantize_weight(rhs, recipe, dtype, True, executor, rhs_amax_reduce)
    out = m_grouped_fp8(
        x_q.data, x_q.scale, w_q.data_t, w_q.scale_t, group_sizes, group_offset, recipe, out_dtype, executor,
        fast_accum,
    )  # fmt: skip
    return out, x_q, w_q


# ---------------------------------------------------------------- m_grouped_mm (and ragged_dot)


class Fp8Options(NamedTuple):
    """Static options of the FP8 training path of :func:`m_grouped_mm` (hashable: a nondiff argument)."""

    recipe: str
    dtype: object  # the forward operands' FP8 type
    grad_dtype: object  # dy's FP8 type (E5M2: TransformerEngine's "hybrid")
    lhs_dtype: object  # the gradients' dtypes
    rhs_dtype: object
    fprop_fast_accum: bool = False  # the forward accumulates on the tensor cores (TE's fprop default)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def m_grouped_mm(
    x,
    w,
    group_sizes,
    group_offset,
    w_q: QuantizedParts | None,
    out_dtype,
    transpose_w: bool,
    executor: Executor | None,
    fp8_options: Fp8Options | None,
):
    """``fp8_options`` None: the kernels in x's precision (executor not None). Set: x and w quantized
    inside (W = w [G, K, N], transpose_w False), or w's quantization given (``w_q``: ``quantize_weight(w, ...,
    transpose=True)``, kept across calls while w is unchanged; w's gradient still comes back); executor None
    runs the FP8 twin."""
    if fp8_options is None:
        return _m_grouped_mm_impl(x, w, group_sizes, group_offset, out_dtype, transpose_w, executor)
    return _m_grouped_mm_fwd(
        x, w, group_sizes, group_offset, w_q, out_dtype, transpose_w, executor, fp8_options
    )[0]


def _m_grouped_mm_fwd(x, w, group_sizes, group_offset, w_q, out_dtype, transpose_w, executor, fp8_options):
    if fp8_options is None:
        out = m_grouped_mm(x, w, group_sizes, group_offset, None, out_dtype, transpose_w, executor, None)
        return out, (x, w, group_sizes, group_offset)
    o = fp8_options
    out, x_q, w_q = fprop(
        x, w, group_sizes, group_offset, o.recipe, o.dtype, out_dtype, executor, lhs_transpose=True,
        fast_accum=o.fprop_fast_accum, rhs_q=w_q,
    )  # fmt: skip
    # The backward reads only the transposed copy of x (wgrad) and the plain copy of w (dgrad).
    return out, (x_q.data_t, x_q.scale_t, w_q.data, w_q.scale, group_sizes, group_offset)


def _m_grouped_mm_bwd(out_dtype, transpose_w, executor, fp8_options, residuals, dy):
    if fp8_options is not None:
        return _m_grouped_mm_fp8_bwd(executor, fp8_options, residuals, dy)
    x, w, group_sizes, group_offset = residuals
    dy = dy.astype(x.dtype)  # the kernels take one operand dtype; fp32 cotangents of bf16 inputs
    # Rows of non-local groups did not touch w: their dx rows come out 0 from the same offset launch.
    dx = m_grouped_mm(dy, w, group_sizes, group_offset, None, x.dtype, not transpose_w, executor, None)
    G = w.shape[0]
    if transpose_w:
        dw = k_grouped_mm(dy, x, group_sizes, group_offset, None, w.dtype, G, executor)
    else:
        dw = k_grouped_mm(x, dy, group_sizes, group_offset, None, w.dtype, G, executor)
    return dx, dw, None, None, None


def _m_grouped_mm_fp8_bwd(executor, o: Fp8Options, residuals, dy):
    x_t, sx_t, w, sw, group_sizes, group_offset = residuals
    M = dy.shape[0]
    dy_q = quantize_activation(dy, group_sizes, o.recipe, o.grad_dtype, True, executor)
    dlhs = m_grouped_fp8(
        dy_q.data, dy_q.scale, w, sw, group_sizes, group_offset, o.recipe, o.lhs_dtype, executor
    )
    G = w.shape[0]
    # dW in rhs's dtype straight from the kernel's fp32 accumulators: an fp32 dW and a cast would move 2.5x its
    # bytes again (DeepSeek-V3 EP8 fc1: 9.4 GB, 2.7 ms on the H100).
    drhs = k_grouped_fp8(
        M, x_t, sx_t, dy_q.data_t, dy_q.scale_t, group_sizes, group_offset, None, G, o.recipe, o.rhs_dtype,
        executor,
    )  # fmt: skip
    return dlhs, drhs, None, None, None  # w_q: a quantization, no gradient of its own


m_grouped_mm.defvjp(_m_grouped_mm_fwd, _m_grouped_mm_bwd)


# ---------------------------------------------------------------- k_grouped_mm


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def k_grouped_mm(a, b, group_sizes, group_offset, c, out_dtype, num_groups: int, executor: Executor):
    return _k_grouped_mm_impl(a, b, group_sizes, group_offset, c, out_dtype, num_groups, executor)


def _k_grouped_mm_fwd(a, b, group_sizes, group_offset, c, out_dtype, num_groups, executor):
    # () vs None records statically whether c was given, without keeping c alive.
    out = k_grouped_mm(a, b, group_sizes, group_offset, c, out_dtype, num_groups, executor)
    return out, (a, b, group_sizes, group_offset, None if c is None else ())


def _k_grouped_mm_bwd(out_dtype, num_groups, executor, residuals, dout):
    a, b, group_sizes, group_offset, has_c = residuals
    dout_in = dout.astype(a.dtype)
    da = m_grouped_mm(b, dout_in, group_sizes, group_offset, None, a.dtype, True, executor, None)
    db = m_grouped_mm(a, dout_in, group_sizes, group_offset, None, b.dtype, False, executor, None)
    return da, db, None, None, None if has_c is None else dout


k_grouped_mm.defvjp(_k_grouped_mm_fwd, _k_grouped_mm_bwd)
