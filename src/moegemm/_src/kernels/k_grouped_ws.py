"""Warp-specialized k-grouped GEMM in Gluon (Hopper, BF16/FP16, the weight gradient of mid-size groups):
``for g: out[g] = a[rows(g)]^T @ b[rows(g)]``.

Shapes: a [M, Ka] and b [M, Nb] row-major, group_sizes [G] on the device (clamped as ``schedule`` says), out
[G, Ka, Nb] in the operands' dtype, contiguous; a group with no rows writes exact zeros. Accumulation, the fused
column sums (dbias), expert-parallel offsets and fp32 outputs stay on the Triton kernel (``k_grouped``).

Why: the Triton kernel's one warp stream issues each step's copies, their address and mask work, and the wgmma,
and on mid-size groups (8-16 steps a 128 x 256 tile) that stream, the accumulator reset and the epilogue keep
the tensor pipe ~61% busy (gpt-oss-20b). Here the copies leave the MMA warps' path (docs/design.md,
'Warp-specialized wgrad').

The ring, its protocol and the partitions are ``gluon_hopper``'s (``warp_specialize_ring``); this module adds:
- ``_loader``: makes a TMA descriptor pair per group on the device, over a [row_end, Ka] and b [row_end, Nb]
  (the copy engine zero-fills the rows past the group's end, so no step adds the next group's rows), once the
  copies through the previous pair landed (``drain_copies``), and issues three bulk copies a step into the
  ring: a's [BLOCK_R, 64] column halves and b's [BLOCK_R, BLOCK_N] rows. Descriptors need Triton's global
  scratch (the front end's allocator).
- ``_consumer`` (two warpgroups): out rows [k0 + 64 h, k0 + 64 h + 64) of every tile, wgmma with a's half
  read transposed from shared memory and one wgmma in flight; a finished half tile goes through a staging
  tile and leaves by a TMA store over out's 2-D view [G * Ka, Nb] (Ka % 64 == 0: a half tile's rows are all
  in out[g] or all past it), which runs under the next tile's steps. With 3 slots each consumer has its own
  staging tile; the table's 4 slots (192 KB) leave room for one, which the consumers take in turns
  (``c_turn``): the 4th slot is worth more than the turn costs (4.5% over 3 slots).
Tiles are ``(g, k_tile, n_tile)``, a group's consecutive (``schedule.swizzle_tile`` inside it); every partition
walks the same sequence, so ring slots and phases agree without messages. An empty group's tile takes one
step at the descriptor's extent (zeros) and stores zeros.
"""

from __future__ import annotations

import dataclasses

import triton

from moegemm._src.kernels.gluon_hopper import (
    LOADER_WARPS,
    MAXNREG,
    acquire_slot_tx,
    drain_copies,
    fence_async_shared,
    gl,
    gluon,
    group_bounds,
    mbarrier,
    operand_ring,
    release_slot,
    ring_barriers,
    supported,
    thread_barrier,
    tma,
    tma_load,
    tma_store,
    wait_slot,
    warp_specialize_ring,
    warpgroup_mma,
    warpgroup_mma_wait,
    wgmma_layout,
)
from moegemm._src.kernels.schedule import pick, sm90_shared_fits, swizzle_tile

__all__ = ["BLOCK_K", "KGroupedWsLaunch", "k_grouped_mm_ws_kernel", "supported", "supported_problem"]

BLOCK_K = 128  # out rows per tile: two consumer warpgroups of 64


def supported_problem(Ka: int, Nb: int, itemsize: int, row_strides: tuple[int, ...], M: int) -> bool:
    """Problems this kernel takes (on top of the front end's: 2-byte out without accumulation, no column sums,
    no group offset, 16-byte aligned bases): Ka a multiple of 64 (the consumers' half tiles), Nb and the row
    strides multiples of 8 elements (16-byte TMA rows), row coordinates that fit int32."""
    return (
        supported()
        and itemsize == 2
        and Ka > 0
        and Nb > 0
        and Ka % 64 == 0
        and Nb % 8 == 0
        and all(s > 0 and s % 8 == 0 for s in row_strides)
        and 0 < M < 2**31
    )


@gluon.jit
def _locate(
    tile, offs, starts, ends, K: gl.constexpr, N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
):  # fmt: skip
    """Tile index -> (g, k0, n0, row_start, row_end)."""
    k_tiles = gl.cdiv(K, BLOCK_K)
    n_tiles = gl.cdiv(N, BLOCK_N)
    g = tile // (k_tiles * n_tiles)
    k_tile, n_tile = swizzle_tile(tile % (k_tiles * n_tiles), k_tiles, n_tiles, GROUP_M)
    return g, k_tile * BLOCK_K, n_tile * BLOCK_N, pick(starts, offs, g), pick(ends, offs, g)


