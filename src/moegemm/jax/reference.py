"""Plain jax.numpy twins of the kernels: the test oracle and the CPU fallback.

Each public op of ``moegemm.jax`` has one twin with its signature, for high-precision operands and
for quantized ones (``Fp8Array``): the twin of a quantized op dequantizes the copies the kernel reads
and multiplies them in fp32 (precision HIGHEST).

Same semantics as the kernels and ``moegemm.torch.reference``, clamping included (the rule of
``moegemm._src.layout``): sizes clamp to [0, M], offsets are prefix sums clamped at M, rows past
sum(group_sizes) belong to no group. Unlike the torch twin they stay on the device (no sync), so
they run under jit and are differentiable. They compute densely over groups (a [G, M] row mask),
which is fine for an oracle and CPU fallback.

FP8 (private helpers below the public twins): the quantize twins reproduce the torch twin (and so
the kernels) bit for bit -- the same fp32 amax, ``scale = amax / FP8_MAX`` as a correctly rounded
fp32 division (1 where amax is 0), and ``clip(x * (1 / scale), -max, max)`` cast round-to-nearest-even
(the reciprocal correctly rounded once per scale, capped at the largest finite fp32).
group_sizes may be a traced int32 array under ``jax.jit`` (static shapes only; the groups become
masks, segment reductions, gathers and scatters).

The JAX storage layouts are ``moegemm._src.fp8``'s, row-major without row padding, except one: the
activations' blockwise ``scale`` is stored transposed, [cdiv(K, 128), M] (M-major; the kernel loads a
tile's row scales as one vector) where torch's is [M, cdiv(K, 128)].

Activations x [M, K] in G groups (G = 1 without group_sizes); rows past the last group quantize to 0
with scale 1 (rowwise, blockwise).

==========  ===========================  ==========================================================
recipe      scale                        scale_t
==========  ===========================  ==========================================================
tensorwise  [G] one per group            the same array
rowwise     [M] one per row              [G, K] one per (group, column); 1 for an empty group
blockwise   [cdiv(K,128), M] 1x128       [cdiv(M,128) + G, K] 128x1 blocks from each group's first
                                         row, group g's after those of groups < g; unused ones 1
==========  ===========================  ==========================================================

data [M, K]; data_t [K, transposed_columns(M, G)]: group g's rows are its columns
[t_g, t_g + rows_g), t_g = 16 * sum_{h<g} cdiv(rows_h, 16); every other column is 0.

Weights w [G, N, K]: data [G, N, K], data_t [G, K, N]; scale [G] (tensorwise), [G, N] with scale_t
[G, K] (rowwise: data_t is cast with scale_t), [G, cdiv(N,128), cdiv(K,128)] with scale_t
``swapaxes(scale, 1, 2)`` (blockwise).

Note: XLA rewrites ``a / broadcast(b)`` (and a division by a constant) into a multiply by the
reciprocal, up to 1 ulp off the kernels' division; every division here goes through
:func:`_divide`, whose optimization barrier keeps the divisor opaque to that rewrite. Bit for bit
holds where XLA's fp32 division is correctly rounded (CPU, tested); on a GPU XLA's is not, so a
scale may be 1 ulp off there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from moegemm._src import fp8, layout

__all__ = [
    "k_grouped_mm_reference",
    "m_grouped_mm_reference",
    "moe_experts_reference",
    "ragged_dot_reference",
]

_AmaxReduce = Callable[[jax.Array], jax.Array] | None
_Quantized = tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]

_HIGHEST = jax.lax.Precision.HIGHEST


def _group_mask(
    group_sizes: jax.Array, M: int, group_offset=None, num_groups: int | None = None
) -> jax.Array:
    """[G, M] bool: mask[g, r] = row r belongs to group g (``moegemm._src.layout``'s rule).

    With ``group_offset`` (expert parallelism): [num_groups, M], the masks of groups
    [offset, offset + num_groups) of the G_total in group_sizes (``layout.local_groups``).
    """
    if group_offset is not None:
        first_row, local_sizes = layout.local_groups(group_sizes, group_offset, num_groups, M, jnp)
        # Rows before first_row form a leading group, dropped.
        return _group_mask(jnp.concatenate([first_row[None], local_sizes]), M)[1:]
    starts, ends = layout.group_layout(group_sizes, M, jnp)
    rows = jnp.arange(M, dtype=jnp.int32)
    return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])


def _quantized(op: str, names: tuple[str, str], a, b) -> bool:
    """True if both operands are ``Fp8Array``s, False if neither is; raises naming both if mixed."""
    from moegemm.jax.api import _quantized as check  # api imports this module

    return check(op, names, a, b)


def m_grouped_mm_reference(
    x,
    w,
    group_sizes: jax.Array,
    *,
    transpose_w: bool | None = None,
    group_offset=None,
    out_dtype=None,
    compute_dtype=jnp.float32,
) -> jax.Array:
    """x [M, K], W = w [G, K, N] (w[g]^T with ``transpose_w``: w stored [G, N, K]) -> out [M, N];
    for g: out[rows(g)] = x[rows(g)] @ W[g]; unowned rows 0.

    group_offset: w holds groups [offset, offset + G) of the G_total in group_sizes; rows of other
    groups are 0. Quantized x and w (``Fp8Array``): the twin of ``moegemm.jax.m_grouped_mm``'s FP8
    path; it dequantizes x's data and the copy of w the kernel reads (w's data [G, N, K] read as
    w[g]^T unless transpose_w=False, then its transposed copy), out_dtype defaulting to bfloat16.
    """
    if _quantized("m_grouped_mm_reference", ("x", "w"), x, w):
        w_data, w_scale = (w.data_t, w.scale_t) if transpose_w is False else (w.data, w.scale)
        if w_data is None:
            raise ValueError("transpose_w=False reads w's transposed copy: quantize w with transpose=True")
        return _m_grouped_mm_fp8(
            x.data, x.scale, w_data[:, :, : x.shape[1]], w_scale, group_sizes, x.recipe,
            out_dtype or jnp.bfloat16, group_offset=group_offset,
        )  # fmt: skip
    W = jnp.swapaxes(w, 1, 2) if transpose_w else w
    mask = _group_mask(group_sizes, x.shape[0], group_offset, W.shape[0])
    xg = jnp.where(mask[:, :, None], x.astype(compute_dtype)[None], 0)
    out = jnp.einsum("gmk,gkn->mn", xg, W.astype(compute_dtype), precision=_HIGHEST)
    return out.astype(out_dtype or x.dtype)


def k_grouped_mm_reference(
    a,
    b,
    group_sizes: jax.Array | None,
    *,
    c: jax.Array | None = None,
    group_offset=None,
    num_groups: int | None = None,
    out_dtype=jnp.float32,
    compute_dtype=jnp.float32,
) -> jax.Array:
    """a [M, K], b [M, N] -> out [G, K, N]; for g: out[g] = (c[g] +) a[rows(g)]^T @ b[rows(g)].

    With c, an empty group's out[g] is c[g] bit for bit (as the kernel, which skips it: 0 + -0.0
    would be +0.0). group_offset: out holds the num_groups groups [offset, offset + num_groups) of
    the G_total in group_sizes. Quantized a and b (``Fp8Array``s with transposed copies): the
    dequantized transposed copies (what the wgrad kernel reads); group_sizes defaults to a's.
    """
    if _quantized("k_grouped_mm_reference", ("a", "b"), a, b):
        return _k_grouped_mm_fp8(
            a.shape[0], a.data_t, a.scale_t, b.data_t, b.scale_t,
            a.group_sizes if group_sizes is None else group_sizes, a.recipe, out_dtype,
            c=c, group_offset=group_offset, num_groups=num_groups,
        )  # fmt: skip
    mask = _group_mask(group_sizes, a.shape[0], group_offset, num_groups)
    cast = lambda t: t.astype(compute_dtype)
    out = jnp.einsum("gm,mk,mn->gkn", cast(mask), cast(a), cast(b), precision=_HIGHEST)
    if c is not None:
        live = mask.any(axis=1)[:, None, None]
        return jnp.where(live, (out + c.astype(compute_dtype)).astype(c.dtype), c)
    return out.astype(out_dtype)


def ragged_dot_reference(lhs, rhs, group_sizes: jax.Array, *, group_offset=None, out_dtype=None) -> jax.Array:
    """jax.lax.ragged_dot semantics, with megablox-style group_offset (rows of non-local groups are 0):
    ``m_grouped_mm_reference(lhs, rhs, group_sizes, transpose_w=False)``. A quantized rhs is the
    quantized [G, K, N] weight, read through its transposed copy (the K-major one)."""
    return m_grouped_mm_reference(
        lhs, rhs, group_sizes, transpose_w=False, group_offset=group_offset, out_dtype=out_dtype
    )


# ---------------------------------------------------------------- FP8: scales and casts


def _fp8_max(dtype: DTypeLike) -> float:
    name = jnp.dtype(dtype).name
    if name not in fp8.FP8_MAX:
        raise ValueError(f"fp8 dtype must be one of {tuple(fp8.FP8_MAX)}, got {name}")
    return fp8.FP8_MAX[name]


def _divide(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den as an elementwise fp32 IEEE division (den broadcast to num's shape first)."""
    den = jnp.broadcast_to(den, num.shape)
    return num / jax.lax.optimization_barrier(den)


