"""The SwiGLU steps of the expert block as row kernels, for a GEMM that runs without the block's epilogues (the
warp-specialized FP8 kernels: docs/design.md, 'FP8 expert block'). The same formulas as the fused epilogues
(``m_grouped._swiglu_epilogue``, ``m_grouped._swiglu_bwd_columns``):

- ``swiglu_kernel``: z [R, 2n] (gate columns, then up) -> h [R, n] = silu(gate) * up.
- ``swiglu_bwd_kernel``: dh [R, n], the kept z and the rows' routing weights s [R] -> dz [R, 2n] =
  s * dh * swiglu'(z), s * h [R, n] and ds [R] = sum over n of dh * h, h rounded as the forward stored it;
  with ``AMAX``, amax [2] fp32 (zeroed by the caller) gets max |dz| and max |s * h| (atomic max), the tensorwise
  scales of the wgrad operands the block quantizes next, so no pass reads dz or s * h to find them. dh may be
  s * h's own buffer: each tile of dh is read before that tile of s * h is written.

All tensors contiguous; R rows are the grid's (no group sizes: every row is computed).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moegemm._src.kernels.m_grouped import _swiglu_bwd_columns

BLOCK_R = 32
BLOCK_N = 128
NUM_WARPS = 4


@triton.jit
def swiglu_kernel(z_ptr, h_ptr, R, N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    z_row = rows[:, None] * (2 * N)
    gate = tl.load(z_ptr + z_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(z_ptr + z_row + N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + rows[:, None] * N + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    dh_ptr, z_ptr, row_scale_ptr, dz_ptr, hs_ptr, ds_ptr, amax_ptr, R, N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, AMAX: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    s = tl.load(row_scale_ptr + rows, mask=row_mask, other=0.0)
    ds = tl.zeros((BLOCK_R,), dtype=tl.float32)
    dz_amax = 0.0
    hs_amax = 0.0
    for c in range(0, N, BLOCK_N):
        col0 = tl.program_id(0) * 0 + c  # a tensor in both modes (the interpreter's loop variable is an int)
        cols = col0 + tl.arange(0, BLOCK_N)
        dh = tl.load(
            dh_ptr + rows[:, None] * N + cols[None, :],
            mask=row_mask[:, None] & (cols < N)[None, :],
            other=0.0,
        ).to(tl.float32)
        ds_part, hs_part, dz_part = _swiglu_bwd_columns(
            dh, z_ptr, hs_ptr, dz_ptr, rows, row_mask, s, col0, N, BLOCK_N, AMAX
        )
        ds += ds_part
        hs_amax = tl.maximum(hs_amax, hs_part)
        dz_amax = tl.maximum(dz_amax, dz_part)
    tl.store(ds_ptr + rows, ds, mask=row_mask)
    if AMAX:
        tl.atomic_max(amax_ptr, dz_amax)
        tl.atomic_max(amax_ptr + 1, hs_amax)
