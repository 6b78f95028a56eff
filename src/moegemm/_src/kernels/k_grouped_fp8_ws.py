"""Warp-specialized scaled k-grouped FP8 GEMM in Gluon (Hopper, the FP8 wgrad):
``for g: out[g] (+)= (a * sa)[rows(g)]^T @ (b * sb)[rows(g)]``.

Operands, scales and output are ``k_grouped_fp8``'s: the quantize kernels' transposed copies a_t
[Ka, M_t] and b_t [Nb, M_t] (tokens contiguous, group g's in columns [t_g, t_g + rows_g), t_g a
multiple of 16, zeros up to the next multiple of 16), out [G, Ka, Nb] contiguous (fp32, or the
weight's 2-byte dtype); an empty group writes exact zeros, or, accumulating, leaves out[g] untouched.
This kernel runs the promoted mode only: every 128-token step's partial product leaves the tensor
cores and is added (blockwise: scaled by ``sa[blk, ka] * sb[blk, nb]``) into an fp32 accumulator.

Why warp specialization: as in ``m_grouped_fp8_ws``, a promotion waits for its wgmma, and in one
instruction stream the tensor cores idle through it; two consumer warpgroups each own half of a tile's
rows, so one's promotion runs under the other's wgmma (docs/design.md, 'Warp-specialized FP8 kernels').

Why TMA at both ends (docs/design.md, 'The FP8 wgrad'): on dsv3-ep8-fc1 a 128-row tile reduces ~1024
tokens in 8 steps and then writes 64 KB of fp32 dW (3.76 GB a launch, 1.25 ms of HBM). A cp.async loader
issues 2 x 1024 16-byte copies a step from four warps; stores from registers keep the consumers off
their wgmma until the tile is written. Here:
- ``_loader``: makes a descriptor pair per group on the device, over the group's own token columns of a_t
  and b_t (the copy engine zero-fills box columns outside them, so no step adds a neighbour group's tokens),
  in one of two pairs taken in turns, once the copies through that pair (two groups back) landed
  (``drain_copies``), and issues two bulk copies a step into the ring; with ``ALIGN_STEPS`` the first box
  starts before the group, at a 128-byte aligned column (``_lead``). Descriptors need Triton's global scratch
  (the front end's allocator).
- ``_consumer``: per step and 128-column part (a 256-wide tile has two), wgmma -> wait -> promote
  (blockwise: this step's scale vectors, read from global memory under the wgmma), the slot released after
  the last part's wgmma; then each part's epilogue: the accumulator goes through this consumer's staging
  tile and leaves by a TMA store over out viewed [G * Ka, Nb], which runs under the next tile's steps.
  Accumulating with one part a tile (128 wide), the consumer first reads out's tile into its staging tile
  by TMA at the tile's start, adds it in registers in the epilogue and stores the sum; with two parts it
  reduce-adds each through the staging tile (``cp.reduce.async.bulk.tensor``).
  A half tile that would cross into out[g + 1] (Ka not a multiple of 64, the last k tile) is stored
  from registers, masked.
Every partition walks the same persistent tile sequence (``tile -> (g, k_tile, n_tile)``, a group's
tiles consecutive, ``schedule.swizzle_tile`` inside it), so ring slots and phases agree without messages.

Supported (``supported_problem``): no group offset (expert parallelism runs the Triton kernel), 16-byte
aligned rows of the transposed copies, token columns and offsets inside out[g] that fit int32; the front
end adds a contiguous out with 16-byte rows.
"""

from __future__ import annotations

import dataclasses

import triton

from moegemm._src.kernels.gluon_hopper import (
    LOADER_WARPS,
    MAXNREG,
    TensorDescriptor,
    acquire_slot_tx,
    drain_copies,
    gl,
    gluon,
    mbarrier,
    operand_ring,
    release_slot,
    ring_barriers,
    sched_layout,
    stage_out,
    supported,
    thread_barrier,
    tma,
    tma_load,
    wait_slot,
    warp_specialize_ring,
    warpgroup_mma,
    warpgroup_mma_wait,
    wgmma_layout,
)
from moegemm._src.kernels.m_grouped_fp8 import SCALINGS
from moegemm._src.kernels.quantize_fp8 import T_ALIGN
from moegemm._src.kernels.schedule import (
    aligned_group_offsets,
    clamped_group_bounds,
    pick,
    sm90_shared_fits,
    swizzle_tile,
)

