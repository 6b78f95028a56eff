"""Warp-specialized k-grouped GEMM in Gluon (Hopper, BF16/FP16, the weight gradient):
``for g: out[g] = a[rows(g)]^T @ b[rows(g)]``.

Shapes and semantics are ``k_grouped``'s for the store mode: a [M, K] and b [M, N] row-major,
group_sizes [G] on the device (clamped as ``schedule`` says), out [G, K, N] (fp32 or the operands'
dtype, any strides); a group with no rows writes exact zeros. Accumulating into out and the fused
column sums (dbias) stay on the Triton kernel.

Why: a wgrad tile reduces over one group's rows only, 384-1024 on most MoE layers (4-16 steps of 64),
so the Triton kernel spends a large share of each tile filling its cp.async pipeline and storing the
128 x 256 result while the tensor cores wait (gpt-oss-20b fc2 wgrad: 0.78x torch._grouped_mm,
perf-notes 17). Here a loader warpgroup runs ahead across tile boundaries, so the next tile's first
steps land while the consumers store this one.

Partitions (protocol in ``moegemm.kernels.gluon_hopper``):
- default (LOADER_WARPS): cp.async of each step's a rows [BLOCK_R, BLOCK_K] (as two [BLOCK_R,
  BLOCK_K / 2] halves, one per consumer) and b rows [BLOCK_R, BLOCK_N] into the ring. Rows past the
  group's end must add nothing, so the last step of a group (and a tile past K or N) copies with
  masks (zero-fill); full steps copy without, keeping mask registers out of the loop.
- two workers of 4 warps: out rows [h * BLOCK_K / 2, (h + 1) * BLOCK_K / 2) of each tile; wgmma
  with the a half read transposed from shared memory, one wgmma in flight, then a masked store.
Tiles are ``(g, k_tile, n_tile)``, a group's consecutive (``schedule.swizzle_tile`` inside it).
Not TMA: rows of the next group sit inside the descriptor's bounds, and the reduction needs zeros there.

Supported (``supported_problem``): 2-byte operands, K, N and the row strides multiples of 16
elements, 16-byte aligned bases, no group offset.
"""

from __future__ import annotations

import dataclasses

import triton

