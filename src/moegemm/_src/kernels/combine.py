"""Combine: ``out[t] = sum_j weight[t, j] * rows[pos[t, j]]`` (j = 0 .. TOP_K - 1 in order: deterministic).

Shapes: rows [R, D] (row stride any, unit column stride), pos [T, TOP_K] int32 (the row of each (token, choice)),
weight [T, TOP_K] float or none (HAS_WEIGHT off: every weight 1), out [T, D] (row stride any, unit column stride).
The expert block's last step and its dx (docs/design.md, 'Fused expert block'): each token's k rows are read once
and summed in fp32. A negative position is an absent choice (an expert on another rank, docs/design.md, 'Expert
parallelism'): it adds nothing and its row is not read. A position past R is clamped into [0, R), and a
non-finite weight counts as 0.

``gather_rows_kernel``: the rows of a row index up to a device-side count (the expert-parallel wgrads' copies).
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_T = 8
BLOCK_D = 256
NUM_WARPS = 4


@triton.jit
def combine_kernel(
    rows_ptr,
    pos_ptr,
    weight_ptr,
    out_ptr,
    T,
    R,
    D: tl.constexpr,
    TOP_K: tl.constexpr,
    stride_rm: tl.constexpr,
    stride_om: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = offs_t < T
    mask = t_mask[:, None] & (offs_d < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + offs_t * TOP_K + j, mask=t_mask, other=-1).to(tl.int64)
        present = p >= 0
        p = tl.minimum(tl.maximum(p, 0), R - 1)
        row = tl.load(
            rows_ptr + p[:, None] * stride_rm + offs_d[None, :], mask=mask & present[:, None], other=0.0
        ).to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + offs_t * TOP_K + j, mask=t_mask, other=0.0).to(tl.float32)
            w = tl.where(w - w == 0.0, w, 0.0)  # inf - inf and nan - nan are nan: a non-finite weight is 0
            row = row * w[:, None]
        acc += row
    tl.store(
        out_ptr + offs_t[:, None] * stride_om + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask
    )


def grid(T: int, D: int) -> tuple[int, int]:
    return (triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))


@triton.jit
def gather_rows_kernel(
    src_ptr,
    index_ptr,
    group_sizes_ptr,
    out_ptr,
    S,
    R,
    G,
    D: tl.constexpr,
    stride_sm: tl.constexpr,
    stride_om: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out[r] = src[index[r]]`` for the rows r < sum(group_sizes) (at most R); the rows past them are neither
    read nor written. Shapes: src [S, D], index [R] int32 (clamped into [0, S)), group_sizes [G], out [R, D]
    (row strides any, unit column strides). The expert-parallel local step's wgrad operands in expert order
    (docs/design.md, 'Expert parallelism'): only the routed rows move, not the absent ones after them."""
    offs_g = tl.arange(0, BLOCK_G)
    sizes = tl.load(group_sizes_ptr + offs_g, mask=offs_g < G, other=0).to(tl.int64)
    total = tl.minimum(tl.sum(tl.maximum(sizes, 0), 0), R)
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    if row0 < total:
        offs_r = row0 + tl.arange(0, BLOCK_R)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        r_mask = offs_r < total
        mask = r_mask[:, None] & (offs_d < D)[None, :]
        idx = tl.load(index_ptr + offs_r, mask=r_mask, other=0).to(tl.int64)
        idx = tl.minimum(tl.maximum(idx, 0), S - 1)
        rows = tl.load(src_ptr + idx[:, None] * stride_sm + offs_d[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + offs_r[:, None] * stride_om + offs_d[None, :], rows, mask=mask)


GATHER_BLOCK_R = 16
GATHER_BLOCK_D = 512


def gather_rows_grid(R: int, D: int) -> tuple[int, int]:
    return (triton.cdiv(R, GATHER_BLOCK_R), triton.cdiv(D, GATHER_BLOCK_D))