__all__ = ["BLOCK_K", "SUB_N", "KGroupedFp8WsLaunch", "TensorDescriptor", "supported", "supported_problem"]

BLOCK_K = 128  # out rows per tile: two consumer warpgroups of 64
BLOCK_R = 128  # tokens a step: one 128-token scale block (blockwise), 128 bytes of a TMA row
# Mean tokens a group from which the steps start 128-byte aligned (``_lead``). H100, 2026-11-27 (journal 43),
# bf16 dW, tensorwise, against the unaligned steps: +9-14% at 1024 (dsv3-ep8-fc1), +27-33% on the FP8 block's
# skewed groups (2048 on average), -6% at 683 (kimi-k2-ep8-fc1: the extra step a group outweighed the aligned
# loads), -5% rowwise at 128 (qwen3-30b-fc1).
ALIGN_MIN_ROWS = 1024
SUB_N = (
    128  # out columns a wgmma, a staging tile and a TMA store take (out_desc's block); BLOCK_N 256: two parts
)


def supported_problem(has_group_offset: bool, row_stride: int, out_span: int) -> bool:
    """Problems this kernel takes: no EP offset, 16-byte rows of the transposed copies whose token columns fit
    int32 TMA coordinates (``row_stride``: the larger of a_t's and b_t's row strides, each a multiple of 16 and
    at least the token columns), and offsets inside one out[g] (``out_span``: its last element's offset + 1)
    that fit int32."""
    return (
        supported()
        and not has_group_offset
        and row_stride % 16 == 0
        and row_stride < 2**31
        and out_span < 2**31
    )


@gluon.jit
def _group_space(group_sizes_ptr, G, M, BLOCK_G: gl.constexpr, BLOCK_R: gl.constexpr):
    """Per group (slots < G): token count, first token column in the transposed copies (in units of
    T_ALIGN) and first 128-token scale block, as ``k_grouped_fp8`` derives them; int32 (all <= M_t)."""
    offs = gl.arange(0, BLOCK_G, layout=sched_layout(gl.num_warps()))
    starts, ends = clamped_group_bounds(group_sizes_ptr, offs, G, M)
    t_units = aligned_group_offsets(offs, starts, ends, G, T_ALIGN).to(gl.int32)
    rows = gl.where(offs < G, ends - starts, 0).to(gl.int32)
    block_base = aligned_group_offsets(offs, starts, ends, G, BLOCK_R).to(gl.int32)
    return offs, rows, t_units, block_base