from moegemm.kernels.gluon_hopper import (
    CONSUMER_WARPS,
    LOADER_WARPS,
    MAXNREG,
    async_load,
    copy_layout,
    gl,
    gluon,
    mark_slot_loaded,
    release_slot,
    ring_barriers,
    sched_layout,
    supported,
    wait_slot_free,
    wait_slot_ready,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from moegemm.kernels.schedule import clamped_group_bounds, pick, swizzle_tile

__all__ = ["KGroupedWsLaunch", "supported", "supported_problem"]

BLOCK_K = 128  # out rows per tile: two consumer warpgroups of 64
VEC = gl.constexpr(8) if supported() else 8  # 2-byte elements per 16-byte cp.async
CONSUMER_REGS = 208  # beside the cp.async loader (m_grouped_ws.CP_ASYNC_CONSUMER_REGS)


def supported_problem(
    K: int, N: int, has_group_offset: bool, row_strides: tuple[int, ...], itemsize: int
) -> bool:
    """Problems this kernel takes. ``row_strides``: a's and b's row strides (multiples of 16
    elements, so every 16-byte chunk is aligned; a step's offsets must fit int32)."""
    return (
        supported()
        and itemsize == 2
        and not has_group_offset
        and K > 0
        and N > 0
        and K % 16 == 0
        and N % 16 == 0
        and all(s % 16 == 0 and 0 < s and 256 * s < 2**31 for s in row_strides)
    )


@gluon.jit
def _group_bounds(group_sizes_ptr, G, M, BLOCK_G: gl.constexpr):
    """(offs, starts, ends) of the groups, int32 (clamped into [0, M])."""
    offs = gl.arange(0, BLOCK_G, layout=sched_layout(gl.num_warps()))
    starts, ends = clamped_group_bounds(group_sizes_ptr, offs, G, M)
    return offs, starts.to(gl.int32), ends.to(gl.int32)


@gluon.jit
def _locate(
    tile, offs, starts, ends, K: gl.constexpr, N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
):  # fmt: skip
    """Tile index -> (g, k0, n0, row_start, rows)."""
    k_tiles = gl.cdiv(K, BLOCK_K)
    n_tiles = gl.cdiv(N, BLOCK_N)
    g = tile // (k_tiles * n_tiles)
    k_tile, n_tile = swizzle_tile(tile % (k_tiles * n_tiles), k_tiles, n_tiles, GROUP_M)
    row_start = pick(starts, offs, g)
    return g, k_tile * BLOCK_K, n_tile * BLOCK_N, row_start, pick(ends, offs, g) - row_start


@gluon.jit
def _loader(
    a_ptr, b_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, K: gl.constexpr, N: gl.constexpr,
    G: gl.constexpr, stride_am, stride_bm, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr,
):  # fmt: skip
    """Fills ring slot step % NUM_STAGES with step's rows of a (two column halves) and b."""
    HALF_K: gl.constexpr = BLOCK_K // 2
    a_layout: gl.constexpr = copy_layout(HALF_K, gl.num_warps(), VEC)
    a_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, a_layout))
    a_c = gl.arange(0, HALF_K, layout=gl.SliceLayout(0, a_layout))
    b_layout: gl.constexpr = copy_layout(BLOCK_N, gl.num_warps(), VEC)
    b_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, b_layout))
    b_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, b_layout))
    # Offsets inside one step fit int32 (supported_problem bounds the strides); row advances are int64.
    a_offs = a_r[:, None] * stride_am + a_c[None, :]
    b_offs = b_r[:, None] * stride_bm + b_c[None, :]
    offs, starts, ends = _group_bounds(group_sizes_ptr, G, M, BLOCK_G)
    total_tiles = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        _, k0, n0, row_start, rows = _locate(tile, offs, starts, ends, K, N, BLOCK_K, BLOCK_N, GROUP_M)
        a_base = a_ptr + row_start.to(gl.int64) * stride_am + k0
        b_base = b_ptr + row_start.to(gl.int64) * stride_bm + n0
        cols_full = (k0 + BLOCK_K <= K) & (n0 + BLOCK_N <= N)
        for r in range(gl.cdiv(rows, BLOCK_R)):
            slot = wait_slot_free(empty, step)
            r0 = r * BLOCK_R
            a_src = a_base + r0.to(gl.int64) * stride_am + a_offs
            b_src = b_base + r0.to(gl.int64) * stride_bm + b_offs
            if cols_full & (r0 + BLOCK_R <= rows):
                async_load(a_bufs.index(2 * slot), a_src)
                async_load(a_bufs.index(2 * slot + 1), a_src + HALF_K)
                async_load(b_bufs.index(slot), b_src)
            else:  # the group's last step, or a tile past K or N: zero-fill what is not ours
                a_rows = (a_r < rows - r0)[:, None]
                async_load(a_bufs.index(2 * slot), a_src, mask=a_rows & (a_c < K - k0)[None, :])
                async_load(
                    a_bufs.index(2 * slot + 1), a_src + HALF_K, mask=a_rows & (a_c < K - k0 - HALF_K)[None, :]
                )
                async_load(
                    b_bufs.index(slot), b_src, mask=(b_r < rows - r0)[:, None] & (b_c < N - n0)[None, :]
                )
            mark_slot_loaded(ready, slot)
            step += 1


