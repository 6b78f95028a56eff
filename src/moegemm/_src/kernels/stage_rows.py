"""Row staging: ``dst[b, r, :C] = src[b, r, :]; dst[b, r, C:] = 0`` with dst's rows padded to ``C_PAD``.

Shapes: src [B, R, C] with a unit column stride and any other strides (rows that are not 16-byte aligned:
an odd C, or odd strides), dst [B, R, C_PAD] contiguous, C_PAD a multiple of 16 bytes' worth of elements.
The GEMM kernels then read dst's rows in whole 16-byte vectors, their masks stopping at C_PAD (LOAD_PAD;
docs/design.md, 'Unaligned rows'). One pass: src is read once (element by element, coalesced: its rows allow
nothing wider) and dst written once in vectors, padding included.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_R = 16
BLOCK_C = 256
NUM_WARPS = 4


@triton.jit
def stage_rows_kernel(
    src_ptr,
    dst_ptr,
    rows,  # B * R
    R,
    stride_sb,
    stride_sr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    b = offs_r // R
    r = offs_r % R
    row_mask = offs_r < rows
    src = src_ptr + (b * stride_sb + r * stride_sr)[:, None] + offs_c[None, :]
    tile = tl.load(src, mask=row_mask[:, None] & (offs_c < C)[None, :], other=0.0)
    dst = dst_ptr + (offs_r * C_PAD)[:, None] + offs_c[None, :]
    tl.store(dst, tile, mask=row_mask[:, None] & (offs_c < C_PAD)[None, :])


def grid(rows: int, c_pad: int) -> tuple[int, int]:
    return (triton.cdiv(rows, BLOCK_R), triton.cdiv(c_pad, BLOCK_C))