@gluon.jit
def _loader(
    a_ptr, b_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, K: gl.constexpr, N: gl.constexpr,
    G: gl.constexpr, stride_am, stride_bm, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr,
):  # fmt: skip
    """Fills ring slot step % NUM_STAGES with step's rows of a (two 64-column halves) and b."""
    HALF_K: gl.constexpr = BLOCK_K // 2
    STEP_BYTES: gl.constexpr = BLOCK_R * (BLOCK_K + BLOCK_N) * a_bufs.dtype.primitive_bitwidth // 8
    a_layout: gl.constexpr = a_bufs.layout
    b_layout: gl.constexpr = b_bufs.layout
    offs, starts, ends = group_bounds(group_sizes_ptr, G, M, BLOCK_G)
    total_tiles = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
    step = 0
    desc_g = -1
    desc_step = 0  # the first step that copied through the current descriptors
    a_desc = tma.make_tensor_descriptor(a_ptr, [1, K], [stride_am, 1], [BLOCK_R, HALF_K], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [1, N], [stride_bm, 1], [BLOCK_R, BLOCK_N], b_layout)
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, k0, n0, row_start, row_end = _locate(tile, offs, starts, ends, K, N, BLOCK_K, BLOCK_N, GROUP_M)
        # Descriptors end at the group's last row; a nonzero extent, and an empty group's one step starts at it.
        extent = gl.maximum(row_end, 1)
        if g != desc_g:
            drain_copies(ready, desc_step, step, step)
            desc_g = g
            desc_step = step
            a_desc = tma.make_tensor_descriptor(
                a_ptr, [extent, K], [stride_am, 1], [BLOCK_R, HALF_K], a_layout
            )
            b_desc = tma.make_tensor_descriptor(
                b_ptr, [extent, N], [stride_bm, 1], [BLOCK_R, BLOCK_N], b_layout
            )
        row0 = gl.where(row_end > row_start, row_start, extent)
        for r in range(gl.maximum(gl.cdiv(row_end - row_start, BLOCK_R), 1)):
            slot, bar = acquire_slot_tx(ready, empty, step, STEP_BYTES)
            row = row0 + r * BLOCK_R
            tma_load(a_desc, [row, k0], bar, a_bufs.index(2 * slot))
            tma_load(a_desc, [row, k0 + HALF_K], bar, a_bufs.index(2 * slot + 1))
            tma_load(b_desc, [row, n0], bar, b_bufs.index(slot))
            step += 1


@gluon.jit
def _hand_over(c_turn, HALF: gl.constexpr):
    """Shared staging tile: this consumer's last TMA store has read it, so the other one may write it."""
    tma.store_wait(0)
    thread_barrier()  # the store's issuing thread waited; the arrive may come from another
    mbarrier.arrive(c_turn.index(1 - HALF), count=1)


@gluon.jit
def _consumer(
    out_desc, group_sizes_ptr, a_bufs, b_bufs, c_bufs, ready, empty, c_turn, M, K: gl.constexpr, N: gl.constexpr,
    G: gl.constexpr, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr,
    GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr, HALF: gl.constexpr,
):  # fmt: skip
    """Out rows [k0 + 64 HALF, k0 + 64 HALF + 64) of every tile: wgmma with one in flight, then the TMA store.
    With one staging tile (C_TILES == 1) the consumers take turns, HALF 0 first: c_turn[h] completes once
    per tile when h may write it, and a consumer hands it over once its store has read it, which it checks
    after the next tile's first wgmma is issued, so the wait runs under that wgmma."""
    SUB_K: gl.constexpr = BLOCK_K // 2
    NUM_STAGES: gl.constexpr = b_bufs.shape[0]
    C_TILES: gl.constexpr = c_bufs.shape[0]
    mma_layout: gl.constexpr = wgmma_layout(BLOCK_N, 16)
    c_smem = c_bufs.index(HALF % C_TILES)
    offs, starts, ends = group_bounds(group_sizes_ptr, G, M, BLOCK_G)
    total_tiles = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
    step = 0
    t = 0  # this program's tiles so far
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, k0, n0, row_start, row_end = _locate(tile, offs, starts, ends, K, N, BLOCK_K, BLOCK_N, GROUP_M)
        acc = gl.zeros([SUB_K, BLOCK_N], gl.float32, mma_layout)
        for r in range(gl.maximum(gl.cdiv(row_end - row_start, BLOCK_R), 1)):
            slot = wait_slot(ready, step)
            a = a_bufs.index(2 * slot + HALF).permute((1, 0))  # [SUB_K, BLOCK_R], read transposed
            acc = warpgroup_mma(a, b_bufs.index(slot), acc, is_async=True)
            # Step r - 1's wgmma has drained once at most this one is in flight: its slot goes back.
            acc = warpgroup_mma_wait(1, deps=[acc])
            if r > 0:
                release_slot(empty, (step + NUM_STAGES - 1) % NUM_STAGES)
            elif C_TILES == 1:
                if t > 0:
                    _hand_over(c_turn, HALF)
            step += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        release_slot(empty, (step + NUM_STAGES - 1) % NUM_STAGES)
        row_out = k0 + HALF * SUB_K
        # One staging tile: HALF 0 waits for HALF 1's store of the tile before, HALF 1 for HALF 0's of this one.
        if C_TILES == 1:
            mbarrier.wait(c_turn.index(HALF), (t & 1) ^ (1 - HALF))
        else:
            tma.store_wait(0)  # the previous tile's copy has read the staging tile
        if row_out < K:  # Ka % 64 == 0: a half tile is all in out[g] or all past it
            c_smem.store(acc.to(c_smem.dtype))
            fence_async_shared()
            tma_store(out_desc, [g * K + row_out, n0], c_smem)
        t += 1
    if C_TILES == 1:
        if t > 0:
            _hand_over(c_turn, HALF)  # the other consumer may be waiting for the last tile's
    tma.store_wait(0)


