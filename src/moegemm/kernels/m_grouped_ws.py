"""Warp-specialized m-grouped GEMM in Gluon (Hopper, BF16/FP16): ``for g: out[rows(g)] = x[rows(g)] @ w[g] (+ bias[g])``.

Shapes and semantics are ``m_grouped``'s: x [M, K], w [G, K, N] read either K-contiguous (an
nn.Linear weight [G, N, K] as stored: the forward) or N-contiguous (the same weight as the dgrad's
[G, K=N_fwd, N=K_fwd] operand), group_sizes [G] on the device (clamped as ``schedule`` says), optional
bias [G, N] added in fp32 before the one rounding, out [M, N]; rows past sum(group_sizes) are 0.

Why it exists, and why it is opt-in (``MOEGEMM_WS=1``): the Triton kernel (``m_grouped``) runs one
instruction stream per CTA, and as in the FP8 kernels of perf-notes 20 a loader warpgroup that owns
the copies, with two consumer warpgroups that only wait, wgmma and release, was expected to beat it.
On the H100 it did not: 0.87x (suite) and 0.93x (held-out) of the Triton kernel, whose software
pipeline already keeps the tensor pipe 93.6% busy on BF16 (perf-notes 23). It stays as the tested base
for what that entry names (TMA multicast across a CTA pair, consumers out of phase).

Partitions (``gl.warp_specialize``, protocol in ``moegemm.kernels.gluon_hopper``):
- default (LOADER_WARPS): each step's x [BLOCK_M, BLOCK_K] and w tile into a ring of NUM_STAGES
  NVMMA-swizzled slots, by cp.async (``m_grouped_mm_ws_kernel``: rows past the group clamped to its
  last row, K past its end and an N-contiguous weight's columns past N zero-filled by masks) or by TMA
  over host descriptors (``m_grouped_mm_ws_tma_kernel``, PyTorch only; ``_tma_loader`` says what it
  reads past the group).
- two workers of 4 warps: rows [h * 64, (h + 1) * 64) of each tile. Step k's wgmma is issued before
  step k - 1's slot is released (``warpgroup_mma_wait(1)``), then the epilogue adds the bias and stores
  straight from the wgmma registers (masked, so partial tiles write only their rows).
Every partition walks the same persistent tile sequence, computed from group_sizes by each, so the
ring's slots and phases agree without messages. The tail slot (g == G) runs no steps and stores zeros.

Supported (``supported_problem``): 2-byte operands whose contiguous dimensions (K; and N for an
N-contiguous weight) and row strides are multiples of 16 elements, 16-byte aligned bases, no group
offset (expert parallelism keeps the Triton kernel), tile offsets that fit int32.
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
    m_tile_space,
    mark_slot_loaded,
    mbarrier,
    release_slot,
    ring_barriers,
    supported,
    tma_load,
    wait_slot_free,
    wait_slot_ready,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from moegemm.kernels.m_grouped import tma_load_fits
from moegemm.kernels.schedule import locate_row_tile

__all__ = ["LOADER_WARPS", "MAXNREG", "MGroupedWsLaunch", "supported", "supported_problem", "supported_tma"]

BLOCK_M = 128  # two consumer warpgroups of 64 rows
# The cp.async loader's 24 copies a step need 88 registers: consumers get at most 208 beside it (ptxas
# spilled least there, 68 B a thread in the schedule set-up only; 184: 456 B, 240: 320 B).
CP_ASYNC_CONSUMER_REGS = 208
VEC = gl.constexpr(8) if supported() else 8  # 2-byte elements per 16-byte cp.async


def supported_problem(
    K: int, N: int, w_k_contiguous: bool, has_group_offset: bool, row_strides: tuple[int, ...], itemsize: int,
    col_strides: tuple[int, ...] = (),
) -> bool:  # fmt: skip
    """Problems this kernel takes. ``row_strides``: x's row stride and w's stride along its
    non-contiguous dimension (each a multiple of 16 elements, so every 16-byte chunk is aligned);
    offsets inside a 256-row tile, one expert's weight (N-contiguous) and a row of out or bias
    (``col_strides``: their column strides) must fit int32."""
    contiguous = (K,) if w_k_contiguous else (K, N)
    return (
        supported()
        and itemsize == 2
        and not has_group_offset
        and K > 0
        and all(d % 16 == 0 for d in contiguous)
        and all(s % 16 == 0 and 0 < s and 256 * s < 2**31 for s in row_strides)
        and (w_k_contiguous or (K + 64) * row_strides[-1] < 2**31)
        and all(abs(s) * (N + 256) < 2**31 for s in col_strides)
    )


@gluon.jit
def _loader(
    x_ptr, w_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N: gl.constexpr, K: gl.constexpr,
    G: gl.constexpr, stride_xm, stride_wg, stride_w_row, NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr,
    EVEN_K: gl.constexpr, EVEN_N: gl.constexpr, W_K_CONTIGUOUS: gl.constexpr,
):  # fmt: skip
    """Fills ring slot step % NUM_STAGES with step's x and w tiles once both consumers released it.
    ``stride_w_row``: w's stride along its non-contiguous dimension (N if K-contiguous, else K)."""
    a_layout: gl.constexpr = copy_layout(BLOCK_K, gl.num_warps(), VEC)
    cp_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_layout))
    cp_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_layout))
    if W_K_CONTIGUOUS:  # w tile [BLOCK_N, BLOCK_K], rows along N
        b_layout: gl.constexpr = copy_layout(BLOCK_K, gl.num_warps(), VEC)
        b_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, b_layout))
        b_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, b_layout))
    else:  # w tile [BLOCK_K, BLOCK_N], rows along K
        b_layout: gl.constexpr = copy_layout(BLOCK_N, gl.num_warps(), VEC)
        b_rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, b_layout))
        b_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, b_layout))
    n_tiles = gl.cdiv(N, BLOCK_N)
    offs, starts, ends, m_tiles, tile_ends, total_tiles = m_tile_space(
        group_sizes_ptr, G, M, n_tiles, BLOCK_M, BLOCK_G
    )
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, _, n_tile, row0, row_end, _ = locate_row_tile(
            tile, offs, starts, ends, m_tiles, tile_ends, n_tiles, BLOCK_M, GROUP_M
        )
        col0 = n_tile * BLOCK_N
        x_base = x_ptr + row0.to(gl.int64) * stride_xm
        # Rows past the group's end (and, K-contiguous, weight rows past N) are clamped to the last
        # valid row instead of masked: they read bytes the tile reads anyway, their products land in
        # rows or columns the consumers do not store, and the loader keeps no mask registers (a mask a
        # chunk spilled 320 B a thread at the loader's 72 registers). Offsets inside a tile fit int32
        # (supported_problem bounds the strides); the tile origins are int64 bases.
        x_offs = gl.minimum(cp_m, row_end - 1 - row0)[:, None] * stride_xm + cp_k[None, :]
        g_w = gl.minimum(g, G - 1).to(gl.int64)  # the tail slot reads nothing; keep its address valid
        if W_K_CONTIGUOUS:
            w_base = w_ptr + g_w * stride_wg + col0.to(gl.int64) * stride_w_row
            if EVEN_N:
                b_offs = b_rows[:, None] * stride_w_row + b_cols[None, :]
            else:
                b_offs = gl.minimum(b_rows, N - 1 - col0)[:, None] * stride_w_row + b_cols[None, :]
        else:
            w_base = w_ptr + g_w * stride_wg + col0
            b_offs = b_rows[:, None] * stride_w_row + b_cols[None, :]
        # N-contiguous weight: columns are the contiguous dimension, where a clamp would break the
        # 16-byte chunks, so a partial column tile masks (N % 16 == 0 keeps each chunk's mask uniform).
        b_col_mask = (b_cols < N - col0)[None, :]
        k_steps = gl.where(g < G, gl.cdiv(K, BLOCK_K), 0)  # the tail slot loads nothing
        for k in range(k_steps):
            slot = wait_slot_free(empty, step)
            k0 = k * BLOCK_K
            a_src = x_base + k0 + x_offs
            if W_K_CONTIGUOUS:
                b_src = w_base + k0 + b_offs
            else:
                b_src = w_base + k0 * stride_w_row + b_offs
            if EVEN_K:
                async_load(a_bufs.index(slot), a_src)
                if W_K_CONTIGUOUS or EVEN_N:
                    async_load(b_bufs.index(slot), b_src)
                else:
                    async_load(b_bufs.index(slot), b_src, mask=b_col_mask)
            else:
                async_load(a_bufs.index(slot), a_src, mask=(cp_k < K - k0)[None, :])
                if W_K_CONTIGUOUS:
                    async_load(b_bufs.index(slot), b_src, mask=(b_cols < K - k0)[None, :])
                elif EVEN_N:
                    async_load(b_bufs.index(slot), b_src, mask=(b_rows < K - k0)[:, None])
                else:
                    b_mask = (b_rows < K - k0)[:, None] & b_col_mask
                    async_load(b_bufs.index(slot), b_src, mask=b_mask)
            mark_slot_loaded(ready, slot)
            step += 1