@gluon.jit
def _consumer(
    out_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, K: gl.constexpr, N: gl.constexpr,
    G: gl.constexpr, stride_og, stride_ok, stride_on, HALF: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
    BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr, PROXY_FENCE: gl.constexpr,
):  # fmt: skip
    """Out rows [HALF * 64, HALF * 64 + 64) of every tile: wgmma with one in flight, then the store."""
    SUB_K: gl.constexpr = BLOCK_K // 2
    NUM_STAGES: gl.constexpr = b_bufs.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 16]
    )
    offs_m = gl.arange(0, SUB_K, layout=gl.SliceLayout(1, mma_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    offs, starts, ends = _group_bounds(group_sizes_ptr, G, M, BLOCK_G)
    total_tiles = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, k0, n0, _, rows = _locate(tile, offs, starts, ends, K, N, BLOCK_K, BLOCK_N, GROUP_M)
        acc = gl.zeros([SUB_K, BLOCK_N], gl.float32, mma_layout)
        r_steps = gl.cdiv(rows, BLOCK_R)
        for r in range(r_steps):
            slot = wait_slot_ready(ready, step, PROXY_FENCE)
            a = a_bufs.index(2 * slot + HALF).permute((1, 0))  # [SUB_K, BLOCK_R], read transposed
            acc = warpgroup_mma(a, b_bufs.index(slot), acc, is_async=True)
            # Step r - 1's wgmma has drained once at most this one is in flight: its slot goes back.
            acc = warpgroup_mma_wait(1, deps=[acc])
            if r > 0:
                release_slot(empty, (step + NUM_STAGES - 1) % NUM_STAGES)
            step += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        if r_steps > 0:
            release_slot(empty, (step + NUM_STAGES - 1) % NUM_STAGES)
        row0 = k0 + HALF * SUB_K
        mask = (offs_m < K - row0)[:, None] & (offs_n < N - n0)[None, :]
        out_offs = (
            g.to(gl.int64) * stride_og
            + ((row0 + offs_m).to(gl.int64) * stride_ok)[:, None]
            + ((n0 + offs_n) * stride_on)[None, :]
        )
        gl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def k_grouped_mm_ws_kernel(
    a_ptr,
    b_ptr,
    group_sizes_ptr,
    out_ptr,
    M,
    K: gl.constexpr,  # fixed per layer, compiled in as in k_grouped (perf-notes 9)
    N: gl.constexpr,
    G: gl.constexpr,
    stride_am,
    stride_bm,
    stride_og,
    stride_ok,
    stride_on,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_K: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_R: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PROXY_FENCE: gl.constexpr,
):
    gl.static_assert(BLOCK_K == 128, "two consumer warpgroups of 64 out rows")
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    HALF_K: gl.constexpr = BLOCK_K // 2
    a_bufs = gl.allocate_shared_memory(
        dtype,
        [2 * NUM_STAGES, BLOCK_R, HALF_K],
        gl.NVMMASharedLayout.get_default_for([BLOCK_R, HALF_K], dtype),
    )
    b_bufs = gl.allocate_shared_memory(
        dtype, [NUM_STAGES, BLOCK_R, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], dtype)
    )
    ready, empty = ring_barriers(NUM_STAGES)
    # fmt: off
    gl.warp_specialize(
        [
            (_loader, (
                a_ptr, b_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, K, N, G, stride_am, stride_bm,
                NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G,
            )),
            (_consumer, (
                out_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, K, N, G, stride_og, stride_ok,
                stride_on, 0, NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G, PROXY_FENCE,
            )),
            (_consumer, (
                out_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, K, N, G, stride_og, stride_ok,
                stride_on, 1, NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G, PROXY_FENCE,
            )),
        ],
        [CONSUMER_WARPS, CONSUMER_WARPS],
        [CONSUMER_REGS, CONSUMER_REGS],
    )
    # fmt: on


@dataclasses.dataclass(frozen=True)
class KGroupedWsLaunch:
    """Grid and meta-parameters of one k_grouped_mm_ws_kernel launch, from static shapes only."""

    grid: tuple[int]
    meta: dict

    @staticmethod
    def make(M: int, N: int, K: int, G: int, *, config, num_programs_cap: int) -> KGroupedWsLaunch:
        """N, K: out[g]'s columns and rows; config: ``configs.WsConfig`` (block_n, block_k = the row step
        BLOCK_R, num_stages, group_m; consumer registers capped beside the cp.async loader)."""
        tiles = G * triton.cdiv(K, BLOCK_K) * triton.cdiv(N, config.block_n)
        num_programs = max(1, min(tiles, num_programs_cap))
        meta = dict(
            NUM_PROGRAMS=num_programs,
            BLOCK_K=BLOCK_K,
            BLOCK_N=config.block_n,
            BLOCK_R=config.block_k,
            GROUP_M=config.group_m,
            BLOCK_G=max(16, triton.next_power_of_2(G)),
            NUM_STAGES=config.num_stages,
            CONSUMER_REGS=min(config.consumer_regs, CONSUMER_REGS),
            # cp.async writes through the generic proxy, wgmma reads through the async one.
            PROXY_FENCE=True,
            num_warps=LOADER_WARPS,
            maxnreg=MAXNREG,
        )
        return KGroupedWsLaunch(grid=(num_programs,), meta=meta)
