"""Warp-specialized scaled m-grouped FP8 GEMM in Gluon (Hopper): ``for g: out[rows(g)] = (x * sx)[rows(g)] @ ((w * sw)[g])^T``.

Shapes, dtypes, scales and the tile schedule are ``m_grouped_fp8``'s (x [M, K] and w [G, N, K] float8,
K-contiguous; group_sizes [G] on the device; optional bias [G, N]; out [M, N]; rows past
sum(group_sizes) are 0). This kernel runs the promoted mode only: each BLOCK_K step's partial product
leaves the tensor cores and is added (blockwise: scaled) into an fp32 accumulator.

Why warp specialization: a promotion reads its wgmma's result, so the issuing warpgroup must wait for
the wgmma to drain first, and in one instruction stream the tensor cores idle through every promotion
(627 TF/s blockwise on the H100 against 1271 with fast accumulation). Here, as in DeepGEMM, two consumer
warpgroups each own half of the tile's rows and run their own wgmma -> wait -> promote loop, so one's
promotion runs under the other's wgmma (docs/design.md, 'Warp-specialized FP8 kernels').

The ring, its protocol, the partitions and the consumers' K loop are ``gluon_hopper``'s (``warp_specialize_ring``,
``promoted_mainloop``); this module adds:
- ``_loader``: two bulk copies (TMA) a step, x [BLOCK_M, BLOCK_K] and w [BLOCK_N, BLOCK_K], into the ring,
  through descriptors it makes on the device over x [M, K] and w viewed [G * N, K] (Triton's global scratch;
  PyTorch launches only). A tile's rows past its group, or columns past N, are the next group's rows (zeros
  past the tensor): the epilogue's masks drop what they add. A cp.async loader (four warps issuing 16-byte
  copies) ran the dsv3-ep8-fc1 dgrad at 911 TF/s, this one at 967 (docs/design.md, 'Warp-specialized FP8
  kernels').
- ``_step``: one K step of a consumer: wgmma, the blockwise scales read from global memory under it (with
  TMA filling the ring no proxy fence waits on those loads), the promotion.
- ``_epilogue``: tensor/row scales, bias, the masked store straight from the wgmma registers.
Every partition walks the same persistent tile sequence (``moegemm._src.kernels.schedule``), computed from
group_sizes by each (workers take no tensors), so the ring's slot and phase agree without messages.

Supported: K a multiple of 16 (16-byte TMA rows), w's groups back to back (``stride_wg == N * stride_wn``), no
group offset. ``supported_problem`` says so; the launcher runs the Triton kernel otherwise.
"""

from __future__ import annotations

import dataclasses

import triton

from moegemm._src.kernels.gluon_hopper import (
    LOADER_WARPS,
    MAXNREG,
    acquire_slot_tx,
    gl,
    gluon,
    m_tile_space,
    operand_ring,
    promoted_mainloop,
    ring_barriers,
    supported,
    tma,
    tma_load,
    warp_specialize_ring,
    warpgroup_mma,
    warpgroup_mma_wait,
    wgmma_layout,
)
from moegemm._src.kernels.schedule import locate_row_tile

SCALINGS = {"tensorwise": 0, "rowwise": 1, "blockwise": 2}
__all__ = ["LOADER_WARPS", "MAXNREG", "SCALINGS", "MGroupedFp8WsLaunch", "supported", "supported_problem"]


def supported_problem(K: int, has_group_offset: bool, row_stride: int, M: int = 0, w_rows: int = 0) -> bool:
    """Problems this kernel takes: K in 16-byte rows (TMA), no EP offset, row strides (``row_stride``: the larger
    of x's and w's) and TMA row coordinates (x's M rows, w's G * N) that fit int32."""
    return (
        supported()
        and K % 16 == 0
        and not has_group_offset
        and row_stride < 2**31
        and M < 2**31
        and w_rows < 2**31
    )