@gluon.jit
def _tma_loader(
    x_desc, w_desc, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N: gl.constexpr, K: gl.constexpr,
    G: gl.constexpr, NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr, W_K_CONTIGUOUS: gl.constexpr,
):  # fmt: skip
    """The loader with TMA: two bulk copies a step (x rows [row0, row0 + BLOCK_M), the weight's 2-D
    view), counted on the slot's ``ready`` barrier by bytes. Rows past the group read other groups'
    rows, whose products land in rows the consumers do not store; rows past M and K past its end
    are zero-filled by the copy engine (the descriptors' bounds). K-contiguous, the weight is
    [G * N, K] and tile columns past N read group g + 1's rows (never stored either); N-contiguous
    it is [G * K, N], which needs K % BLOCK_K == 0 (supported_tma) so no step reads group g + 1."""
    STEP_BYTES: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K * a_bufs.dtype.primitive_bitwidth // 8
    n_tiles = gl.cdiv(N, BLOCK_N)
    offs, starts, ends, m_tiles, tile_ends, total_tiles = m_tile_space(
        group_sizes_ptr, G, M, n_tiles, BLOCK_M, BLOCK_G
    )
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, _, n_tile, row0, _, _ = locate_row_tile(
            tile, offs, starts, ends, m_tiles, tile_ends, n_tiles, BLOCK_M, GROUP_M
        )
        col0 = n_tile * BLOCK_N
        k_steps = gl.where(g < G, gl.cdiv(K, BLOCK_K), 0)  # the tail slot loads nothing
        for k in range(k_steps):
            slot = wait_slot_free(empty, step)
            bar = ready.index(slot)
            mbarrier.expect(bar, STEP_BYTES)
            tma_load(x_desc, [row0, k * BLOCK_K], bar, a_bufs.index(slot))
            if W_K_CONTIGUOUS:
                tma_load(w_desc, [g * N + col0, k * BLOCK_K], bar, b_bufs.index(slot))
            else:
                tma_load(w_desc, [g * K + k * BLOCK_K, col0], bar, b_bufs.index(slot))
            step += 1


