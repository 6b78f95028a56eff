"""Scaled k-grouped GEMM (FP8 wgrad) in Gluon: ``for g: out[g] (+)= (a * sa)[rows(g)]^T @ (b * sb)[rows(g)]``.

Shapes and dtypes are those of ``k_grouped_fp8.k_grouped_mm_fp8_kernel`` (same arguments, same
order, plus NUM_STAGES and PROXY_FENCE at the end): a_t [Ka, M_t] and b_t [Nb, M_t] float8 (e4m3 or
e5m2), contiguous along tokens, group g's tokens in columns [t_g, t_g + rows_g) with t_g = 16 * sum_{h<g} cdiv(rows_h, 16) and
zeros up to the next multiple of 16 (``moegemm.fp8``); scales float32 by SCALING (0 tensorwise sa[g],
1 rowwise sa[g, ka], 2 blockwise sa[blk, ka] per 128-token block); group_sizes [G] int32 on the device;
out [G, Ka, Nb] float32 (or bf16/fp16 without ACCUMULATE). For dW of y = x @ w^T: a = dy, b = x.

Why Gluon: Triton 3.6 waits for each wgmma right after issuing it when the product is scaled before it
is accumulated (``acc += dot(a, b) * sa * sb``), so the tensor cores idle while every 128-token partial
is promoted into fp32 (341 TF/s blockwise on the H100 for dsv3). Here the schedule is written out. A
step (BLOCK_R tokens) is two async wgmmas, one per column half of the 128 x 128 tile, each into fresh
registers; one half's partial is promoted (scaled, added into the fp32 accumulator) while the other
half's wgmma runs:  issue L(s) | promote R(s-1) | issue R(s) | wait L(s) | promote L(s) | wait R(s).
Two half-size partials instead of a second full one keep the kernel within 255 registers, and nothing
is in flight across the loop edge, which ptxas needs to keep the wgmmas asynchronous (see the mainloop).

Loads are cp.async (no TMA descriptors: the kernel must launch from JAX through jax-triton 0.3.1, which
has neither host-built descriptors nor global scratch) into a NUM_STAGES ring, with the blockwise scale
vectors of a step in the same commit group; one producer runs NUM_STAGES - 2 steps ahead of the math
across tile boundaries, so a short group's tile does not pay the pipeline fill again. Tensorwise and
rowwise promote the same way (unscaled, as max_num_imprecise_acc = BLOCK_R does in the Triton kernel)
and scale in the epilogue; with IMPRECISE_ACC=None they chain the wgmmas instead (fast accumulation).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from moegemm.kernels.quantize_fp8 import T_ALIGN  # the data_t layout the quantize kernels write

# ---------------------------------------------------------------------------------------------------
# Layouts (compile-time). Gluon makes every register and shared-memory layout explicit.
# ---------------------------------------------------------------------------------------------------


@gluon.constexpr_function
def _group_layout(BLOCK_G, num_warps):
    # The whole [BLOCK_G] vector lives in every warp (warps replicate it), so a pick (masked sum) is a
    # warp shuffle reduction with no shared memory and no CTA barrier.
    return gl.BlockedLayout([max(1, BLOCK_G // 32)], [32], [num_warps], [0])


@gluon.constexpr_function
def _load_layout(BLOCK_R, num_warps):
    # 16 tokens (16 bytes of fp8) per thread along the contiguous dimension: one 16-byte cp.async each.
    lanes_r = min(32, BLOCK_R // 16)
    return gl.BlockedLayout([1, 16], [32 // lanes_r, lanes_r], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _mma_layout(BLOCK_K, BLOCK_N, num_warps):
    # wgmma atom: 4 warps x 16 rows; stack warps along M (rows of out) while rows remain, then along N.
    warps = [4, 1]
    while warps[0] * warps[1] < num_warps:
        if BLOCK_K > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    n = min(256, BLOCK_N // warps[1])
    while BLOCK_N % (n * warps[1]):
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 32])


@gluon.constexpr_function
def _operand_smem_layout(BLOCK_R):
    # [rows, BLOCK_R] fp8, tokens contiguous (K-major for the wgmma), 128-byte swizzle when a row is 128 B.
    swizzle = 128 if BLOCK_R % 128 == 0 else 64 if BLOCK_R % 64 == 0 else 32
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8, rank=2)


# ---------------------------------------------------------------------------------------------------
# Group bookkeeping. Gluon twins of schedule.py's helpers: a Gluon kernel compiles its callees with
# Gluon semantics, where tl.arange and tl.zeros need an explicit layout (schedule.group_row_bounds'
# tl.arange(0, BLOCK_G) raises a TypeError there), and tl.cumsum's combine function is a @triton.jit
# one. Same clamping rules as schedule.py (see its docstring).
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _group_bounds(group_sizes_ptr, G, M, BLOCK_G: gl.constexpr, LAYOUT: gl.constexpr):
    """schedule.group_row_bounds: (offs, starts, ends), int64 vectors of length BLOCK_G (slots >= G empty)."""
    offs = gl.arange(0, BLOCK_G, layout=LAYOUT)
    sizes = gl.load(group_sizes_ptr + offs, mask=offs < G, other=0).to(gl.int64)
    sizes = gl.minimum(gl.maximum(sizes, 0), M)
    ends_unclamped = gl.associative_scan(sizes, 0, _add)
    starts = gl.minimum(ends_unclamped - sizes, M)
    ends = gl.minimum(ends_unclamped, M)
    return offs, starts, ends


@gluon.jit
def _pick(values, offs, index):
    """schedule.pick: values[index] of a register vector (a masked sum; no dynamic register indexing)."""
    return gl.sum(gl.where(offs == index, values, 0), 0)


@gluon.jit
def _swizzle_tile(local, m_tiles, n_tiles, GROUP_M: gl.constexpr):
    """schedule.swizzle_tile: (m_tile, n_tile) of a group-local tile index, GROUP_M m-tiles per band."""
    band_width = GROUP_M * n_tiles
    first_m = (local // band_width) * GROUP_M
    band_m = gl.minimum(m_tiles - first_m, GROUP_M)
    in_band = local % band_width
    return first_m + in_band % band_m, in_band // band_m


@gluon.jit
def _tile_coords(tile, tiles_per_group, k_tiles, n_tiles, GROUP_M: gl.constexpr):
    g = tile // tiles_per_group
    k_tile, n_tile = _swizzle_tile(tile % tiles_per_group, k_tiles, n_tiles, GROUP_M)
    return g, k_tile, n_tile


# ---------------------------------------------------------------------------------------------------
# Producer: the position of the next step to load and what its copies need, carried across consumer
# iterations as one tuple, ``prod`` = (tile, r, rows16, a_base, b_base, k_left, n_left, sa_base, sb_base).
# A step's copies form one cp.async commit group: its a_t tile, its b_t tile and (blockwise) its two
# scale vectors, so the scales reach shared memory with the operands and the promotion never waits on
# a global load. ``ctx`` holds what does not change during the kernel.
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def _producer_seek(tile, ctx, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
                   GROUP_M: gl.constexpr):  # fmt: skip
    """Load state of the first tile at or after ``tile`` (in this program's stride) whose group has
    tokens; past this program's last tile rows16 = 0, which masks every copy off."""
    (total, tiles_per_group, k_tiles, n_tiles, offs_g, rows_v, col_v, blk_v, a_ptr, b_ptr, sa_ptr, sb_ptr, N, K,
     stride_ak, stride_bn, stride_sag, stride_sak, stride_sbg, stride_sbn) = ctx  # fmt: skip
    g, k_tile, n_tile = _tile_coords(tile, tiles_per_group, k_tiles, n_tiles, GROUP_M)
    rows = _pick(rows_v, offs_g, g)  # 0 for g >= G
    while (tile < total) & (rows == 0):
        tile += NUM_PROGRAMS
        g, k_tile, n_tile = _tile_coords(tile, tiles_per_group, k_tiles, n_tiles, GROUP_M)
        rows = _pick(rows_v, offs_g, g)
    rows16 = (gl.cdiv(rows, T_ALIGN) * T_ALIGN).to(gl.int32)
    col0 = _pick(col_v, offs_g, g) * T_ALIGN  # multiplied after the pick so the compiler sees 16 | col0
    blk0 = _pick(blk_v, offs_g, g)
    k0 = k_tile.to(gl.int64) * BLOCK_K
    n0 = n_tile.to(gl.int64) * BLOCK_N
    return (
        tile,
        0,
        rows16,
        a_ptr + k0 * stride_ak + col0,
        b_ptr + n0 * stride_bn + col0,
        (K - k0).to(gl.int32),
        (N - n0).to(gl.int32),
        sa_ptr + blk0 * stride_sag + k0 * stride_sak,
        sb_ptr + blk0 * stride_sbg + n0 * stride_sbn,
    )


@gluon.jit
def _produce(slot, prod, ctx, bufs, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
             BLOCK_R: gl.constexpr, GROUP_M: gl.constexpr, SCALING: gl.constexpr, SCALE_BLOCK: gl.constexpr,
             WIDE_OFFSETS: gl.constexpr, LOAD: gl.constexpr, SCALE_LOAD: gl.constexpr):  # fmt: skip
    """Issues the copies of step ``prod`` into ring slot ``slot`` as one commit group; returns the next step."""
    tile, r, rows16, a_base, b_base, k_left, n_left, sa_base, sb_base = prod
    stride_ak = ctx[14]
    stride_bn = ctx[15]
    a_bufs, b_bufs, sa_bufs, sb_bufs = bufs
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, LOAD))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    offs_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, LOAD))
    # The token mask runs to the group's 16-aligned end (the padding columns are zero), so it is constant
    # over each thread's 16 tokens and every copy stays one 16-byte cp.async.
    r_ok = (offs_r < rows16 - r)[None, :]
    # The step's token offset r enters each element's offset (not the base pointer), so no 64-bit
    # per-element offset is invariant across steps: the compiler hoists loop-invariant per-element offsets
    # out of the mainloop (sign-extended, two registers each) and keeps them live through it.
    cols = (offs_r + r)[None, :]
    if WIDE_OFFSETS:
        a_offs = offs_k.to(gl.int64)[:, None] * stride_ak + cols
        b_offs = offs_n.to(gl.int64)[:, None] * stride_bn + cols
    else:
        a_offs = offs_k[:, None] * stride_ak + cols
        b_offs = offs_n[:, None] * stride_bn + cols
    cp.async_copy_global_to_shared(
        a_bufs.index(slot), a_base + a_offs, mask=(offs_k < k_left)[:, None] & r_ok
    )
    cp.async_copy_global_to_shared(
        b_bufs.index(slot), b_base + b_offs, mask=(offs_n < n_left)[:, None] & r_ok
    )
    if SCALING == 2:
        # The step's 128-token scale block (BLOCK_R divides 128, so a step never straddles two).
        blk = (r // SCALE_BLOCK).to(gl.int64)
        s_k = gl.arange(0, BLOCK_K, layout=SCALE_LOAD)
        s_n = gl.arange(0, BLOCK_N, layout=SCALE_LOAD)
        live = rows16 > r
        sa_ptrs = sa_base + blk * ctx[16] + s_k * ctx[17]
        sb_ptrs = sb_base + blk * ctx[18] + s_n * ctx[19]
        cp.async_copy_global_to_shared(sa_bufs.index(slot), sa_ptrs, mask=(s_k < k_left) & live)
        cp.async_copy_global_to_shared(sb_bufs.index(slot), sb_ptrs, mask=(s_n < n_left) & live)
    cp.commit_group()
    r += BLOCK_R
    if r >= rows16:
        nxt = _producer_seek(tile + NUM_PROGRAMS, ctx, NUM_PROGRAMS, BLOCK_K, BLOCK_N, GROUP_M)
    else:
        nxt = (tile, r, rows16, a_base, b_base, k_left, n_left, sa_base, sb_base)
    return nxt


@gluon.jit
def _ready(NUM_STAGES: gl.constexpr, PROXY_FENCE: gl.constexpr):
    """Waits until the oldest step in the ring has landed, for every thread's copies.

    cp.async writes through the generic proxy and wgmma reads through the async proxy. PROXY_FENCE=2:
    each thread fences its own landed copies, then the barrier (the documented writer-side order; the
    compiler adds a barrier of its own between the wait and the fence: two per step). 1: the barrier,
    then every thread fences (one barrier). 0: no fence, as Triton's own cp.async + wgmma pipeline.
    """
    cp.wait_group(NUM_STAGES - 3)  # this thread's copies of the step have landed
    if PROXY_FENCE == 2:
        fence_async_shared()
    gl.thread_barrier()  # every thread's copies have landed; every warp has retired older wgmmas
    if PROXY_FENCE == 1:
        fence_async_shared()


@gluon.jit
def _mma_half(a_bufs, b_bufs, slot, H: gl.constexpr, acc, use_acc, HALF: gl.constexpr):
    """Issues (async) the wgmma of one column half of a step: a [BLOCK_K, BLOCK_R] x b_t rows
    [H * HALF, (H + 1) * HALF) seen transposed, [BLOCK_R, HALF] (K-major, as FP8 wgmma needs)."""
    b = b_bufs.index(slot).slice(H * HALF, HALF, dim=0).permute((1, 0))
    return warpgroup_mma(a_bufs.index(slot), b, acc, use_acc=use_acc, is_async=True)


@gluon.jit
def _promote(acc, part, bufs, slot, H: gl.constexpr, HALF: gl.constexpr, SCALING: gl.constexpr, ROW: gl.constexpr,
             COL: gl.constexpr):  # fmt: skip
    """acc += part (* the step's scales, blockwise) for one column half."""
    if SCALING == 2:
        # The step's scales from its ring slot (they arrived with its operands), read after the wgmma
        # wait: shared memory is close, and registers are tight before it.
        sa = bufs[2].index(slot).load(ROW)
        sb = bufs[3].index(slot).slice(H * HALF, HALF).load(COL)
        acc += (part * sa[:, None]) * sb[None, :]
    else:
        acc += part
    return acc


@gluon.jit
def _out_offsets(g, k0, n0, K, N, stride_og, stride_ok, stride_on, ROW: gl.constexpr, COL: gl.constexpr,
                 BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """Offsets and mask of out[g, k0:k0+BLOCK_K, n0:n0+BLOCK_N], built only where they are used: the tile
    origin enters each index before the broadcast, so no [BLOCK_K, BLOCK_N] piece of them is invariant
    across tiles (the compiler hoisted such pieces out of the tile loop, and kept them live through the
    whole mainloop: 40+ registers)."""
    kk = k0 + gl.arange(0, BLOCK_K, layout=ROW)
    nn = n0 + gl.arange(0, BLOCK_N, layout=COL)
    offs = (g.to(gl.int64) * stride_og + kk * stride_ok)[:, None] + (nn * stride_on)[None, :]
    return offs, (kk < K)[:, None] & (nn < N)[None, :]


@gluon.jit
def _load_c(c_ptr, g, k0, n0, K, N, stride_og, stride_ok, stride_on, ROW: gl.constexpr, COL: gl.constexpr,
            BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    offs, mask = _out_offsets(g, k0, n0, K, N, stride_og, stride_ok, stride_on, ROW, COL, BLOCK_K, BLOCK_N)
    return gl.load(c_ptr + offs, mask=mask, other=0.0)


@gluon.jit
def _store_out(out_ptr, acc, g, k0, n0, K, N, stride_og, stride_ok, stride_on, ROW: gl.constexpr, COL: gl.constexpr,
               BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    offs, mask = _out_offsets(g, k0, n0, K, N, stride_og, stride_ok, stride_on, ROW, COL, BLOCK_K, BLOCK_N)
    gl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def k_grouped_mm_fp8_gluon_kernel(
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
    stride_ar: gl.constexpr,
    stride_bn,
    stride_br: gl.constexpr,
    stride_og: gl.constexpr,
    stride_ok: gl.constexpr,
    stride_on: gl.constexpr,
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
    WIDE_OFFSETS: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    SCALING: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,
    IMPRECISE_ACC: gl.constexpr,  # None: fast accumulation (tensorwise/rowwise); else promote every step
    UPCAST: gl.constexpr,  # the Triton kernel's interpreter path; Gluon has none
    NUM_STAGES: gl.constexpr = 4,
    PROXY_FENCE: gl.constexpr = 2,  # see _ready
):
    gl.static_assert(not UPCAST, "the Gluon kernel has no interpreter path")
    gl.static_assert(stride_ar == 1 and stride_br == 1, "a_t and b_t must be contiguous along tokens")
    gl.static_assert(NUM_STAGES >= 3, "the ring holds a step in the wgmma, one being waited on, and loads")
    gl.static_assert(SCALE_BLOCK % BLOCK_R == 0, "a step must not straddle two 128-token scale blocks")
    gl.static_assert(BLOCK_R % 32 == 0, "wgmma k is 32 fp8")
    gl.static_assert(IMPRECISE_ACC is None or IMPRECISE_ACC == BLOCK_R, "promotion happens once per step")
    # Blockwise always promotes (the scales change every 128 tokens); tensorwise/rowwise promote every
    # step (IMPRECISE_ACC = BLOCK_R, as the Triton kernel's max_num_imprecise_acc) or chain the wgmma.
    PROMOTE: gl.constexpr = SCALING == 2 or IMPRECISE_ACC is not None
    NW: gl.constexpr = gl.num_warps()
    GROUPS: gl.constexpr = _group_layout(BLOCK_G, NW)
    LOAD: gl.constexpr = _load_layout(BLOCK_R, NW)
    HALF: gl.constexpr = BLOCK_N // 2  # a step's wgmma is issued per column half (see the mainloop)
    MMA: gl.constexpr = _mma_layout(BLOCK_K, HALF, NW)
    SCALE_LOAD: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    OP_SMEM: gl.constexpr = _operand_smem_layout(BLOCK_R)
    VEC_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    S: gl.constexpr = NUM_STAGES

    pid = gl.program_id(0)
    offs_g, starts, ends = _group_bounds(group_sizes_ptr, G, M, BLOCK_G, GROUPS)
    # Clamped to [0, M]: int32 from here on (registers are the scarce resource in this kernel).
    rows_v = (ends - starts).to(gl.int32)
    live_g = offs_g < G
    t_units = gl.where(live_g, gl.cdiv(rows_v, T_ALIGN), 0)
    col_v = gl.associative_scan(t_units, 0, _add) - t_units  # schedule.aligned_group_offsets
    blocks = gl.where(live_g, gl.cdiv(rows_v, SCALE_BLOCK), 0)
    blk_v = gl.associative_scan(blocks, 0, _add) - blocks  # first 128-token scale block of each group
    k_tiles = gl.cdiv(K, BLOCK_K)
    n_tiles = gl.cdiv(N, BLOCK_N)
    tiles_per_group = k_tiles * n_tiles
    total = G * tiles_per_group

    a_bufs = gl.allocate_shared_memory(a_ptr.dtype.element_ty, [S, BLOCK_K, BLOCK_R], OP_SMEM)
    b_bufs = gl.allocate_shared_memory(b_ptr.dtype.element_ty, [S, BLOCK_N, BLOCK_R], OP_SMEM)
    if SCALING == 2:
        sa_bufs = gl.allocate_shared_memory(gl.float32, [S, BLOCK_K], VEC_SMEM)
        sb_bufs = gl.allocate_shared_memory(gl.float32, [S, BLOCK_N], VEC_SMEM)
        bufs = (a_bufs, b_bufs, sa_bufs, sb_bufs)
    else:
        bufs = (a_bufs, b_bufs, a_bufs, b_bufs)  # no scale ring
    ctx = (total, tiles_per_group, k_tiles, n_tiles, offs_g, rows_v, col_v, blk_v, a_ptr, b_ptr, sa_ptr, sb_ptr, N, K,
           stride_ak, stride_bn, stride_sag, stride_sak, stride_sbg, stride_sbn)  # fmt: skip

    # Ring protocol: step i lives in slot i % S. Iteration i (this program's i-th step) waits for step i,
    # issues its wgmma, then loads step i + S - 2 into the slot of step i - 2, whose wgmma every warp
    # retired before the barrier of iteration i. Prologue: steps 0 .. S - 3 in flight.
    prod = _producer_seek(pid, ctx, NUM_PROGRAMS, BLOCK_K, BLOCK_N, GROUP_M)
    for i in gl.static_range(S - 2):
        prod = _produce(i, prod, ctx, bufs, NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, SCALING, SCALE_BLOCK,
                        WIDE_OFFSETS, LOAD, SCALE_LOAD)  # fmt: skip

    zero = gl.zeros([BLOCK_K, HALF], gl.float32, MMA)
    it = 0  # steps consumed by this program
    for tile in range(pid, total, NUM_PROGRAMS):
        g, k_tile, n_tile = _tile_coords(tile, tiles_per_group, k_tiles, n_tiles, GROUP_M)
        rows = _pick(rows_v, offs_g, g).to(gl.int32)
        k0 = k_tile.to(gl.int64) * BLOCK_K
        n0 = n_tile.to(gl.int64) * BLOCK_N
        n_steps = gl.cdiv(rows, BLOCK_R)
        acc_l = zero
        acc_r = zero
        if n_steps > 0:
            # Step 0 of the tile (the previous tile drained its wgmma).
            _ready(S, PROXY_FENCE)
            slot = it % S
            tok_l = _mma_half(a_bufs, b_bufs, slot, 0, zero, False, HALF)
            tok_r = _mma_half(a_bufs, b_bufs, slot, 1, zero, False, HALF)
            if PROMOTE:
                # Each step is two wgmmas, one per column half, into fresh register tiles, so one half is
                # promoted into fp32 (with its scales) while the other half's wgmma runs:
                #   issue L(s) | promote R(s-1) | issue R(s) | wait L(s) | promote L(s) | ready(s+1) | wait R(s)
                # Nothing is in flight across the loop edge: ptxas serializes every wgmma of the kernel
                # (C7514) when a loop carries an in-flight wgmma whose registers are read (a retired
                # partial) in the same pipeline stage as a later wgmma into them. The tensor cores only
                # idle from the last wait to the next issue; the next step's barrier is already done.
                part = warpgroup_mma_wait(num_outstanding=1, deps=(tok_l,))
                acc_l = _promote(acc_l, part, bufs, slot, 0, HALF, SCALING, ROW, COL)
                prod = _produce((it + S - 2) % S, prod, ctx, bufs, NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M,
                                SCALING, SCALE_BLOCK, WIDE_OFFSETS, LOAD, SCALE_LOAD)  # fmt: skip
                _ready(S, PROXY_FENCE)  # for step it + 1 (the next tile's first step if this is the last)
                part_r = warpgroup_mma_wait(num_outstanding=0, deps=(tok_r,))
                for s in range(1, n_steps):
                    prev = slot
                    slot = (it + s) % S
                    tok_l = _mma_half(a_bufs, b_bufs, slot, 0, zero, False, HALF)
                    acc_r = _promote(acc_r, part_r, bufs, prev, 1, HALF, SCALING, ROW, COL)
                    tok_r = _mma_half(a_bufs, b_bufs, slot, 1, zero, False, HALF)
                    part = warpgroup_mma_wait(num_outstanding=1, deps=(tok_l,))
                    acc_l = _promote(acc_l, part, bufs, slot, 0, HALF, SCALING, ROW, COL)
                    # Copies after this step's scale reads: then the next reads of the ring are behind the
                    # barrier of _ready, and the compiler adds no barrier of its own here.
                    prod = _produce((it + s + S - 2) % S, prod, ctx, bufs, NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R,
                                    GROUP_M, SCALING, SCALE_BLOCK, WIDE_OFFSETS, LOAD, SCALE_LOAD)  # fmt: skip
                    _ready(S, PROXY_FENCE)
                    part_r = warpgroup_mma_wait(num_outstanding=0, deps=(tok_r,))
                if ACCUMULATE:
                    c_l = _load_c(
                        c_ptr, g, k0, n0, K, N, stride_og, stride_ok, stride_on, ROW, COL, BLOCK_K, HALF
                    )
                    c_r = _load_c(c_ptr, g, k0, n0 + HALF, K, N, stride_og, stride_ok, stride_on, ROW, COL, BLOCK_K,
                                  HALF)  # fmt: skip
                acc_r = _promote(acc_r, part_r, bufs, slot, 1, HALF, SCALING, ROW, COL)
            else:
                # Fast accumulation: both halves chained in their accumulators, one step in flight.
                prod = _produce((it + S - 2) % S, prod, ctx, bufs, NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M,
                                SCALING, SCALE_BLOCK, WIDE_OFFSETS, LOAD, SCALE_LOAD)  # fmt: skip
                acc_l, acc_r = warpgroup_mma_wait(num_outstanding=2, deps=(tok_l, tok_r))
                for s in range(1, n_steps):
                    slot = (it + s) % S
                    _ready(S, PROXY_FENCE)
                    acc_l = _mma_half(a_bufs, b_bufs, slot, 0, acc_l, True, HALF)
                    acc_r = _mma_half(a_bufs, b_bufs, slot, 1, acc_r, True, HALF)
                    prod = _produce((it + s + S - 2) % S, prod, ctx, bufs, NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R,
                                    GROUP_M, SCALING, SCALE_BLOCK, WIDE_OFFSETS, LOAD, SCALE_LOAD)  # fmt: skip
                    acc_l, acc_r = warpgroup_mma_wait(num_outstanding=2, deps=(acc_l, acc_r))
                if ACCUMULATE:
                    c_l = _load_c(
                        c_ptr, g, k0, n0, K, N, stride_og, stride_ok, stride_on, ROW, COL, BLOCK_K, HALF
                    )
                    c_r = _load_c(c_ptr, g, k0, n0 + HALF, K, N, stride_og, stride_ok, stride_on, ROW, COL, BLOCK_K,
                                  HALF)  # fmt: skip
                acc_l, acc_r = warpgroup_mma_wait(num_outstanding=0, deps=(acc_l, acc_r))
            it += n_steps
            if SCALING == 0:
                s_ab = gl.load(sa_ptr + g * stride_sag) * gl.load(sb_ptr + g * stride_sbg)
                acc_l = acc_l * s_ab
                acc_r = acc_r * s_ab
            elif SCALING == 1:
                kk = k0 + gl.arange(0, BLOCK_K, layout=ROW)
                sa = gl.load(sa_ptr + g.to(gl.int64) * stride_sag + kk * stride_sak, mask=kk < K, other=0.0)
                nn = n0 + gl.arange(0, HALF, layout=COL)
                sb_l = gl.load(sb_ptr + g.to(gl.int64) * stride_sbg + nn * stride_sbn, mask=nn < N, other=0.0)
                acc_l = (acc_l * sa[:, None]) * sb_l[None, :]
                nn = nn + HALF
                sb_r = gl.load(sb_ptr + g.to(gl.int64) * stride_sbg + nn * stride_sbn, mask=nn < N, other=0.0)
                acc_r = (acc_r * sa[:, None]) * sb_r[None, :]
            if ACCUMULATE:
                acc_l += c_l.to(gl.float32)
                acc_r += c_r.to(gl.float32)
        # One store site after the join (a store in each branch had its address math hoisted above the
        # branch, and so kept live through the mainloop). An empty group writes exact zeros; accumulating,
        # its out[g] is neither read nor written.
        if (n_steps > 0) or (not ACCUMULATE):
            _store_out(
                out_ptr, acc_l, g, k0, n0, K, N, stride_og, stride_ok, stride_on, ROW, COL, BLOCK_K, HALF
            )
            _store_out(out_ptr, acc_r, g, k0, n0 + HALF, K, N, stride_og, stride_ok, stride_on, ROW, COL, BLOCK_K,
                       HALF)  # fmt: skip
    cp.wait_group(0)  # copies past the last step are masked off, but must land before the CTA exits


def gluon_launch_meta(meta: dict, *, num_stages: int = 4, proxy_fence: int = 2) -> dict:
    """This kernel's launch meta-parameters from a ``KGroupedFp8Launch.meta`` (the Triton kernel's): the
    same constexprs, plus the ring depth; Triton's ``num_stages`` means nothing to a Gluon kernel."""
    if meta.get("UPCAST"):
        raise ValueError("the Gluon k-grouped FP8 kernel has no interpreter path (UPCAST)")
    out = {k: v for k, v in meta.items() if k != "num_stages"}
    out.update(NUM_STAGES=num_stages, PROXY_FENCE=proxy_fence)
    return out