@gluon.jit
def _loader(
    x_ptr, w_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, stride_xm, stride_wn,
    NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr,
):  # fmt: skip
    """Fills ring slot step % NUM_STAGES with each step's x [BLOCK_M, BLOCK_K] and w [BLOCK_N, BLOCK_K] tiles
    once both consumers released it. Boxes past M, G * N or K land as zeros."""
    STEP_BYTES: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K * a_bufs.dtype.primitive_bitwidth // 8
    x_desc = tma.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K], a_bufs.layout)
    w_desc = tma.make_tensor_descriptor(w_ptr, [G * N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K], b_bufs.layout)
    n_tiles = gl.cdiv(N, BLOCK_N)
    offs, starts, ends, m_tiles, tile_ends, total_tiles = m_tile_space(
        group_sizes_ptr, G, M, n_tiles, BLOCK_M, BLOCK_G
    )
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, _, n_tile, row0, row_end, _ = locate_row_tile(
            tile, offs, starts, ends, m_tiles, tile_ends, n_tiles, BLOCK_M, GROUP_M
        )
        w_row = gl.minimum(g, G - 1) * N + n_tile * BLOCK_N
        for k in range(gl.where(g < G, gl.cdiv(K, BLOCK_K), 0)):  # the tail slot loads nothing
            slot, bar = acquire_slot_tx(ready, empty, step, STEP_BYTES)
            tma_load(x_desc, [row0, k * BLOCK_K], bar, a_bufs.index(slot))
            tma_load(w_desc, [w_row, k * BLOCK_K], bar, b_bufs.index(slot))
            step += 1


@gluon.jit
def _consumer(
    sx_ptr,
    sw_ptr,
    bias_ptr,
    out_ptr,
    group_sizes_ptr,
    a_bufs,
    b_bufs,
    ready,
    empty,
    M,
    N,
    K,
    G,
    stride_om,
    stride_on,
    stride_bg,
    stride_bn,
    stride_sxg,
    stride_sxm,
    stride_sxk,
    stride_swg,
    stride_swn,
    stride_swk,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    SCALING: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,
    HALF: gl.constexpr,
):
    """Rows [HALF * BLOCK_M / 2, (HALF + 1) * BLOCK_M / 2) of every tile: ``promoted_mainloop`` with ``_step``,
    then ``_epilogue`` for each 128-column part."""
    SUB_M: gl.constexpr = BLOCK_M // 2
    SUB_N: gl.constexpr = BLOCK_N if BLOCK_N <= 128 else 128
    mma_layout: gl.constexpr = wgmma_layout(SUB_N, 32)
    offs_m = gl.arange(0, SUB_M, layout=gl.SliceLayout(1, mma_layout))
    offs_n = gl.arange(0, SUB_N, layout=gl.SliceLayout(0, mma_layout))
    n_tiles = gl.cdiv(N, BLOCK_N)
    offs, starts, ends, m_tiles, tile_ends, total_tiles = m_tile_space(
        group_sizes_ptr, G, M, n_tiles, BLOCK_M, BLOCK_G
    )
    partial = gl.zeros([SUB_M, SUB_N], gl.float32, mma_layout)
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, _, n_tile, row0, row_end, _ = locate_row_tile(
            tile, offs, starts, ends, m_tiles, tile_ends, n_tiles, BLOCK_M, GROUP_M
        )
        row0 = row0 + HALF * SUB_M
        rows = row_end - row0  # may be <= 0: this half of the tile is past the group
        col0 = n_tile * BLOCK_N
        g_w = gl.minimum(g, G - 1).to(gl.int64)  # the tail slot reads no weight or scale
        rows_g = (row0 + offs_m).to(gl.int64)
        k_steps = gl.where(g < G, gl.cdiv(K, BLOCK_K), 0)
        acc0, acc1, partial, step = promoted_mainloop(
            _step,
            (sx_ptr, rows_g, rows, stride_sxm, stride_sxk, offs_m, sw_ptr, g_w, col0, N, stride_swg, stride_swn,
             stride_swk, offs_n, BLOCK_K, SCALING, SCALE_BLOCK),
            k_steps, step, partial, a_bufs, b_bufs, ready, empty, HALF,
        )  # fmt: skip
        _epilogue(
            acc0, out_ptr, sx_ptr, sw_ptr, bias_ptr, g, g_w, G, rows_g, rows, col0, N, stride_om, stride_on,
            stride_bg, stride_bn, stride_sxg, stride_sxm, stride_swg, stride_swn, offs_m, offs_n, SCALING, HAS_BIAS,
        )  # fmt: skip
        if BLOCK_N > SUB_N:
            _epilogue(
                acc1, out_ptr, sx_ptr, sw_ptr, bias_ptr, g, g_w, G, rows_g, rows, col0 + SUB_N, N, stride_om,
                stride_on, stride_bg, stride_bn, stride_sxg, stride_sxm, stride_swg, stride_swn, offs_m, offs_n,
                SCALING, HAS_BIAS,
            )  # fmt: skip