@gluon.jit
def _consumer(
    bias_ptr, out_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N: gl.constexpr, K: gl.constexpr,
    G: gl.constexpr, stride_om, stride_on, stride_bg, stride_bn, HALF: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr, HAS_BIAS: gl.constexpr, W_K_CONTIGUOUS: gl.constexpr, PROXY_FENCE: gl.constexpr,
):  # fmt: skip
    """Rows [HALF * 64, HALF * 64 + 64) of every tile: wgmma with one in flight, then the epilogue."""
    SUB_M: gl.constexpr = BLOCK_M // 2
    NUM_STAGES: gl.constexpr = a_bufs.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 16]
    )
    offs_m = gl.arange(0, SUB_M, layout=gl.SliceLayout(1, mma_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    n_tiles = gl.cdiv(N, BLOCK_N)
    offs, starts, ends, m_tiles, tile_ends, total_tiles = m_tile_space(
        group_sizes_ptr, G, M, n_tiles, BLOCK_M, BLOCK_G
    )
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, _, n_tile, row0, row_end, _ = locate_row_tile(
            tile, offs, starts, ends, m_tiles, tile_ends, n_tiles, BLOCK_M, GROUP_M
        )
        row0 = row0 + HALF * SUB_M
        rows = row_end - row0  # may be <= 0: this half of the tile is past the group
        col0 = n_tile * BLOCK_N
        acc = gl.zeros([SUB_M, BLOCK_N], gl.float32, mma_layout)
        k_steps = gl.where(g < G, gl.cdiv(K, BLOCK_K), 0)
        for k in range(k_steps):
            slot = wait_slot_ready(ready, step, PROXY_FENCE)
            a = a_bufs.index(slot).slice(HALF * SUB_M, SUB_M)
            if W_K_CONTIGUOUS:
                b = b_bufs.index(slot).permute((1, 0))
            else:
                b = b_bufs.index(slot)
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # Step k - 1's wgmma has drained once at most this one is in flight: its slot goes back.
            acc = warpgroup_mma_wait(1, deps=[acc])
            if k > 0:
                release_slot(empty, (step + NUM_STAGES - 1) % NUM_STAGES)
            step += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        if k_steps > 0:
            release_slot(empty, (step + NUM_STAGES - 1) % NUM_STAGES)
        row_mask = offs_m < rows
        col_mask = offs_n < N - col0
        if HAS_BIAS:
            bias_cols = gl.where(g < G, N - col0, 0)  # the tail slot adds no bias
            g_w = gl.minimum(g, G - 1).to(gl.int64)
            bias = gl.load(
                bias_ptr + g_w * stride_bg + (col0 + offs_n) * stride_bn, mask=offs_n < bias_cols, other=0.0
            )
            acc += bias.to(gl.float32)[None, :]
        out_offs = ((row0 + offs_m).to(gl.int64) * stride_om)[:, None] + ((col0 + offs_n) * stride_on)[
            None, :
        ]
        gl.store(
            out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :]
        )


@gluon.jit
def m_grouped_mm_ws_kernel(
    x_ptr,
    w_ptr,
    group_sizes_ptr,
    bias_ptr,
    out_ptr,
    M,
    N: gl.constexpr,  # fixed per layer, compiled in as in m_grouped (perf-notes 9)
    K: gl.constexpr,
    G: gl.constexpr,
    stride_xm,
    stride_wg,
    stride_w_row,  # w's stride along N (K-contiguous w) or along K (N-contiguous w)
    stride_om,
    stride_on,
    stride_bg,
    stride_bn,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    EVEN_K: gl.constexpr,
    EVEN_N: gl.constexpr,  # N % BLOCK_N == 0: no weight column bound
    W_K_CONTIGUOUS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,  # setmaxnreg of each consumer warpgroup; the loader gets the rest
    PROXY_FENCE: gl.constexpr,
):
    gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 rows")
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    a_bufs = gl.allocate_shared_memory(
        dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    )
    if W_K_CONTIGUOUS:
        b_bufs = gl.allocate_shared_memory(
            dtype,
            [NUM_STAGES, BLOCK_N, BLOCK_K],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype),
        )
    else:
        b_bufs = gl.allocate_shared_memory(
            dtype,
            [NUM_STAGES, BLOCK_K, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype),
        )
    ready, empty = ring_barriers(NUM_STAGES)
    # Partition arguments are spelled out in place: a tuple built in a variable first loses the
    # constexpr-ness of its entries (triton 3.6).
    # fmt: off
    gl.warp_specialize(
        [
            (_loader, (
                x_ptr, w_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, stride_xm, stride_wg,
                stride_w_row, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_G, EVEN_K, EVEN_N,
                W_K_CONTIGUOUS,
            )),
            (_consumer, (
                bias_ptr, out_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, stride_om, stride_on,
                stride_bg, stride_bn, 0, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_G, HAS_BIAS,
                W_K_CONTIGUOUS, PROXY_FENCE,
            )),
            (_consumer, (
                bias_ptr, out_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, stride_om, stride_on,
                stride_bg, stride_bn, 1, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_G, HAS_BIAS,
                W_K_CONTIGUOUS, PROXY_FENCE,
            )),
        ],
        [CONSUMER_WARPS, CONSUMER_WARPS],
        [CONSUMER_REGS, CONSUMER_REGS],
    )
    # fmt: on


