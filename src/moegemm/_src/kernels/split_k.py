"""Split reduction: ``out[r, n] = sum(partials[s, r, n] for s in range(SPLIT))``, in order (deterministic).

Shapes: partials [SPLIT, R, N] fp32 contiguous, what a split launch stores (``m_grouped_mm_kernel`` with
SPLIT_K > 1: R = M, the bias already in slice 0 and unowned rows 0 in every slice; ``k_grouped_mm_kernel``
with SPLIT_R > 1: R = G * K, an empty group 0 in every slice). out: [M, N] (GROUP_ROWS 0), or [G, K, N]
(GROUP_ROWS = K: row r is out[r // K, r % K]), in any float dtype and strides. One memory-bound pass
(docs/design.md, 'Split reduction').
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_R = 32
BLOCK_N = 128
NUM_WARPS = 4


@triton.jit
def reduce_kernel(
    partials_ptr,
    out_ptr,
    R,
    N: tl.constexpr,
    GROUP_ROWS: tl.constexpr,  # rows per group of a [G, K, N] out (K), or 0: out is [R, N]
    stride_og: tl.constexpr,
    stride_or: tl.constexpr,
    stride_on: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_r < R)[:, None] & (offs_n < N)[None, :]
    offs = offs_r[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        # s * R * N fits an int32 (plan.SPLIT_K_MAX_BYTES); R may be the constant 1 (Triton specializes it).
        acc += tl.load(partials_ptr + s * R * N + offs, mask=mask, other=0.0)
    if GROUP_ROWS > 0:
        rows = (offs_r // GROUP_ROWS) * stride_og + (offs_r % GROUP_ROWS) * stride_or
    else:
        rows = offs_r * stride_or
    tl.store(
        out_ptr + rows[:, None] + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask
    )


def grid(R: int, N: int) -> tuple[int, int]:
    return (triton.cdiv(R, BLOCK_R), triton.cdiv(N, BLOCK_N))
