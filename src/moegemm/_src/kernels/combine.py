"""Combine: ``out[t] = sum_j weight[t, j] * rows[pos[t, j]]`` (j = 0 .. TOP_K - 1 in order: deterministic).

Shapes: rows [R, D] (row stride any, unit column stride), pos [T, TOP_K] int32 (the row of each (token, choice)),
weight [T, TOP_K] float or none (HAS_WEIGHT off: every weight 1), out [T, D] (row stride any, unit column stride).
The expert block's last step and its dx (docs/design.md, 'Fused expert block'): each token's k rows are read once
and summed in fp32. A negative position is an absent choice (an expert on another rank, docs/design.md, 'Expert
parallelism'): it adds nothing and its row is not read. A position past R is clamped into [0, R), and a
non-finite weight counts as 0.
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
