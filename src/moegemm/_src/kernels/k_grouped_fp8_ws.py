"""Warp-specialized scaled k-grouped FP8 GEMM in Gluon (Hopper, the FP8 wgrad):
``for g: out[g] (+)= (a * sa)[rows(g)]^T @ (b * sb)[rows(g)]``.

Operands, scales and output are ``k_grouped_fp8``'s: the quantize kernels' transposed copies a_t
[Ka, M_t] and b_t [Nb, M_t] (tokens contiguous, group g's in columns [t_g, t_g + rows_g), t_g a
multiple of 16, zeros up to the next multiple of 16), out [G, Ka, Nb]; an empty group writes exact
zeros, or, accumulating, leaves out[g] untouched. This kernel runs the promoted mode only: every
128-token step's partial product leaves the tensor cores and is added (blockwise: scaled by
``sa[blk, ka] * sb[blk, nb]``) into an fp32 accumulator.

Why warp specialization: as in ``m_grouped_fp8_ws``, a promotion waits for its wgmma, and in one
instruction stream the tensor cores idle through it. The blockwise wgrad promotion costs more than the
forward's, since its scale varies along both tile dimensions (an outer product of two scale vectors per
step): the Triton kernel ran 339-342 TF/s on dsv3-ep8-fc1 (docs/design.md, 'Warp-specialized FP8 kernels').

The ring, its protocol, the partitions and the consumers' K loop are ``gluon_hopper``'s (``warp_specialize_ring``,
``promoted_mainloop``); this module adds:
- ``_loader``: cp.async of each step's a [BLOCK_K, BLOCK_R] and b [BLOCK_N, BLOCK_R] tiles and, blockwise,
  the step's scale vectors sa [BLOCK_K] and sb [BLOCK_N] into the ring;
- ``_step``: one 128-token step of a consumer (BLOCK_K / 2 rows of every output tile): wgmma, promotion;
- ``_epilogue``: tensor/row scales and the masked (accumulating: read-add-write) store.
Every partition walks the same persistent tile sequence (``tile -> (g, k_tile, n_tile)``, a group's tiles
consecutive, ``schedule.swizzle_tile`` inside it), so ring slots and phases agree without messages.

Supported: no group offset (expert parallelism runs the Triton kernel), 16-byte aligned rows of the
transposed copies (``supported_problem``).
"""

from __future__ import annotations

import dataclasses

import triton

from moegemm._src.kernels.gluon_hopper import (
    LOADER_WARPS,
    MAXNREG,
    acquire_slot,
    async_load,
    commit_slot,
    copy_layout,
    gl,
    gluon,
    operand_ring,
    promoted_mainloop,
    ring_barriers,
    scale_ring,
    sched_layout,
    supported,
    warp_specialize_ring,
    warpgroup_mma,
    warpgroup_mma_wait,
    wgmma_layout,
)
from moegemm._src.kernels.m_grouped_fp8 import SCALINGS
from moegemm._src.kernels.quantize_fp8 import T_ALIGN
from moegemm._src.kernels.schedule import aligned_group_offsets, clamped_group_bounds, pick, swizzle_tile

__all__ = ["KGroupedFp8WsLaunch", "supported", "supported_problem"]


def supported_problem(has_group_offset: bool, row_stride: int, out_span: int) -> bool:
    """Problems this kernel takes: no EP offset, row offsets inside a 256-row operand tile
    (``row_stride``: the larger of a_t's and b_t's row strides, each a multiple of 16) and offsets
    inside one out[g] (``out_span``: its last element's offset + 1) that fit int32."""
    return (
        supported()
        and not has_group_offset
        and row_stride % 16 == 0
        and 256 * row_stride < 2**31
        and out_span < 2**31
    )


@gluon.jit
def _group_space(group_sizes_ptr, G, M, BLOCK_G: gl.constexpr, SCALE_BLOCK: gl.constexpr):
    """Per group (slots < G): token count, first token column in the transposed copies (in units of
    T_ALIGN) and first 128-token scale block, as ``k_grouped_fp8`` derives them; int32 (all <= M_t)."""
    offs = gl.arange(0, BLOCK_G, layout=sched_layout(gl.num_warps()))
    starts, ends = clamped_group_bounds(group_sizes_ptr, offs, G, M)
    t_units = aligned_group_offsets(offs, starts, ends, G, T_ALIGN).to(gl.int32)
    rows = gl.where(offs < G, ends - starts, 0).to(gl.int32)
    block_base = aligned_group_offsets(offs, starts, ends, G, SCALE_BLOCK).to(gl.int32)
    return offs, rows, t_units, block_base