@gluon.jit
def _locate(tile, K, N, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile index -> (g, first out row k0, first out column n0)."""
    k_tiles = gl.cdiv(K, BLOCK_K)
    n_tiles = gl.cdiv(N, BLOCK_N)
    g = tile // (k_tiles * n_tiles)
    k_tile, n_tile = swizzle_tile(tile % (k_tiles * n_tiles), k_tiles, n_tiles, GROUP_M)
    return g, k_tile * BLOCK_K, n_tile * BLOCK_N


@gluon.jit
def _lead(col0, SCALING: gl.constexpr, BLOCK_R: gl.constexpr, ALIGN_STEPS: gl.constexpr):
    """Zero tokens before a group's first step. ALIGN_STEPS (tensorwise, rowwise): col0 % BLOCK_R, so every
    step's box starts at a 128-byte aligned column; a box straddling two 128-byte lines ran the launch at
    0.66-0.70x of the aligned one, and a group may take one step more (docs/design.md, 'The FP8 wgrad').
    Otherwise 0; always 0 for blockwise, whose steps are the group's 128-token scale blocks."""
    lead = col0 % BLOCK_R
    if SCALING == 2 or not ALIGN_STEPS:
        lead = lead * 0
    return lead


@gluon.jit
def _steps(rows, lead, BLOCK_R: gl.constexpr):
    """A group's BLOCK_R-token steps after ``lead`` zero tokens; none for an empty group."""
    return gl.where(rows > 0, gl.cdiv(rows + lead, BLOCK_R), 0)


@gluon.jit
def _group_descs(a_ptr, b_ptr, col0, rows, K, N, stride_ak, stride_bn, a_bufs, b_bufs):
    """a_t's and b_t's descriptors over one group's own token columns [col0, col0 + rows) (a nonzero extent; an
    empty group loads nothing): a box column before 0 or from rows on lands as zeros. Each call site is one
    descriptor slot of Triton's global scratch a program."""
    BLOCK_K: gl.constexpr = a_bufs.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    BLOCK_R: gl.constexpr = a_bufs.shape[2]
    extent = gl.maximum(rows, 1)
    a_desc = tma.make_tensor_descriptor(
        a_ptr + col0, [K, extent], [stride_ak, 1], [BLOCK_K, BLOCK_R], a_bufs.layout
    )
    b_desc = tma.make_tensor_descriptor(
        b_ptr + col0, [N, extent], [stride_bn, 1], [BLOCK_N, BLOCK_R], b_bufs.layout
    )
    return a_desc, b_desc


@gluon.jit
def _loader(
    a_ptr, b_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, stride_ak, stride_bn,
    NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr,
    GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr, SCALING: gl.constexpr, ALIGN_STEPS: gl.constexpr,
):  # fmt: skip
    """Fills ring slot step % NUM_STAGES with each step's a [BLOCK_K, BLOCK_R] and b [BLOCK_N, BLOCK_R] tiles
    once both consumers released it. A box past the descriptor's extent (rows past Ka or Nb, tokens past the
    group's end) lands as zeros."""
    STEP_BYTES: gl.constexpr = BLOCK_R * (BLOCK_K + BLOCK_N) * a_bufs.dtype.primitive_bitwidth // 8
    offs, rows_g, t_units, block_base = _group_space(group_sizes_ptr, G, M, BLOCK_G, BLOCK_R)
    total_tiles = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
    # Two descriptor pairs, taken in turns group by group: a rewrite waits for the copies through its pair two
    # groups back, not for the ones just issued, so the loader stays ahead where groups take one or two steps a
    # tile (docs/design.md, 'The FP8 wgrad'). Both pairs stay live across the loop, so Triton's global scratch
    # allocator gives them separate slots (pairs made in exclusive branches only would share one). Pair 0's
    # copies were steps [first0, first1), pair 1's [first1, first0).
    a_desc0, b_desc0 = _group_descs(a_ptr, b_ptr, 0, T_ALIGN, K, N, stride_ak, stride_bn, a_bufs, b_bufs)
    a_desc1, b_desc1 = _group_descs(a_ptr, b_ptr, 0, T_ALIGN, K, N, stride_ak, stride_bn, a_bufs, b_bufs)
    desc_g = -1
    pair = 1  # the pair the current group's copies go through
    first0 = 0
    first1 = 0
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, k0, n0 = _locate(tile, K, N, BLOCK_K, BLOCK_N, GROUP_M)
        rows = pick(rows_g, offs, g)
        col0 = pick(t_units, offs, g) * T_ALIGN
        lead = _lead(col0, SCALING, BLOCK_R, ALIGN_STEPS)
        if g != desc_g:  # a group's tiles are consecutive: one descriptor pair per group
            desc_g = g
            # (Each branch names its own pair: a descriptor cannot be picked by a runtime value.)
            if pair == 1:
                first0, a_desc0, b_desc0 = _rewrite_pair(
                    ready, first0, first1, step, a_ptr, b_ptr, col0, rows, K, N, stride_ak, stride_bn, a_bufs, b_bufs,
                )  # fmt: skip
            else:
                first1, a_desc1, b_desc1 = _rewrite_pair(
                    ready, first1, first0, step, a_ptr, b_ptr, col0, rows, K, N, stride_ak, stride_bn, a_bufs, b_bufs,
                )  # fmt: skip
            pair = 1 - pair
        for s in range(_steps(rows, lead, BLOCK_R)):
            slot, bar = acquire_slot_tx(ready, empty, step, STEP_BYTES)
            col = s * BLOCK_R - lead
            if pair == 0:
                _load_step(a_desc0, b_desc0, k0, n0, col, bar, a_bufs.index(slot), b_bufs.index(slot))
            else:
                _load_step(a_desc1, b_desc1, k0, n0, col, bar, a_bufs.index(slot), b_bufs.index(slot))
            step += 1


@gluon.jit
def _rewrite_pair(
    ready, first, other_first, step, a_ptr, b_ptr, col0, rows, K, N, stride_ak, stride_bn, a_bufs, b_bufs
):  # fmt: skip
    """Loader, at a change of group: once the copies through this pair (steps [first, other_first)) landed,
    the pair over the new group's columns. Returns (the pair's first step, a_desc, b_desc)."""
    drain_copies(ready, first, other_first, step)
    a_desc, b_desc = _group_descs(a_ptr, b_ptr, col0, rows, K, N, stride_ak, stride_bn, a_bufs, b_bufs)
    return step, a_desc, b_desc


@gluon.jit
def _load_step(a_desc, b_desc, k0, n0, col, bar, a_slot, b_slot):
    """One step's two bulk copies: a_t rows [k0, k0 + BLOCK_K) and b_t rows [n0, n0 + BLOCK_N), token columns
    [col, col + BLOCK_R) of the descriptors' group."""
    tma_load(a_desc, [k0, col], bar, a_slot)
    tma_load(b_desc, [n0, col], bar, b_slot)


@gluon.jit
def _consumer(
    out_desc, out_ptr, sa_ptr, sb_ptr, group_sizes_ptr, a_bufs, b_bufs, c_bufs, c_ready, ready, empty, M, N, K,
    G, stride_sag, stride_sak, stride_sbg, stride_sbn, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr,
    ACCUMULATE: gl.constexpr, SCALING: gl.constexpr, ALIGN_STEPS: gl.constexpr, HALF: gl.constexpr,
):  # fmt: skip
    """Rows [HALF * 64, HALF * 64 + 64) of every output tile: per step and 128-column part, wgmma -> wait ->
    promote (``_part``), the slot released after the last part's wgmma; then each part's ``_epilogue``. A
    256-wide tile runs as two parts with their own accumulators: two 64 x 128 fp32 accumulators and one partial
    fit a warpgroup's registers, a 64 x 256 accumulator and its partial do not."""
    SUB_K: gl.constexpr = BLOCK_K // 2
    SUB_N: gl.constexpr = c_bufs.shape[2]
    layout: gl.constexpr = wgmma_layout(SUB_N, 32)
    offs_k = gl.arange(0, SUB_K, layout=gl.SliceLayout(1, layout))
    offs_n = gl.arange(0, SUB_N, layout=gl.SliceLayout(0, layout))
    offs, rows_g, t_units, block_base = _group_space(group_sizes_ptr, G, M, BLOCK_G, BLOCK_R)
    total_tiles = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
    c_smem = c_bufs.index(HALF)
    c_bar = c_ready.index(HALF)
    # Accumulating with one part a tile: out's tile is read into the staging tile by TMA while the tile's steps
    # run, added in registers and stored back (docs/design.md, 'The FP8 wgrad').
    PREFETCH: gl.constexpr = ACCUMULATE and BLOCK_N == SUB_N
    fills = 0
    partial = gl.zeros([SUB_K, SUB_N], gl.float32, layout)
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, k0, n0 = _locate(tile, K, N, BLOCK_K, BLOCK_N, GROUP_M)
        k0 += HALF * SUB_K
        rows = pick(rows_g, offs, g)
        g_block = pick(block_base, offs, g)
        lead = _lead(pick(t_units, offs, g) * T_ALIGN, SCALING, BLOCK_R, ALIGN_STEPS)
        # An empty group's out[g] is neither read nor written when accumulating (k_grouped.py says why); a half
        # tile crossing Ka goes through registers (``_store``).
        fill = (rows > 0) & (k0 + SUB_K <= K)
        if PREFETCH and fill:
            tma.store_wait(0)  # the previous tile's store has read the staging tile
            thread_barrier()
            mbarrier.expect(c_bar, SUB_K * SUB_N * 4)
            tma_load(out_desc, [g * K + k0, n0], c_bar, c_smem)
            fills += 1
        acc0 = gl.zeros([SUB_K, SUB_N], gl.float32, layout)
        acc1 = gl.zeros([SUB_K, SUB_N], gl.float32, layout)
        for s in range(_steps(rows, lead, BLOCK_R)):
            slot = wait_slot(ready, step)
            a = a_bufs.index(slot).slice(HALF * SUB_K, SUB_K)
            blk = (g_block + s).to(gl.int64)  # blockwise: this step's 128-token scale block
            acc0, partial = _part(
                a, b_bufs.index(slot), partial, acc0, 0, sa_ptr, sb_ptr, blk, k0, n0, K, N, stride_sag, stride_sak,
                stride_sbg, stride_sbn, offs_k, offs_n, SCALING,
            )  # fmt: skip
            if BLOCK_N > SUB_N:
                acc1, partial = _part(
                    a, b_bufs.index(slot), partial, acc1, 1, sa_ptr, sb_ptr, blk, k0, n0, K, N, stride_sag,
                    stride_sak, stride_sbg, stride_sbn, offs_k, offs_n, SCALING,
                )  # fmt: skip
            release_slot(empty, slot)
            step += 1
        _epilogue(
            acc0, out_desc, out_ptr, c_smem, c_bar, fills, fill, sa_ptr, sb_ptr, g, rows, k0, n0, K, N, stride_sag,
            stride_sak, stride_sbg, stride_sbn, offs_k, offs_n, ACCUMULATE, PREFETCH, SCALING,
        )  # fmt: skip
        if BLOCK_N > SUB_N:
            _epilogue(
                acc1, out_desc, out_ptr, c_smem, c_bar, fills, fill, sa_ptr, sb_ptr, g, rows, k0, n0 + SUB_N, K, N,
                stride_sag, stride_sak, stride_sbg, stride_sbn, offs_k, offs_n, ACCUMULATE, False, SCALING,
            )  # fmt: skip
    tma.store_wait(0)


@gluon.jit
def _part(
    a, b_slot, partial, acc, PART: gl.constexpr, sa_ptr, sb_ptr, blk, k0, n0, K, N, stride_sag, stride_sak,
    stride_sbg, stride_sbn, offs_k, offs_n, SCALING: gl.constexpr,
):  # fmt: skip
    """One step of column part PART: wgmma into ``partial``, then acc += partial (blockwise: times the step's
    scale vectors sa[blk, k0:k0 + 64] and sb[blk, part's columns], read from global memory under the wgmma;
    they are L2-resident, and with TMA filling the ring no proxy fence waits on them)."""
    SUB_N: gl.constexpr = partial.shape[1]
    b = b_slot.slice(PART * SUB_N, SUB_N).permute((1, 0))
    token = warpgroup_mma(a, b, partial, use_acc=False, is_async=True)
    if SCALING == 2:
        c0 = n0 + PART * SUB_N
        sa = gl.load(sa_ptr + blk * stride_sag + (k0 + offs_k) * stride_sak, mask=offs_k < K - k0, other=0.0)
        sb = gl.load(sb_ptr + blk * stride_sbg + (c0 + offs_n) * stride_sbn, mask=offs_n < N - c0, other=0.0)
    partial = warpgroup_mma_wait(0, deps=[token])
    if SCALING == 2:
        acc += (partial * sa[:, None]) * sb[None, :]
    else:
        acc += partial
    return acc, partial


@gluon.jit
def _epilogue(
    acc, out_desc, out_ptr, c_smem, c_bar, fills, fill, sa_ptr, sb_ptr, g, rows, k0, n0, K, N, stride_sag,
    stride_sak, stride_sbg, stride_sbn, offs_k, offs_n, ACCUMULATE: gl.constexpr, PREFETCH: gl.constexpr,
    SCALING: gl.constexpr,
):  # fmt: skip
    """out[g] rows [k0, k0 + 64), columns [n0, n0 + 128): tensor/row scales, then the TMA store (or
    reduce-add; PREFETCH with ``fill``: the add of out's tile, which the consumer's ``fills``-th fill brought
    into the staging tile, and a store) through this consumer's staging tile, or a masked store from registers
    for a half tile crossing Ka."""
    k_mask = offs_k < K - k0
    n_mask = offs_n < N - n0
    g64 = g.to(gl.int64)
    if SCALING == 0:
        acc *= gl.load(sa_ptr + g64 * stride_sag) * gl.load(sb_ptr + g64 * stride_sbg)
    elif SCALING == 1:
        sa = gl.load(sa_ptr + g64 * stride_sag + (k0 + offs_k) * stride_sak, mask=k_mask, other=0.0)
        sb = gl.load(sb_ptr + g64 * stride_sbg + (n0 + offs_n) * stride_sbn, mask=n_mask, other=0.0)
        acc *= sa[:, None] * sb[None, :]
    # An empty group's out[g] is neither read nor written when accumulating (k_grouped.py says why).
    if ACCUMULATE:
        if PREFETCH and fill:
            mbarrier.wait(c_bar, (fills - 1) & 1)
            acc += c_smem.load(acc.type.layout)
            thread_barrier()  # every thread read its part before any overwrites the tile
            stage_out(acc, out_desc, c_smem, g * K + k0, n0, False)
        elif rows > 0:
            _store(acc, out_desc, out_ptr, c_smem, g, k0, n0, K, N, offs_k, offs_n, k_mask, n_mask, True)
    else:
        _store(acc, out_desc, out_ptr, c_smem, g, k0, n0, K, N, offs_k, offs_n, k_mask, n_mask, False)


@gluon.jit
def _store(
    acc, out_desc, out_ptr, c_smem, g, k0, n0, K, N, offs_k, offs_n, k_mask, n_mask, ACCUMULATE: gl.constexpr
):  # fmt: skip
    """out[g][k0:k0 + 64, n0:n0 + BLOCK_N] (+)= acc."""
    SUB_K: gl.constexpr = acc.shape[0]
    if k0 + SUB_K <= K:
        # This consumer's previous store has read the staging tile (issued a whole tile of steps ago; a second
        # staging tile per consumer, in flight beside it, measured no faster: docs/design.md, 'The FP8 wgrad').
        tma.store_wait(0)
        thread_barrier()  # (the issuing thread waited; every thread writes the tile)
        stage_out(acc, out_desc, c_smem, g * K + k0, n0, ACCUMULATE)
    elif k0 < K:
        # int32 offsets inside out[g] (supported_problem bounds its span); out is contiguous.
        offsets = ((k0 + offs_k) * N)[:, None] + (n0 + offs_n)[None, :]
        ptrs = out_ptr + g.to(gl.int64) * K * N + offsets
        mask = k_mask[:, None] & n_mask[None, :]
        if ACCUMULATE:
            acc += gl.load(ptrs, mask=mask, other=0.0).to(gl.float32)
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def k_grouped_mm_fp8_ws_kernel(
    out_desc,  # a host TensorDescriptor over out viewed [G * K, N], block [BLOCK_K // 2, SUB_N]; unread (any
    # pointer) with OUT_DESC_ON_DEVICE
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    group_sizes_ptr,
    out_ptr,  # out itself: the half tiles that cross Ka are stored from registers
    M,
    N,
    K,
    G,
    stride_ak,
    stride_bn,
    stride_sag,  # TENSOR, ROW: per group; BLOCK: per token block
    stride_sak,
    stride_sbg,
    stride_sbn,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_K: gl.constexpr,  # 128: two consumer warpgroups of 64 out rows
    BLOCK_N: gl.constexpr,
    BLOCK_R: gl.constexpr,  # 128: one scale block a step
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    SCALING: gl.constexpr,
    ALIGN_STEPS: gl.constexpr,
    OUT_DESC_ON_DEVICE: gl.constexpr,  # out's descriptor made here, in Triton's global scratch (the JAX launcher)
    NUM_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,  # setmaxnreg of each consumer warpgroup; the loader gets the rest
):
    # Each ring in its operand's own format: dy may be e5m2 beside an e4m3 x (TE's hybrid), and a ring typed by
    # the other operand fed wgmma the wrong format (NaN dW on the H100, 2026-11-28).
    a_bufs = operand_ring(a_ptr.dtype.element_ty, NUM_STAGES, BLOCK_K, BLOCK_R)
    b_bufs = operand_ring(b_ptr.dtype.element_ty, NUM_STAGES, BLOCK_N, BLOCK_R)
    if OUT_DESC_ON_DEVICE:
        STAGE_N: gl.constexpr = 128  # SUB_N (a module global, which a kernel cannot read)
        out_dtype: gl.constexpr = out_ptr.dtype.element_ty
        out_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K // 2, STAGE_N], out_dtype)
        c_bufs = gl.allocate_shared_memory(out_dtype, [2, BLOCK_K // 2, STAGE_N], out_layout)
        out_desc = tma.make_tensor_descriptor(
            out_ptr, [G * K, N], [N, 1], [BLOCK_K // 2, STAGE_N], out_layout
        )
    else:
        STAGING: gl.constexpr = out_desc.block_shape  # [BLOCK_K // 2, SUB_N]
        c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, STAGING[0], STAGING[1]], out_desc.layout)
    ready, empty = ring_barriers(NUM_STAGES)
    c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # a staging tile's fill
    for i in gl.static_range(2):
        mbarrier.init(c_ready.index(i), count=1)
    warp_specialize_ring(
        _loader,
        (
            a_ptr, b_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, stride_ak, stride_bn,
            NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G, SCALING, ALIGN_STEPS,
        ),
        _consumer,
        (
            out_desc, out_ptr, sa_ptr, sb_ptr, group_sizes_ptr, a_bufs, b_bufs, c_bufs, c_ready, ready, empty, M, N,
            K, G, stride_sag, stride_sak, stride_sbg, stride_sbn, NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M,
            BLOCK_G, ACCUMULATE, SCALING, ALIGN_STEPS,
        ),
        CONSUMER_REGS,
    )  # fmt: skip


def shared_bytes(block_n: int, num_stages: int, out_itemsize: int) -> int:
    """The ring (FP8 a and b tiles a slot) and the consumers' two staging tiles."""
    return num_stages * BLOCK_R * (BLOCK_K + block_n) + 2 * (BLOCK_K // 2) * SUB_N * out_itemsize


@dataclasses.dataclass(frozen=True)
class KGroupedFp8WsLaunch:
    """Grid and meta-parameters of one k_grouped_mm_fp8_ws_kernel launch, from static shapes only. out's
    descriptor: [G * K, N] with block [BLOCK_K // 2, SUB_N], an NVMMA-swizzled layout, built by the front end or
    (``out_desc_on_device``) by the kernel."""

    grid: tuple[int]
    meta: dict

    @staticmethod
    def make(
        M: int, N: int, K: int, G: int, *, recipe: str, config, num_programs_cap: int, accumulate: bool,
        out_itemsize: int = 4, out_desc_on_device: bool = False,
    ):  # fmt: skip
        """N, K: out[g]'s columns and rows (b_t's and a_t's rows); config: ``configs.Fp8WsConfig`` (its ring
        depth capped at what fits beside the staging tiles); num_programs_cap: the SM count (one CTA per SM).
        out_desc_on_device: the kernel makes out's descriptor in Triton's global scratch (a launcher without
        host descriptors, JAX's), else the front end passes it."""
        if config.block_n not in (128, 256):
            raise ValueError(
                f"k_grouped_fp8_ws: block_n must be 128 or 256 (one or two wgmma parts), got {config}"
            )
        stages = config.num_stages
        while stages > 2 and not sm90_shared_fits(shared_bytes(config.block_n, stages, out_itemsize), 1):
            stages -= 1
        tiles = G * triton.cdiv(K, BLOCK_K) * triton.cdiv(N, config.block_n)
        num_programs = max(1, min(tiles, num_programs_cap))
        meta = dict(
            NUM_PROGRAMS=num_programs,
            BLOCK_K=BLOCK_K,
            BLOCK_N=config.block_n,
            BLOCK_R=BLOCK_R,
            GROUP_M=config.group_m,
            BLOCK_G=max(16, triton.next_power_of_2(G)),
            ACCUMULATE=accumulate,
            SCALING=SCALINGS[recipe],
            ALIGN_STEPS=M >= ALIGN_MIN_ROWS * G,
            OUT_DESC_ON_DEVICE=out_desc_on_device,
            NUM_STAGES=stages,
            CONSUMER_REGS=config.consumer_regs,
            num_warps=LOADER_WARPS,
            maxnreg=MAXNREG,
        )
        return KGroupedFp8WsLaunch(grid=(num_programs,), meta=meta)