@gluon.jit
def _step(
    a, b_slot, slot, k, partial, acc, PART: gl.constexpr, sx_ptr, rows_g, rows, stride_sxm, stride_sxk, offs_m,
    sw_ptr, g_w, col0, N, stride_swg, stride_swn, stride_swk, offs_n, BLOCK_K: gl.constexpr, SCALING: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,
):  # fmt: skip
    """K step k of column part PART (SUB_N wide), ``promoted_mainloop``'s step: wgmma into ``partial``, then
    acc += partial (blockwise: times the step's activation and weight scales, loaded under the wgmma)."""
    SUB_N: gl.constexpr = partial.shape[1]
    sw_base = sw_ptr + g_w * stride_swg + ((k * BLOCK_K) // SCALE_BLOCK) * stride_swk
    b = b_slot.slice(PART * SUB_N, SUB_N).permute((1, 0))
    token = warpgroup_mma(a, b, partial, use_acc=False, is_async=True)
    if SCALING == 2:  # loaded under the wgmma
        kb = (k * BLOCK_K) // SCALE_BLOCK
        sx = gl.load(sx_ptr + rows_g * stride_sxm + kb * stride_sxk, mask=offs_m < rows, other=0.0)
        c0 = col0 + PART * SUB_N
        # The weight's scales along K are contiguous: one L1 line serves 32 steps.
        if SCALE_BLOCK % SUB_N == 0:  # the part sits inside one weight block
            # A part past N (the right half of a 256-wide tile) reads nothing: its block index is past
            # the weight's last.
            sw = gl.load(sw_base + (c0 // SCALE_BLOCK) * stride_swn, mask=c0 < N, other=0.0)
        else:
            sw = gl.load(
                sw_base + ((c0 + offs_n) // SCALE_BLOCK) * stride_swn, mask=offs_n < N - c0, other=0.0
            )
    partial = warpgroup_mma_wait(0, deps=[token])
    if SCALING == 2:
        if SCALE_BLOCK % SUB_N == 0:
            acc += partial * (sx * sw)[:, None]
        else:
            acc += partial * sx[:, None] * sw[None, :]
    else:
        acc += partial
    return acc, partial


@gluon.jit
def _epilogue(
    acc, out_ptr, sx_ptr, sw_ptr, bias_ptr, g, g_w, G, rows_g, rows, col0, N, stride_om, stride_on, stride_bg,
    stride_bn, stride_sxg, stride_sxm, stride_swg, stride_swn, offs_m, offs_n, SCALING: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):  # fmt: skip
    """Tensor/row scales, bias and the masked store of columns [col0, col0 + SUB_N) of a finished tile."""
    row_mask = offs_m < rows
    col_mask = offs_n < N - col0
    if SCALING == 0:
        acc *= gl.load(sx_ptr + g_w * stride_sxg) * gl.load(sw_ptr + g_w * stride_swg)
    elif SCALING == 1:
        sx = gl.load(sx_ptr + rows_g * stride_sxm, mask=row_mask, other=0.0)
        sw = gl.load(sw_ptr + g_w * stride_swg + (col0 + offs_n) * stride_swn, mask=col_mask, other=0.0)
        acc *= sx[:, None] * sw[None, :]
    if HAS_BIAS:
        bias_cols = gl.where(g < G, N - col0, 0)  # the tail slot adds no bias
        bias = gl.load(
            bias_ptr + g_w * stride_bg + (col0 + offs_n) * stride_bn, mask=offs_n < bias_cols, other=0.0
        )
        acc += bias.to(gl.float32)[None, :]
    out_offs = (rows_g * stride_om)[:, None] + ((col0 + offs_n) * stride_on)[None, :]
    gl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@gluon.jit
def m_grouped_mm_fp8_ws_kernel(
    x_ptr,
    w_ptr,
    sx_ptr,
    sw_ptr,
    group_sizes_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    G,
    stride_xm,
    stride_wn,  # w's groups back to back: group g's rows start at row g * N (supported_problem)
    stride_om,
    stride_on,
    stride_bg,
    stride_bn,
    stride_sxg,  # TENSOR
    stride_sxm,  # ROW, BLOCK
    stride_sxk,  # BLOCK
    stride_swg,
    stride_swn,  # ROW, BLOCK
    stride_swk,  # BLOCK
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    SCALING: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,  # 128
    NUM_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,  # setmaxnreg of each consumer warpgroup; the loader gets the rest
):
    gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 rows")
    gl.static_assert(
        SCALING != 2 or SCALE_BLOCK % BLOCK_K == 0, "blockwise scaling needs BLOCK_K dividing 128"
    )
    a_bufs = operand_ring(x_ptr.dtype.element_ty, NUM_STAGES, BLOCK_M, BLOCK_K)
    b_bufs = operand_ring(w_ptr.dtype.element_ty, NUM_STAGES, BLOCK_N, BLOCK_K)
    ready, empty = ring_barriers(NUM_STAGES)
    warp_specialize_ring(
        _loader,
        (
            x_ptr, w_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, stride_xm, stride_wn,
            NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_G,
        ),
        _consumer,
        (
            sx_ptr, sw_ptr, bias_ptr, out_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G,
            stride_om, stride_on, stride_bg, stride_bn, stride_sxg, stride_sxm, stride_sxk, stride_swg, stride_swn,
            stride_swk, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_G, HAS_BIAS, SCALING, SCALE_BLOCK,
        ),
        CONSUMER_REGS,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MGroupedFp8WsLaunch:
    """Grid and meta-parameters of one m_grouped_mm_fp8_ws_kernel launch, from static shapes only."""

    grid: tuple[int]
    meta: dict

    @staticmethod
    def make(M: int, N: int, K: int, G: int, *, recipe: str, config, num_programs_cap: int, has_bias: bool):
        """config: ``configs.Fp8WsConfig``; num_programs_cap: the SM count (one CTA per SM:
        the ring takes most of shared memory)."""
        bm, bn, bk = 128, config.block_n, 128
        max_tiles = (triton.cdiv(M, bm) + G + 1) * triton.cdiv(N, bn)
        num_programs = max(1, min(max_tiles, num_programs_cap))
        meta = dict(
            NUM_PROGRAMS=num_programs,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            GROUP_M=config.group_m,
            BLOCK_G=max(16, triton.next_power_of_2(G + 1)),
            HAS_BIAS=has_bias,
            SCALING=SCALINGS[recipe],
            SCALE_BLOCK=128,
            NUM_STAGES=config.num_stages,
            CONSUMER_REGS=config.consumer_regs,
            num_warps=LOADER_WARPS,
            maxnreg=MAXNREG,
        )
        return MGroupedFp8WsLaunch(grid=(num_programs,), meta=meta)