@gluon.jit
def _loader(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    group_sizes_ptr,
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    M,
    N,
    K,
    G,
    stride_ak,
    stride_bn,
    stride_sag,
    stride_sak,
    stride_sbg,
    stride_sbn,
    SCALING: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_K: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_R: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
):
    """Fills ring slot step % NUM_STAGES with each step's a and b tiles once both consumers released
    it, and (blockwise) the step's scale vectors. Masked chunks are zero-filled (cp.async source size
    0). Along tokens the mask runs to the group's 16-aligned end, constant over each 16-byte chunk:
    the quantize kernels zero the padding columns."""
    layout: gl.constexpr = copy_layout(BLOCK_R, gl.num_warps())
    cp_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    cp_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cp_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, layout))
    vec: gl.constexpr = sched_layout(gl.num_warps())
    sc_k = gl.arange(0, BLOCK_K, layout=vec)
    sc_n = gl.arange(0, BLOCK_N, layout=vec)
    offs, rows_g, t_units, block_base = _group_space(group_sizes_ptr, G, M, BLOCK_G, SCALE_BLOCK)
    k_tiles = gl.cdiv(K, BLOCK_K)
    n_tiles = gl.cdiv(N, BLOCK_N)
    tiles_per_group = k_tiles * n_tiles
    a_offs = cp_k[:, None] * stride_ak + cp_r[None, :]  # int32 inside a tile (supported_problem)
    b_offs = cp_n[:, None] * stride_bn + cp_r[None, :]
    step = 0
    for tile in range(gl.program_id(0), G * tiles_per_group, NUM_PROGRAMS):
        g = tile // tiles_per_group
        k_tile, n_tile = swizzle_tile(tile % tiles_per_group, k_tiles, n_tiles, GROUP_M)
        rows = pick(rows_g, offs, g)
        rows16 = gl.cdiv(rows, T_ALIGN) * T_ALIGN
        col0 = (pick(t_units, offs, g) * T_ALIGN).to(gl.int64)
        k0 = k_tile * BLOCK_K
        n0 = n_tile * BLOCK_N
        a_base = a_ptr + k0.to(gl.int64) * stride_ak + col0
        b_base = b_ptr + n0.to(gl.int64) * stride_bn + col0
        a_rows = (cp_k < K - k0)[:, None]
        b_rows = (cp_n < N - n0)[:, None]
        if SCALING == 2:
            g_block = pick(block_base, offs, g)
            sa_base = sa_ptr + k0 * stride_sak + sc_k * stride_sak
            sb_base = sb_ptr + n0 * stride_sbn + sc_n * stride_sbn
        for s in range(gl.cdiv(rows, BLOCK_R)):
            slot = acquire_slot(empty, step)
            r = s * BLOCK_R
            r_in = (cp_r < rows16 - r)[None, :]
            async_load(a_bufs.index(slot), a_base + r + a_offs, mask=a_rows & r_in)
            async_load(b_bufs.index(slot), b_base + r + b_offs, mask=b_rows & r_in)
            if SCALING == 2:
                blk = (g_block + r // SCALE_BLOCK).to(gl.int64)
                async_load(sa_bufs.index(slot), sa_base + blk * stride_sag, mask=sc_k < K - k0)
                async_load(sb_bufs.index(slot), sb_base + blk * stride_sbg, mask=sc_n < N - n0)
            commit_slot(ready, slot)
            step += 1


@gluon.jit
def _consumer(
    sa_ptr,
    sb_ptr,
    group_sizes_ptr,
    c_ptr,
    out_ptr,
    a_bufs,
    b_bufs,
    sa_bufs,
    sb_bufs,
    ready,
    empty,
    M,
    N,
    K,
    G,
    stride_og,
    stride_ok,
    stride_on,
    stride_sag,
    stride_sak,
    stride_sbg,
    stride_sbn,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_K: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_R: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    SCALING: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,
    PROXY_FENCE: gl.constexpr,
    HALF: gl.constexpr,
):
    """Rows [HALF * BLOCK_K / 2, (HALF + 1) * BLOCK_K / 2) of every output tile: ``promoted_mainloop`` with
    ``_step``, then ``_epilogue`` for each 128-column part."""
    SUB_K: gl.constexpr = BLOCK_K // 2
    SUB_N: gl.constexpr = BLOCK_N if BLOCK_N <= 128 else 128
    mma_layout: gl.constexpr = wgmma_layout(SUB_N, 32)
    offs_k = gl.arange(0, SUB_K, layout=gl.SliceLayout(1, mma_layout))
    offs_n = gl.arange(0, SUB_N, layout=gl.SliceLayout(0, mma_layout))
    offs, rows_g, t_units, block_base = _group_space(group_sizes_ptr, G, M, BLOCK_G, SCALE_BLOCK)
    k_tiles = gl.cdiv(K, BLOCK_K)
    n_tiles = gl.cdiv(N, BLOCK_N)
    tiles_per_group = k_tiles * n_tiles
    partial = gl.zeros([SUB_K, SUB_N], gl.float32, mma_layout)
    step = 0
    for tile in range(gl.program_id(0), G * tiles_per_group, NUM_PROGRAMS):
        g = tile // tiles_per_group
        k_tile, n_tile = swizzle_tile(tile % tiles_per_group, k_tiles, n_tiles, GROUP_M)
        rows = pick(rows_g, offs, g)
        k0 = k_tile * BLOCK_K + HALF * SUB_K
        n0 = n_tile * BLOCK_N
        acc0, acc1, partial, step = promoted_mainloop(
            _step, (sa_bufs, sb_bufs, HALF, SCALING), gl.cdiv(rows, BLOCK_R), step, partial, a_bufs, b_bufs, ready,
            empty, HALF, PROXY_FENCE,
        )  # fmt: skip
        _epilogue(
            acc0, c_ptr, out_ptr, sa_ptr, sb_ptr, g, rows, k0, n0, K, N, stride_og, stride_ok, stride_on,
            stride_sag, stride_sak, stride_sbg, stride_sbn, offs_k, offs_n, ACCUMULATE, SCALING,
        )  # fmt: skip
        if BLOCK_N > SUB_N:
            _epilogue(
                acc1, c_ptr, out_ptr, sa_ptr, sb_ptr, g, rows, k0, n0 + SUB_N, K, N, stride_og, stride_ok,
                stride_on, stride_sag, stride_sak, stride_sbg, stride_sbn, offs_k, offs_n, ACCUMULATE, SCALING,
            )  # fmt: skip


@gluon.jit
def _step(
    a, b_slot, slot, k, partial, acc, PART: gl.constexpr, sa_bufs, sb_bufs, HALF: gl.constexpr,
    SCALING: gl.constexpr,
):  # fmt: skip
    """One 128-token step of column part PART (SUB_N wide), ``promoted_mainloop``'s step: wgmma into
    ``partial``, then acc += partial (blockwise: times sa[:, None] * sb[None, :], the step's scale vectors from
    shared memory)."""
    SUB_K: gl.constexpr = a.shape[0]
    SUB_N: gl.constexpr = partial.shape[1]
    b = b_slot.slice(PART * SUB_N, SUB_N).permute((1, 0))
    token = warpgroup_mma(a, b, partial, use_acc=False, is_async=True)
    layout: gl.constexpr = partial.type.layout
    if SCALING == 2:  # read under the wgmma
        sa = sa_bufs.index(slot).slice(HALF * SUB_K, SUB_K).load(gl.SliceLayout(1, layout))
    partial = warpgroup_mma_wait(0, deps=[token])
    if SCALING == 2:
        sb = sb_bufs.index(slot).slice(PART * SUB_N, SUB_N).load(gl.SliceLayout(0, layout))
    if SCALING == 2:
        acc += (partial * sa[:, None]) * sb[None, :]
    else:
        acc += partial
    return acc, partial


@gluon.jit
def _epilogue(
    acc, c_ptr, out_ptr, sa_ptr, sb_ptr, g, rows, k0, n0, K, N, stride_og, stride_ok, stride_on, stride_sag,
    stride_sak, stride_sbg, stride_sbn, offs_k, offs_n, ACCUMULATE: gl.constexpr, SCALING: gl.constexpr,
):  # fmt: skip
    """Tensor/row scales and the masked store (accumulating: load, add, store) of out[g]'s rows
    [k0, k0 + SUB_K) and columns [n0, n0 + SUB_N)."""
    k_mask = offs_k < K - k0
    n_mask = offs_n < N - n0
    g64 = g.to(gl.int64)
    if SCALING == 0:
        acc *= gl.load(sa_ptr + g64 * stride_sag) * gl.load(sb_ptr + g64 * stride_sbg)
    elif SCALING == 1:
        sa = gl.load(sa_ptr + g64 * stride_sag + (k0 + offs_k) * stride_sak, mask=k_mask, other=0.0)
        sb = gl.load(sb_ptr + g64 * stride_sbg + (n0 + offs_n) * stride_sbn, mask=n_mask, other=0.0)
        acc *= sa[:, None] * sb[None, :]
    # int32 offsets inside out[g] (supported_problem bounds its span), from this tile's row and column
    # vectors: int64 ones, or a loop-invariant in-tile part (hoisted out of the tile loop), cost the
    # registers the accumulating epilogue needs (ptxas spilled 1.4 KB a thread).
    offsets = ((k0 + offs_k) * stride_ok)[:, None] + ((n0 + offs_n) * stride_on)[None, :]
    c_ptr += g64 * stride_og
    out_ptr += g64 * stride_og
    mask = k_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        if rows > 0:  # an empty group's out[g] is neither read nor written (k_grouped.py says why)
            acc += gl.load(c_ptr + offsets, mask=mask, other=0.0).to(gl.float32)
            gl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        gl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def k_grouped_mm_fp8_ws_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    group_sizes_ptr,
    c_ptr,
    out_ptr,
    M,
    N,
    K,
    G,
    stride_ak,
    stride_bn,
    stride_og,
    stride_ok,
    stride_on,
    stride_sag,  # TENSOR, ROW: per group; BLOCK: per token block
    stride_sak,
    stride_sbg,
    stride_sbn,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_K: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_R: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    SCALING: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,  # 128
    NUM_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,  # setmaxnreg of each consumer warpgroup; the loader gets the rest
    PROXY_FENCE: gl.constexpr,
):
    gl.static_assert(BLOCK_K == 128, "two consumer warpgroups of 64 rows")
    gl.static_assert(BLOCK_R == SCALE_BLOCK, "one 128-token scale block per step")
    a_bufs = operand_ring(a_ptr.dtype.element_ty, NUM_STAGES, BLOCK_K, BLOCK_R)
    b_bufs = operand_ring(b_ptr.dtype.element_ty, NUM_STAGES, BLOCK_N, BLOCK_R)
    sa_bufs = scale_ring(NUM_STAGES, BLOCK_K)
    sb_bufs = scale_ring(NUM_STAGES, BLOCK_N)
    ready, empty = ring_barriers(NUM_STAGES)
    warp_specialize_ring(
        _loader,
        (
            a_ptr, b_ptr, sa_ptr, sb_ptr, group_sizes_ptr, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, M, N, K, G,
            stride_ak, stride_bn, stride_sag, stride_sak, stride_sbg, stride_sbn, SCALING, SCALE_BLOCK, NUM_PROGRAMS,
            BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G,
        ),
        _consumer,
        (
            sa_ptr, sb_ptr, group_sizes_ptr, c_ptr, out_ptr, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, M, N, K,
            G, stride_og, stride_ok, stride_on, stride_sag, stride_sak, stride_sbg, stride_sbn, NUM_PROGRAMS, BLOCK_K,
            BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G, ACCUMULATE, SCALING, SCALE_BLOCK, PROXY_FENCE,
        ),
        CONSUMER_REGS,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class KGroupedFp8WsLaunch:
    """Grid and meta-parameters of one k_grouped_mm_fp8_ws_kernel launch, from static shapes only."""

    grid: tuple[int]
    meta: dict

    @staticmethod
    def make(M: int, N: int, K: int, G: int, *, recipe: str, config, num_programs_cap: int, accumulate: bool):
        """N, K: out[g]'s columns and rows (b_t's and a_t's rows); config: ``configs.Fp8WsConfig``;
        num_programs_cap: the SM count (one CTA per SM: the ring takes most of shared memory)."""
        tiles = G * triton.cdiv(K, 128) * triton.cdiv(N, config.block_n)
        num_programs = max(1, min(tiles, num_programs_cap))
        meta = dict(
            NUM_PROGRAMS=num_programs,
            BLOCK_K=128,
            BLOCK_N=config.block_n,
            BLOCK_R=128,
            GROUP_M=config.group_m,
            BLOCK_G=max(16, triton.next_power_of_2(G)),
            ACCUMULATE=accumulate,
            SCALING=SCALINGS[recipe],
            SCALE_BLOCK=128,
            NUM_STAGES=config.num_stages,
            CONSUMER_REGS=config.consumer_regs,
            PROXY_FENCE=True,  # the memory model asks for it (m_grouped_fp8_ws measured its cost: 2%)
            num_warps=LOADER_WARPS,
            maxnreg=MAXNREG,
        )
        return KGroupedFp8WsLaunch(grid=(num_programs,), meta=meta)
