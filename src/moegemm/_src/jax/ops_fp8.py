"""The JAX glue of the FP8 ops: quantize (one to three kernel launches), the scaled GEMMs, and the
custom_vjp of the FP8 training op. Inputs are validated by ``moegemm.jax.fp8``.

Every function takes the resolved ``Executor`` (None: the jax.numpy twin, ``moegemm.jax.reference_fp8``),
so one definition of each op serves the GPU, the interpreter and the reference.

Storage (``moegemm._src.jax.launch_fp8`` has it): ``QuantizedParts`` are four arrays,
data, scale, data_t, scale_t (the last two None without a transposed copy). A weight's data_t is
[G, K, padded(N)].

The training op ``ragged_dot_fp8(lhs [M, K], rhs [G, K, N])`` quantizes both operands in its forward
(lhs with its transposed copy for the wgrad; rhs as a [G, K, N] "weight", whose transposed copy
[G, N, K] is the fprop operand and whose plain copy is the dgrad operand: K-major either way, as FP8
wgmma needs), saves only the FP8 parts the backward reads, and in the backward quantizes dy (with its
transposed copy) and runs dgrad and wgrad in FP8::

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
from moegemm._src.jax import launch_fp8 as lf
from moegemm._src.jax.launch import Executor
from moegemm._src.kernels import quantize_fp8 as qk
from moegemm.jax import reference_fp8

AmaxReduce = Callable[[jax.Array], jax.Array] | None


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
        data, scale, data_t, scale_t = reference_fp8.quantize_activation(
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
        data, scale, data_t, scale_t = reference_fp8.quantize_weight(
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


def m_grouped(
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
        return reference_fp8.m_grouped_mm_fp8_reference(
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


def k_grouped(
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
        return reference_fp8.k_grouped_mm_fp8_reference(
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


# ---------------------------------------------------------------- the training op


class Fp8Options(NamedTuple):
    """Static options of the training op (hashable: a nondiff argument)."""

    recipe: str
    dtype: object  # the forward operands' FP8 type
    grad_dtype: object  # dy's FP8 type (E5M2: TransformerEngine's "hybrid")
    out_dtype: object
    lhs_dtype: object  # the gradients' dtypes
    rhs_dtype: object
    executor: Executor | None
    fprop_fast_accum: bool = False  # the forward accumulates on the tensor cores (TE's fprop default)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def ragged_dot_fp8(lhs, rhs, group_sizes, group_offset, options: Fp8Options):
    return _ragged_dot_fp8_fwd(lhs, rhs, group_sizes, group_offset, options)[0]


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
) -> tuple[jax.Array, QuantizedParts, QuantizedParts]:
    """(out [M, N], x_q, w_q) of ragged_dot(lhs [M, K], rhs [G, K, N]) in FP8: rhs is quantized as a
    [G, K, N] weight with its transposed copy [G, N, padded(K)], the K-major fprop operand (whose plain
    copy is the dgrad operand); lhs with its transposed copy when the wgrad will need it."""
    x_q = quantize_activation(lhs, group_sizes, recipe, dtype, lhs_transpose, executor, lhs_amax_reduce)
    w_q = quantize_weight(rhs, recipe, dtype, True, executor, rhs_amax_reduce)
    out = m_grouped(
        x_q.data, x_q.scale, w_q.data_t, w_q.scale_t, group_sizes, group_offset, recipe, out_dtype, executor,
        fast_accum,
    )  # fmt: skip
    return out, x_q, w_q


def _ragged_dot_fp8_fwd(lhs, rhs, group_sizes, group_offset, options: Fp8Options):
    o = options
    out, x_q, w_q = fprop(
        lhs, rhs, group_sizes, group_offset, o.recipe, o.dtype, o.out_dtype, o.executor, lhs_transpose=True,
        fast_accum=o.fprop_fast_accum,
    )  # fmt: skip
    # The backward reads only the transposed copy of x (wgrad) and the plain copy of rhs (dgrad).
    residuals = (x_q.data_t, x_q.scale_t, w_q.data, w_q.scale, group_sizes, group_offset)
    return out, residuals


def _ragged_dot_fp8_bwd(options: Fp8Options, residuals, dy):
    o = options
    x_t, sx_t, w, sw, group_sizes, group_offset = residuals
    M = dy.shape[0]
    dy_q = quantize_activation(dy, group_sizes, o.recipe, o.grad_dtype, True, o.executor)
    dlhs = m_grouped(
        dy_q.data, dy_q.scale, w, sw, group_sizes, group_offset, o.recipe, o.lhs_dtype, o.executor
    )
    G = w.shape[0]
    drhs = k_grouped(
        M,
        x_t,
        sx_t,
        dy_q.data_t,
        dy_q.scale_t,
        group_sizes,
        group_offset,
        None,
        G,
        o.recipe,
        jnp.float32,
        o.executor,
    )
    return dlhs, drhs.astype(o.rhs_dtype), None, None


ragged_dot_fp8.defvjp(_ragged_dot_fp8_fwd, _ragged_dot_fp8_bwd)
