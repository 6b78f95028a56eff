"""m-grouped GEMM kernel: ``for g: out[rows(g)] = x[rows(g)] @ w[g]``; unowned rows are written as 0.

Shapes: x [M, K], w [G, K, N] (any strides; an nn.Linear weight [G, N, K] is passed as ``w.mT``),
group_sizes [G] int32/int64 on the device, out [M, N].

Persistent kernel. The tile space is laid out group by group: group g owns
``cdiv(rows_g, BLOCK_M) * cdiv(N, BLOCK_N)`` consecutive tiles, and one extra slot (index G)
owns the unowned tail rows, which are zero-filled. The real number of tiles is only known on
the device, so the grid is ``min(upper bound, programs)`` and each program strides over the
tile space until the device-side total.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from moegemm.kernels.schedule import group_row_bounds, pick, swizzle_tile


@triton.jit
def m_grouped_mm_kernel(
    x_ptr, w_ptr, group_sizes_ptr,
    M, N, K, G,
    stride_xm, stride_xk,
    stride_wg, stride_wk, stride_wn,
    stride_om, stride_on,
    out_ptr,  # outputs come after every input and scalar (jax-triton's calling convention)
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_G: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot is wrong on bf16 operands
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    # Slot G collects the rows past sum(group_sizes): bounds [min(total, M), M).
    offs, starts, ends = group_row_bounds(group_sizes_ptr, G, M, BLOCK_G)
    owned = tl.max(tl.where(offs < G, ends, 0), 0)
    starts = tl.where(offs == G, owned, starts)
    ends = tl.where(offs == G, M, ends)
    n_tiles = tl.cdiv(N, BLOCK_N)
    m_tiles = tl.where(offs <= G, tl.cdiv(ends - starts, BLOCK_M), 0)
    tile_ends = tl.cumsum(m_tiles * n_tiles, 0)
    total_tiles = tl.max(tile_ends, 0)

    offs_m0 = tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, total_tiles, NUM_PROGRAMS):
        g = tl.sum((tile_ends <= tile).to(tl.int32), 0)
        g_m_tiles = pick(m_tiles, offs, g)
        local = tile - (pick(tile_ends, offs, g) - g_m_tiles * n_tiles)
        m_tile, n_tile = swizzle_tile(local, g_m_tiles, n_tiles, GROUP_M)
        rows = pick(starts, offs, g) + m_tile * BLOCK_M + offs_m0  # int64
        row_mask = rows < pick(ends, offs, g)
        cols = n_tile * BLOCK_N + offs_n0
        col_mask = cols < N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if g < G:
            x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
            w_ptrs = (
                w_ptr + g.to(tl.int64) * stride_wg
                + offs_k[:, None] * stride_wk + cols[None, :].to(tl.int64) * stride_wn
            )  # fmt: skip
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
                    b = tl.load(w_ptrs, mask=col_mask[None, :], other=0.0)
                else:
                    k_mask = offs_k < K - k * BLOCK_K
                    a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                    b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K * stride_wk
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :].to(tl.int64) * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@dataclasses.dataclass(frozen=True)
class MGroupedLaunch:
    """Grid and meta-parameters of one m_grouped_mm_kernel launch, derived from static shapes only."""

    grid: tuple[int]
    meta: dict

    @staticmethod
    def make(M: int, N: int, K: int, G: int, *, config, num_programs_cap: int, fp32_inputs: bool,
             interpret: bool) -> MGroupedLaunch:  # fmt: skip
        bm, bn = config.block_m, config.block_n
        # Each group adds at most one partial row tile, the tail slot one more.
        max_tiles = (triton.cdiv(M, bm) + G + 1) * triton.cdiv(N, bn)
        # num_programs_cap is one wave at one program per SM; a config may ask for several per SM.
        num_programs = max(1, min(max_tiles, num_programs_cap * config.ctas_per_sm))
        meta = dict(
            NUM_PROGRAMS=num_programs,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            BLOCK_G=max(16, triton.next_power_of_2(G + 1)),
            EVEN_K=K % config.block_k == 0,
            UPCAST=interpret,
            PRECISION="ieee" if fp32_inputs or interpret else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return MGroupedLaunch(grid=(num_programs,), meta=meta)