@gluon.jit
def k_grouped_mm_ws_kernel(
    out_desc,  # a host TensorDescriptor over out viewed [G * K, N], block [BLOCK_K / 2, BLOCK_N]
    a_ptr,
    b_ptr,
    group_sizes_ptr,
    M,
    K: gl.constexpr,  # out[g]'s rows (a's columns) and columns (b's); fixed per layer, compiled in
    N: gl.constexpr,
    G: gl.constexpr,
    stride_am,
    stride_bm,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_K: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_R: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    C_TILES: gl.constexpr,  # staging tiles: one per consumer, or one they take turns on (a deeper ring)
    CONSUMER_REGS: gl.constexpr,  # setmaxnreg of each consumer warpgroup; the loader gets the rest
):
    gl.static_assert(BLOCK_K == 128, "two consumer warpgroups of 64 out rows")
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_bufs = operand_ring(dtype, 2 * NUM_STAGES, BLOCK_R, BLOCK_K // 2)  # a slot's two column halves
    b_bufs = operand_ring(dtype, NUM_STAGES, BLOCK_R, BLOCK_N)
    c_bufs = gl.allocate_shared_memory(out_desc.dtype, [C_TILES, BLOCK_K // 2, BLOCK_N], out_desc.layout)
    ready, empty = ring_barriers(NUM_STAGES)
    c_turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(c_turn.index(i), count=1)
    warp_specialize_ring(
        _loader,
        (
            a_ptr, b_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, K, N, G, stride_am, stride_bm,
            NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G,
        ),
        _consumer,
        (
            out_desc, group_sizes_ptr, a_bufs, b_bufs, c_bufs, ready, empty, c_turn, M, K, N, G, NUM_PROGRAMS,
            BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G,
        ),
        CONSUMER_REGS,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class KGroupedWsLaunch:
    """Grid and meta-parameters of one k_grouped_mm_ws_kernel launch, from static shapes only. The front end
    builds out's descriptor: [G * K, N] with block [BLOCK_K // 2, BLOCK_N], an NVMMA-swizzled layout."""

    grid: tuple[int]
    meta: dict

    @staticmethod
    def make(M: int, N: int, K: int, G: int, *, config, num_programs_cap: int) -> KGroupedWsLaunch:
        """N, K: out[g]'s columns and rows; config: ``configs.WsConfig`` (block_n, block_k = the row step
        BLOCK_R, num_stages, group_m, consumer_regs); num_programs_cap: the SM count (one CTA per SM). Raises
        ValueError where the ring and one staging tile do not fit in shared memory (a tuned-cache entry can
        name any config)."""
        tiles = G * triton.cdiv(K, BLOCK_K) * triton.cdiv(N, config.block_n)
        ring = config.num_stages * config.block_k * (BLOCK_K + config.block_n) * 2
        staging = (BLOCK_K // 2) * config.block_n * 2
        meta = dict(
            NUM_PROGRAMS=max(1, min(tiles, num_programs_cap)),
            BLOCK_K=BLOCK_K,
            BLOCK_N=config.block_n,
            BLOCK_R=config.block_k,
            GROUP_M=config.group_m,
            BLOCK_G=max(16, triton.next_power_of_2(G)),
            NUM_STAGES=config.num_stages,
            # A staging tile per consumer where it fits beside the ring, else one they share.
            C_TILES=2 if sm90_shared_fits(ring + 2 * staging, 1) else 1,
            CONSUMER_REGS=config.consumer_regs,
            num_warps=LOADER_WARPS,
            maxnreg=MAXNREG,
        )
        if not sm90_shared_fits(ring + meta["C_TILES"] * staging, 1):
            raise ValueError(
                f"k_grouped_ws: {config} needs {ring + staging} bytes of shared memory (ring and one staging "
                "tile), more than one sm90 CTA gets"
            )
        return KGroupedWsLaunch(grid=(meta["NUM_PROGRAMS"],), meta=meta)
