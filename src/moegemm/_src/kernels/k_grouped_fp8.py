"""Scaled k-grouped GEMM (FP8 wgrad): ``for g: out[g] (+)= (a * sa)[rows(g)]^T @ (b * sb)[rows(g)]``.

The operands come as the quantize kernels' transposed copies, contiguous along tokens (the
contraction, which Hopper's FP8 wgmma wants K-major): a_t [Ka, M_t] and b_t [Nb, M_t], group g's
tokens in columns [t_g, t_g + rows_g) with t_g = 16 * sum_{h<g} cdiv(rows_h, 16), and zeros up to the
next multiple of 16 (``moegemm._src.fp8``).
out [G, Ka, Nb] (fp32, or bf16/fp16 without accumulate). For the weight gradient of y = x @ w^T:
a = dy, b = x, out = dW in the [G, N, K] layout of the weight.

Scales, by SCALING: TENSOR ``sa[g]``, ``sb[g]``; ROW ``sa[g, ka]``, ``sb[g, nb]`` (both in the
epilogue); BLOCK ``sa[blk, ka]``, ``sb[blk, nb]`` per 128-token block, blocks starting at each
group's first token (blk = sum_{h<g} cdiv(rows_h, 128) + i), promoted into fp32 every step.
An empty group writes exact zeros, or, accumulating, leaves out[g] untouched (as the BF16 kernel).
Expert parallelism (``HAS_GROUP_OFFSET``): the transposed copies and their scales are laid out over all
G_TOTAL groups of group_sizes, and out holds the G groups [offset, offset + G), offset =
``*group_offset_ptr``; their tokens are read in place.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from moegemm._src.kernels.m_grouped_fp8 import SCALINGS
from moegemm._src.kernels.quantize_fp8 import T_ALIGN  # the data_t layout both kernels agree on
from moegemm._src.kernels.schedule import (
    aligned_group_offsets,
    clamped_group_offset,
    group_row_bounds,
    pick,
    swizzle_tile,
)


@triton.jit
def k_grouped_mm_fp8_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    group_sizes_ptr,
    group_offset_ptr,  # int32 [1]: the first local group (read only with HAS_GROUP_OFFSET)
    c_ptr,
    out_ptr,
    M,
    N,
    K,
    G,
    G_TOTAL,  # entries of group_sizes (G without a group offset)
    stride_ak,
    stride_ar: tl.constexpr,
    stride_bn,
    stride_br: tl.constexpr,
    stride_og: tl.constexpr,
    stride_ok: tl.constexpr,
    stride_on: tl.constexpr,
    stride_sag,  # TENSOR, ROW: per group; BLOCK: per token block
    stride_sak,
    stride_sbg,
    stride_sbn,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_G: tl.constexpr,  # >= G_TOTAL
    HAS_GROUP_OFFSET: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    SCALING: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    # Every group's bounds, token columns and scale blocks: a local group's come after all groups before it.
    offs, starts, ends = group_row_bounds(group_sizes_ptr, G_TOTAL, M, BLOCK_G)
    if HAS_GROUP_OFFSET:
        first_group = clamped_group_offset(group_offset_ptr, G, G_TOTAL)
    else:
        first_group = 0
    t_units = aligned_group_offsets(offs, starts, ends, G_TOTAL, T_ALIGN)
    block_base = aligned_group_offsets(
        offs, starts, ends, G_TOTAL, SCALE_BLOCK
    )  # first 128-token scale block
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_group = k_tiles * n_tiles
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    if WIDE_OFFSETS:
        offs_k = offs_k.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        offs_r = offs_r.to(tl.int64)
    for tile in range(pid, G * tiles_per_group, NUM_PROGRAMS):
        g_out = tile // tiles_per_group
        g = first_group + g_out  # the group in group_sizes, the operands and their scales
        k_tile, n_tile = swizzle_tile(tile % tiles_per_group, k_tiles, n_tiles, GROUP_M)
        rows = pick(ends, offs, g) - pick(starts, offs, g)
        col0 = pick(t_units, offs, g) * T_ALIGN  # a multiple of 16 that Triton can see
        k0 = (k_tile * BLOCK_K).to(tl.int64)
        n0 = (n_tile * BLOCK_N).to(tl.int64)
        k_mask = offs_k < K - k0
        n_mask = offs_n < N - n0
        a_base = a_ptr + k0 * stride_ak + col0 * stride_ar
        b_base = b_ptr + n0 * stride_bn + col0 * stride_br
        a_offs = offs_k[:, None] * stride_ak + offs_r[None, :] * stride_ar
        b_offs = offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br
        if SCALING == 2:
            g_block = pick(block_base, offs, g)
            sa_base = sa_ptr + (k0 + offs_k) * stride_sak
            sb_base = sb_ptr + (n0 + offs_n) * stride_sbn
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        # The mask runs to the group's 16-aligned end: the quantize kernels zero the padding columns,
        # and a mask constant over 16 tokens keeps the loads 16-byte wide, which cp.async pipelining
        # needs (a per-token mask along the contiguous dimension gave 1-byte loads and no pipeline).
        rows16 = tl.cdiv(rows, T_ALIGN) * T_ALIGN
        for r in range(0, rows, BLOCK_R):
            r_mask = offs_r < rows16 - r
            a = tl.load(a_base + (a_offs + r * stride_ar), mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            b = tl.load(b_base + (b_offs + r * stride_br), mask=n_mask[:, None] & r_mask[None, :], other=0.0)
            b = tl.trans(b)  # [BLOCK_R, BLOCK_N], token-major in shared memory
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if SCALING == 2:
                blk = (g_block + r // SCALE_BLOCK).to(tl.int64)
                sa = tl.load(sa_base + blk * stride_sag, mask=k_mask, other=0.0)
                sb = tl.load(sb_base + blk * stride_sbg, mask=n_mask, other=0.0)
                acc += tl.dot(a, b, max_num_imprecise_acc=IMPRECISE_ACC) * sa[:, None] * sb[None, :]
            else:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        if SCALING == 0:
            acc *= tl.load(sa_ptr + g * stride_sag) * tl.load(sb_ptr + g * stride_sbg)
        elif SCALING == 1:
            sa = tl.load(
                sa_ptr + g.to(tl.int64) * stride_sag + (k0 + offs_k) * stride_sak, mask=k_mask, other=0.0
            )
            sb = tl.load(
                sb_ptr + g.to(tl.int64) * stride_sbg + (n0 + offs_n) * stride_sbn, mask=n_mask, other=0.0
            )
            acc *= sa[:, None] * sb[None, :]
        out_offs = (
            g_out.to(tl.int64) * stride_og
            + k0 * stride_ok
            + n0 * stride_on
            + (offs_k[:, None] * stride_ok + offs_n[None, :] * stride_on)
        )
        out_mask = k_mask[:, None] & n_mask[None, :]
        if ACCUMULATE:
            if rows > 0:  # an empty group's out[g] is neither read nor written (k_grouped.py says why)
                acc += tl.load(c_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
                tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclasses.dataclass(frozen=True)
class KGroupedFp8Launch:
    """Grid and meta-parameters of one k_grouped_mm_fp8_kernel launch, from static shapes only."""

    grid: tuple[int]
    meta: dict

    @staticmethod
    def make(
        M: int,
        N: int,
        K: int,
        G: int,
        *,
        recipe: str,
        config,
        num_programs_cap: int,
        interpret: bool,
        max_stride: int,
        accumulate: bool,
        fast_accum: bool,
        g_total: int | None = None,
    ) -> KGroupedFp8Launch:
        """g_total: expert parallelism: group_sizes has g_total entries, out the G local groups from a
        device-side group offset (None: no offset, g_total = G)."""
        if recipe == "blockwise" and 128 % config.block_r:
            raise ValueError(f"blockwise scaling needs BLOCK_R dividing 128, got {config.block_r}")
        tiles = G * triton.cdiv(K, config.block_k) * triton.cdiv(N, config.block_n)
        num_programs = max(1, min(tiles, num_programs_cap * config.ctas_per_sm))
        meta = dict(
            NUM_PROGRAMS=num_programs,
            BLOCK_K=config.block_k,
            BLOCK_N=config.block_n,
            BLOCK_R=config.block_r,
            GROUP_M=config.group_m,
            BLOCK_G=max(16, triton.next_power_of_2(G if g_total is None else g_total)),
            HAS_GROUP_OFFSET=g_total is not None,
            WIDE_OFFSETS=2 * max(config.block_k, config.block_n, config.block_r) * max_stride >= 2**31,
            ACCUMULATE=accumulate,
            SCALING=SCALINGS[recipe],
            SCALE_BLOCK=128,
            IMPRECISE_ACC=None if fast_accum or interpret or recipe == "blockwise" else config.block_r,
            UPCAST=interpret,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        return KGroupedFp8Launch(grid=(num_programs,), meta=meta)