@gluon.jit
def m_grouped_mm_ws_tma_kernel(
    x_desc,  # [M, K], block [BLOCK_M, BLOCK_K]
    w_desc,  # [G * N, K] block [BLOCK_N, BLOCK_K] (K-contiguous) or [G * K, N] block [BLOCK_K, BLOCK_N]
    group_sizes_ptr,
    bias_ptr,
    out_ptr,
    M,
    N: gl.constexpr,
    K: gl.constexpr,
    G: gl.constexpr,
    stride_om,
    stride_on,
    stride_bg,
    stride_bn,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    W_K_CONTIGUOUS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """m_grouped_mm_ws_kernel with a TMA loader (PyTorch only: jax-triton 0.3.1 cannot pass host
    tensor descriptors). No proxy fence: TMA writes shared memory through the async proxy wgmma reads."""
    gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 rows")
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    if W_K_CONTIGUOUS:
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
    ready, empty = ring_barriers(NUM_STAGES, True)
    # fmt: off
    gl.warp_specialize(
        [
            (_tma_loader, (
                x_desc, w_desc, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, NUM_PROGRAMS, BLOCK_M,
                BLOCK_N, BLOCK_K, GROUP_M, BLOCK_G, W_K_CONTIGUOUS,
            )),
            (_consumer, (
                bias_ptr, out_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, stride_om, stride_on,
                stride_bg, stride_bn, 0, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_G, HAS_BIAS,
                W_K_CONTIGUOUS, False,
            )),
            (_consumer, (
                bias_ptr, out_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, stride_om, stride_on,
                stride_bg, stride_bn, 1, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_G, HAS_BIAS,
                W_K_CONTIGUOUS, False,
            )),
        ],
        [CONSUMER_WARPS, CONSUMER_WARPS],
        [CONSUMER_REGS, CONSUMER_REGS],
    )
    # fmt: on


@dataclasses.dataclass(frozen=True)
class MGroupedWsLaunch:
    """Grid and meta-parameters of one m_grouped_mm_ws_kernel (or, with ``tma``, m_grouped_mm_ws_tma_kernel)
    launch, from static shapes only. The TMA kernel's descriptors are the front end's to build (x [M, K]
    with block [BLOCK_M, BLOCK_K]; W's 2-D view, rows ``w_row_stride`` apart, block [BLOCK_N, BLOCK_K]
    K-contiguous or [BLOCK_K, BLOCK_N] N-contiguous; NVMMA-swizzled layouts)."""

    grid: tuple[int]
    meta: dict
    tma: bool = False
    w_row_stride: int = 0

    @staticmethod
    def make(
        M: int, N: int, K: int, G: int, *, config, num_programs_cap: int, w_k_contiguous: bool, has_bias: bool,
        tma: bool = False, w_row_stride: int = 0,
    ) -> MGroupedWsLaunch:  # fmt: skip
        """config: ``configs.WsConfig``; num_programs_cap: the SM count (one CTA per SM: the ring takes
        most of shared memory); tma: the TMA kernel (``supported_tma`` holds), w_row_stride: W's stride
        along its non-contiguous dimension (the rows of its 2-D view)."""
        bn, bk = config.block_n, config.block_k
        max_tiles = (triton.cdiv(M, BLOCK_M) + G + 1) * triton.cdiv(N, bn)
        num_programs = max(1, min(max_tiles, num_programs_cap))
        meta = dict(
            NUM_PROGRAMS=num_programs,
            BLOCK_M=BLOCK_M,
            BLOCK_N=bn,
            BLOCK_K=bk,
            GROUP_M=config.group_m,
            BLOCK_G=max(16, triton.next_power_of_2(G + 1)),
            W_K_CONTIGUOUS=w_k_contiguous,
            HAS_BIAS=has_bias,
            NUM_STAGES=config.num_stages,
            CONSUMER_REGS=config.consumer_regs if tma else min(config.consumer_regs, CP_ASYNC_CONSUMER_REGS),
            num_warps=LOADER_WARPS,
            maxnreg=MAXNREG,
        )
        if not tma:
            meta.update(
                EVEN_K=K % bk == 0,
                EVEN_N=N % bn == 0,
                # cp.async writes through the generic proxy, wgmma reads through the async one.
                PROXY_FENCE=True,
            )
        return MGroupedWsLaunch(grid=(num_programs,), meta=meta, tma=tma, w_row_stride=w_row_stride)


def supported_tma(
    M: int, N: int, K: int, G: int, w_k_contiguous: bool, w_g_stride: int, w_row: int, block_k: int
) -> bool:
    """Problems the TMA loader takes (on top of ``supported_problem``): W's groups back to back, so
    that it has a 2-D view of G * N (or G * K) rows; N-contiguous, K a multiple of BLOCK_K (a K-tail
    step would read the next group's rows); coordinates that fit int32."""
    rows = N if w_k_contiguous else K
    return (
        w_g_stride == rows * w_row
        and tma_load_fits(K, block_k, w_k_contiguous)
        and G * rows < 2**31
        and M < 2**31
    )