def _scale_of(amax: jax.Array, dtype: DTypeLike) -> jax.Array:
    """amax (any shape) -> fp32 amax / FP8_MAX[dtype]; 1 where amax is 0 (the kernels' rule)."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, _divide(amax, jnp.full_like(amax, _fp8_max(dtype))), jnp.float32(1))


def _cast(x: jax.Array, scale: jax.Array, dtype: DTypeLike) -> jax.Array:
    """x, scale (broadcastable to x) -> clip(x * inv, -max, max) in ``dtype``, round-to-nearest-even, where
    inv = min(1 / scale, the largest finite fp32), correctly rounded (the kernels' multiplier)."""
    m = _fp8_max(dtype)
    scale = jnp.asarray(scale, jnp.float32)
    inv = jnp.minimum(_divide(jnp.ones_like(scale), scale), jnp.finfo(jnp.float32).max)
    # The barrier keeps XLA from folding x * (1 / scale) back into a division.
    inv = jnp.broadcast_to(jax.lax.optimization_barrier(inv), x.shape)
    return jnp.clip(x.astype(jnp.float32) * inv, -m, m).astype(dtype)


# ---------------------------------------------------------------- group geometry (traced sizes)


def _reduce(amax_reduce: _AmaxReduce, amax: jax.Array) -> jax.Array:
    return amax if amax_reduce is None else amax_reduce(amax)


def _row_groups(group_sizes: jax.Array | None, M: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(group of each row [M] (G for rows past the last group), starts [G], ends [G]), int32."""
    if group_sizes is None:
        starts, ends = jnp.zeros(1, jnp.int32), jnp.full(1, M, jnp.int32)
    else:
        starts, ends = layout.group_layout(group_sizes, M, jnp)
    rows = jnp.searchsorted(ends, jnp.arange(M, dtype=jnp.int32), side="right").astype(jnp.int32)
    return rows, starts, ends


def _transposed_rows(group_sizes: jax.Array | None, M: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each row [M] of x lives in the transposed copy, int32:

    (its group (G for unowned rows), its column of data_t (transposed_columns(M, G) for unowned
    rows: out of range), its 128x1 block of the blockwise scale_t (cdiv(M, 128) + G for unowned)).
    """
    G = 1 if group_sizes is None else group_sizes.shape[0]
    g, starts, ends = _row_groups(group_sizes, M)
    sizes = ends - starts
    units = -(-sizes // fp8.ROW_ALIGN)
    t_start = (jnp.cumsum(units) - units) * fp8.ROW_ALIGN
    blocks = -(-sizes // fp8.SCALE_BLOCK)
    block_base = jnp.cumsum(blocks) - blocks
    owned = g < G
    gc = jnp.minimum(g, G - 1)
    local = jnp.arange(M, dtype=jnp.int32) - starts[gc]
    cols = jnp.where(owned, t_start[gc] + local, fp8.transposed_columns(M, G))
    block = jnp.where(owned, block_base[gc] + local // fp8.SCALE_BLOCK, fp8.cdiv(M, fp8.SCALE_BLOCK) + G)
    return g, cols, block


def _segment_amax(a: jax.Array, segments: jax.Array, n: int) -> jax.Array:
    """a [M, ...] >= 0, segments [M] sorted in [0, n] -> [n, ...] max over each segment's rows (0 if
    none); rows of segment n are dropped."""
    out = jax.ops.segment_max(a, segments, num_segments=n + 1, indices_are_sorted=True)[:n]
    return jnp.maximum(out, 0)


def _blocks(scale: jax.Array, axes: tuple[int, ...], sizes: tuple[int, ...]) -> jax.Array:
    """Each block scale repeated over its 128 elements along ``axes``, cut to ``sizes``."""
    for axis, size in zip(axes, sizes):
        scale = jax.lax.slice_in_dim(jnp.repeat(scale, fp8.SCALE_BLOCK, axis), 0, size, axis=axis)
    return scale


def _block_amax(a: jax.Array, axis: int) -> jax.Array:
    """a >= 0 -> the max over each 128-wide block along ``axis`` (zero-padded at the end)."""
    n = a.shape[axis]
    nb = fp8.cdiv(n, fp8.SCALE_BLOCK)
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, nb * fp8.SCALE_BLOCK - n)
    a = jnp.pad(a, pad)
    a = a.reshape(a.shape[:axis] + (nb, fp8.SCALE_BLOCK) + a.shape[axis + 1 :])
    return jnp.max(a, axis=axis + 1, initial=0.0)


def _tensorwise_scale(scale: jax.Array, G: int) -> jax.Array:
    scale = jnp.asarray(scale).reshape(-1)
    if scale.shape[0] not in (1, G):
        raise ValueError(f"tensorwise scale has {scale.shape[0]} entries for {G} groups (want {G} or 1)")
    return jnp.broadcast_to(scale, (G,))


# ---------------------------------------------------------------- quantize twins


def _quantize_activation(
    x: jax.Array,
    group_sizes: jax.Array | None,
    recipe: fp8.Recipe,
    dtype: DTypeLike,
    transpose: bool,
    *,
    amax_reduce: _AmaxReduce = None,
) -> _Quantized:
    """x [M, K] (bf16/fp16/fp32), group_sizes [G] int32 or None (one group) -> (data [M, K],
    scale, data_t [K, transposed_columns(M, G)] or None, scale_t or None) in the module's layouts.

    Rows past the last group quantize to 0. ``amax_reduce`` (e.g. ``lambda a: jax.lax.pmax(a, axes)``)
    is applied to every amax array, shaped as the scale it becomes, before the scale is computed.
    """
    fp8.check_recipe(recipe)
    _fp8_max(dtype)
    M, K = x.shape
    G = 1 if group_sizes is None else group_sizes.shape[0]
    g, cols, block = _transposed_rows(group_sizes, M)
    owned = g < G
    xf = jnp.where(owned[:, None], x.astype(jnp.float32), 0)  # unowned rows: amax 0, scale 1, data 0
    ax = jnp.abs(xf)
    M_t = fp8.transposed_columns(M, G)

    def transposed(rows_fp8: jax.Array) -> jax.Array:
        """[M, K] fp8 rows -> data_t [K, M_t]: row r to column cols[r] (unowned rows dropped)."""
        return jnp.zeros((K, M_t), dtype).at[:, cols].set(rows_fp8.T, mode="drop")

    if recipe == "tensorwise":
        amax = _segment_amax(jnp.max(ax, axis=1, initial=0.0), g, G)
        scale = _scale_of(_reduce(amax_reduce, amax), dtype)
        data = _cast(xf, jnp.append(scale, 1.0)[g][:, None], dtype)
        if not transpose:
            return data, scale, None, None
        return data, scale, transposed(data), scale
    if recipe == "rowwise":
        scale = _scale_of(_reduce(amax_reduce, jnp.max(ax, axis=1, initial=0.0)), dtype)
        data = _cast(xf, scale[:, None], dtype)
        if not transpose:
            return data, scale, None, None
        scale_t = _scale_of(_reduce(amax_reduce, _segment_amax(ax, g, G)), dtype)
        rows_t = _cast(xf, jnp.concatenate([scale_t, jnp.ones((1, K), jnp.float32)])[g], dtype)
        return data, scale, transposed(rows_t), scale_t
    scale = _scale_of(_reduce(amax_reduce, _block_amax(ax, 1).T), dtype)  # [kb, M]
    data = _cast(xf, _blocks(scale.T, (1,), (K,)), dtype)
    if not transpose:
        return data, scale, None, None
    n_blocks = fp8.cdiv(M, fp8.SCALE_BLOCK) + G
    scale_t = _scale_of(_reduce(amax_reduce, _segment_amax(ax, block, n_blocks)), dtype)
    rows_t = _cast(xf, jnp.concatenate([scale_t, jnp.ones((1, K), jnp.float32)])[block], dtype)
    return data, scale, transposed(rows_t), scale_t


def _quantize_weight(
    w: jax.Array,
    recipe: fp8.Recipe,
    dtype: DTypeLike,
    transpose: bool,
    *,
    amax_reduce: _AmaxReduce = None,
) -> _Quantized:
    """w [G, N, K] -> (data [G, N, K], scale, data_t [G, K, N] or None, scale_t or None).

    tensorwise: scale [G]; rowwise: scale [G, N], scale_t [G, K] (data_t _cast with it); blockwise:
    scale [G, cdiv(N,128), cdiv(K,128)], scale_t its swapaxes(1, 2). ``amax_reduce`` is applied to
    every amax array before its scale is computed.
    """
    fp8.check_recipe(recipe)
    _fp8_max(dtype)
    G, N, K = w.shape
    wf = w.astype(jnp.float32)
    aw = jnp.abs(wf)
    if recipe == "tensorwise":
        scale = _scale_of(_reduce(amax_reduce, jnp.max(aw, axis=(1, 2), initial=0.0)), dtype)
        data = _cast(wf, scale[:, None, None], dtype)
        if not transpose:
            return data, scale, None, None
        return data, scale, jnp.swapaxes(data, 1, 2), scale
    if recipe == "rowwise":
        scale = _scale_of(_reduce(amax_reduce, jnp.max(aw, axis=2, initial=0.0)), dtype)
        data = _cast(wf, scale[:, :, None], dtype)
        if not transpose:
            return data, scale, None, None
        scale_t = _scale_of(_reduce(amax_reduce, jnp.max(aw, axis=1, initial=0.0)), dtype)
        return data, scale, jnp.swapaxes(_cast(wf, scale_t[:, None, :], dtype), 1, 2), scale_t
    scale = _scale_of(_reduce(amax_reduce, _block_amax(_block_amax(aw, 1), 2)), dtype)
    data = _cast(wf, _blocks(scale, (1, 2), (N, K)), dtype)
    if not transpose:
        return data, scale, None, None
    return data, scale, jnp.swapaxes(data, 1, 2), jnp.swapaxes(scale, 1, 2)


# ---------------------------------------------------------------- dequantization


def _dequantize_activation(
    data: jax.Array,
    scale: jax.Array,
    recipe: fp8.Recipe,
    group_sizes: jax.Array | None,
    *,
    dtype: DTypeLike = jnp.float32,
) -> jax.Array:
    """data [M, K] fp8, scale (the recipe's layout) -> [M, K] data * scale in ``dtype`` (computed in
    fp32); rows past the last group are 0. A tensorwise scale may be a single one."""
    fp8.check_recipe(recipe)
    M, K = data.shape
    G = 1 if group_sizes is None else group_sizes.shape[0]
    g, _, _ = _row_groups(group_sizes, M)
    x = data.astype(jnp.float32)
    s = jnp.asarray(scale).astype(jnp.float32)
    if recipe == "tensorwise":
        s = _tensorwise_scale(s, G)[jnp.minimum(g, G - 1)][:, None]
    elif recipe == "rowwise":
        s = s[:, None]
    else:
        s = _blocks(s.T, (1,), (K,))
    return jnp.where((g < G)[:, None], x * s, 0).astype(dtype)


def _dequantize_activation_t(
    data_t: jax.Array,
    scale_t: jax.Array,
    recipe: fp8.Recipe,
    group_sizes: jax.Array | None,
    M: int,
    *,
    dtype: DTypeLike = jnp.float32,
) -> jax.Array:
    """The transposed copy data_t [K, transposed_columns(M, G)], scale_t -> x's [M, K] layout,
    data * scale in ``dtype`` (computed in fp32); rows past the last group are 0."""
    fp8.check_recipe(recipe)
    G = 1 if group_sizes is None else group_sizes.shape[0]
    g, cols, block = _transposed_rows(group_sizes, M)
    owned = g < G
    x = jnp.take(data_t, jnp.minimum(cols, data_t.shape[1] - 1), axis=1).T.astype(jnp.float32)
    s = jnp.asarray(scale_t).astype(jnp.float32)
    if recipe == "tensorwise":
        s = _tensorwise_scale(s, G)[jnp.minimum(g, G - 1)][:, None]
    elif recipe == "rowwise":
        s = s[jnp.minimum(g, G - 1)]
    else:
        s = s[jnp.minimum(block, s.shape[0] - 1)]
    return jnp.where(owned[:, None], x * s, 0).astype(dtype)


def _dequantize_weight(
    data: jax.Array, scale: jax.Array, recipe: fp8.Recipe, *, dtype: DTypeLike = jnp.float32
) -> jax.Array:
    """data [G, N, K] fp8, scale (the recipe's weight layout) -> [G, N, K] data * scale in ``dtype``."""
    fp8.check_recipe(recipe)
    G, N, K = data.shape
    x = data.astype(jnp.float32)
    s = jnp.asarray(scale).astype(jnp.float32)
    if recipe == "tensorwise":
        return (x * s[:, None, None]).astype(dtype)
    if recipe == "rowwise":
        return (x * s[:, :, None]).astype(dtype)
    return (x * _blocks(s, (1, 2), (N, K))).astype(dtype)


# ---------------------------------------------------------------- GEMM twins


def _m_grouped_mm_fp8(
    x: jax.Array,
    sx: jax.Array,
    w: jax.Array,
    sw: jax.Array,
    group_sizes: jax.Array | None,
    recipe: fp8.Recipe,
    out_dtype: DTypeLike,
    *,
    x_group_sizes: jax.Array | None = None,
    group_offset: jax.Array | None = None,
) -> jax.Array:
    """x [M, K] fp8 with scale sx, w [G, N, K] fp8 with scale sw -> out [M, N] in ``out_dtype``:
    for each local group g, out[rows(g)] = (x * sx)[rows(g)] @ ((w * sw)[g])^T in fp32; other rows 0.

    group_offset (int32 scalar): group_sizes holds all G_total groups and w the G local ones
    [offset, offset + G). x_group_sizes: the sizes x was quantized with (default group_sizes, which
    a tensorwise sx must then match entry for entry; a single tensorwise scale needs neither).
    """
    fp8.check_recipe(recipe)
    M = x.shape[0]
    G = w.shape[0]
    if group_offset is None and group_sizes is not None and group_sizes.shape[0] != G:
        raise ValueError(f"group_sizes has {group_sizes.shape[0]} entries for {G} weight groups")
    if group_sizes is None and (G != 1 or group_offset is not None):
        raise ValueError("group_sizes=None means one group of all rows")
    scale_groups = group_sizes if x_group_sizes is None and jnp.size(sx) > 1 else x_group_sizes
    xd = _dequantize_activation(x, sx, recipe, scale_groups)
    wd = _dequantize_weight(w, sw, recipe)
    if group_sizes is None:
        mask = jnp.ones((1, M), bool)
    else:
        mask = _group_mask(group_sizes, M, group_offset, G if group_offset is not None else None)
    xg = jnp.where(mask[:, :, None], xd[None], 0)
    return jnp.einsum("gmk,gnk->mn", xg, wd, precision=_HIGHEST).astype(out_dtype)


def _k_grouped_mm_fp8(
    M: int,
    a_t: jax.Array,
    sa: jax.Array,
    b_t: jax.Array,
    sb: jax.Array,
    group_sizes: jax.Array,
    recipe: fp8.Recipe,
    out_dtype: DTypeLike,
    *,
    c: jax.Array | None = None,
    group_offset: jax.Array | None = None,
    num_groups: int | None = None,
) -> jax.Array:
    """Transposed copies a_t [Ka, M_t] (scale_t sa), b_t [Nb, M_t] (scale_t sb) of M-row activations
    -> out [G, Ka, Nb]: for g, out[g] = (c[g] +) (a * sa)[rows(g)]^T @ (b * sb)[rows(g)] in fp32.

    Without c the result is in ``out_dtype``; with c (fp32 [G, Ka, Nb]) it is in c's dtype and an
    empty group's out[g] is c[g] bit for bit. group_offset (int32 scalar): out holds the num_groups
    groups [offset, offset + num_groups) (default c's count) of the G_total in group_sizes; the
    transposed copies were laid out with all G_total groups.
    """
    fp8.check_recipe(recipe)
    if group_offset is None:
        if num_groups is not None and num_groups != group_sizes.shape[0]:
            raise ValueError(f"num_groups={num_groups} without group_offset must be {group_sizes.shape[0]}")
        mask = _group_mask(group_sizes, M)
    else:
        if num_groups is None:
            if c is None:
                raise ValueError("group_offset needs num_groups (or c)")
            num_groups = c.shape[0]
        mask = _group_mask(group_sizes, M, group_offset, num_groups)
    ad = _dequantize_activation_t(a_t, sa, recipe, group_sizes, M)
    bd = _dequantize_activation_t(b_t, sb, recipe, group_sizes, M)
    ag = jnp.where(mask[:, :, None], ad[None], 0)
    out = jnp.einsum("gmk,mn->gkn", ag, bd, precision=_HIGHEST)
    if c is None:
        return out.astype(out_dtype)
    live = mask.any(axis=1)[:, None, None]
    return jnp.where(live, (out + c.astype(jnp.float32)).astype(c.dtype), c)


def moe_experts_reference(
    x,
    topk_ids,
    topk_weights,
    w13,
    w2,
    *,
    activation: str = "swiglu",
    compute_dtype=jnp.float32,
    expert_base=None,
) -> jax.Array:
    """The expert block in jax.numpy (differentiable by autodiff, no sync, runs under jit):
    ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u)``, ``(g, u) = split(w13[e] @ x[t])``,
    ``e = topk_ids[t, j]``.

    x [T, d]; topk_ids [T, k]; topk_weights [T, k]; w13 [E, 2n, d] (rows [0, n) gate, [n, 2n) up); w2 [E, d, n]
    -> out [T, d] in x's dtype. The kernels' clamps: an id outside [0, E) is clamped into it, a non-finite weight
    counts as 0. Rows sorted by expert and two ``jax.lax.ragged_dot`` in ``compute_dtype``, without the kernels'
    roundings of the fc1 output and the activation.

    ``expert_base`` (expert parallelism, docs/design.md, 'Expert parallelism'; a Python int or a traced int32
    scalar): w13 and w2 hold the E experts [expert_base, expert_base + E) of a larger set; topk_ids are global
    ids, and a choice of any other expert is absent: it adds nothing, and its weight's gradient is 0."""
    if activation != "swiglu":
        raise ValueError(f"moe_experts_reference: activation {activation!r}; supported: 'swiglu'")
    (T, d), (E, two_n, _), k = x.shape, w13.shape, topk_ids.shape[1]
    n = two_n // 2
    if T * k == 0 or E == 0:
        return jnp.zeros((T, d), x.dtype)
    weights = topk_weights.reshape(-1).astype(compute_dtype)
    weights = jnp.where(jnp.isfinite(weights), weights, 0)
    if expert_base is None:
        ids = jnp.clip(topk_ids.reshape(-1), 0, E - 1).astype(jnp.int32)
    else:
        ids = topk_ids.reshape(-1).astype(jnp.int32) - jnp.asarray(expert_base, jnp.int32)
        absent = (ids < 0) | (ids >= E)
        ids = jnp.where(absent, E, ids)  # sorted after every group: rows ragged_dot leaves 0
        weights = jnp.where(absent, 0, weights)
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.zeros(E + 1, jnp.int32).at[ids].add(1)[:E]
    rows = x.astype(compute_dtype)[order // k]

    def dot(a, w):  # for e: a[rows(e)] @ w[e]^T
        return jax.lax.ragged_dot(a, jnp.swapaxes(w, 1, 2).astype(compute_dtype), sizes, precision=_HIGHEST)

    z = dot(rows, w13)
    y = dot(jax.nn.silu(z[:, :n]) * z[:, n:], w2)
    weights = weights[order]
    out_rows = jnp.zeros((T * k, d), compute_dtype).at[order].set(y * weights[:, None])
    return out_rows.reshape(T, k, d).sum(1).astype(x.dtype)
