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
- ``_epilogue``: tensor/row scales, bias, then the store (STORE; docs/design.md, 'Warp-specialized FP8
  kernels', says what each measured):
  - STORE_TMA (a 2-byte out whose rows take a descriptor): each consumer's 64 x 128 part goes through its
    staging tile, by one TMA store where all 64 rows are in the tile's group, which drains while the consumer
    starts the next tile; a part crossing its group's end as STORE_ROWS does.
  - STORE_ROWS (a 2-byte out): the part goes through the staging tile and back into rows of 16-byte runs,
    stored under the row mask.
  - STORE_REGISTERS: the masked store straight from the wgmma registers, 4 bytes a thread and 8 rows a warp
    instruction; on dsv3-ep8-fc1 that epilogue held the tensor cores idle for 7-17% of fwd/dgrad.
Every partition walks the same persistent tile sequence (``moegemm._src.kernels.schedule``), computed from
group_sizes by each (workers take no tensors), so the ring's slot and phase agree without messages.

Supported: K a multiple of 16 (16-byte TMA rows), w's groups back to back (``stride_wg == N * stride_wn``), no
group offset. ``supported_problem`` says so; the launcher runs the Triton kernel otherwise. Why a group's rows
never go through TMA past its end: a box is clipped only at the tensor's bounds, and the rows after a group's
end are the next group's, which another program writes.
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
    stage_out,
    supported,
    thread_barrier,
    tma,
    tma_load,
    warp_specialize_ring,
    warpgroup_mma,
    warpgroup_mma_wait,
    wgmma_layout,
)
from moegemm._src.kernels.schedule import locate_row_tile

SCALINGS = {"tensorwise": 0, "rowwise": 1, "blockwise": 2}
__all__ = [
    "LOADER_WARPS",
    "MAXNREG",
    "SCALINGS",
    "STAGE_COLS",
    "STORE_REGISTERS",
    "STORE_ROWS",
    "STORE_TMA",
    "MGroupedFp8WsLaunch",
    "shared_bytes",
    "supported",
    "supported_problem",
]

STAGE_COLS = 128  # a consumer's staging tile: 64 rows x 128 columns of out (one column part)
# The epilogue's store (the kernel's STORE): from the wgmma registers, through the staging tiles into rows, or
# through them by TMA where a part's rows are all in its group.
# The kernel compares STORE with these literals (it cannot read module globals).
STORE_REGISTERS, STORE_ROWS, STORE_TMA = 0, 1, 2


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
    out_desc,
    group_sizes_ptr,
    a_bufs,
    b_bufs,
    c_bufs,
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
    STORE: gl.constexpr,
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
        c_smem = c_bufs.index(HALF)
        _epilogue(
            acc0, out_ptr, out_desc, c_smem, sx_ptr, sw_ptr, bias_ptr, g, g_w, G, row0, rows_g, rows, col0, N,
            stride_om, stride_on, stride_bg, stride_bn, stride_sxg, stride_sxm, stride_swg, stride_swn, offs_m,
            offs_n, SCALING, HAS_BIAS, STORE,
        )  # fmt: skip
        if BLOCK_N > SUB_N:
            _epilogue(
                acc1, out_ptr, out_desc, c_smem, sx_ptr, sw_ptr, bias_ptr, g, g_w, G, row0, rows_g, rows,
                col0 + SUB_N, N, stride_om, stride_on, stride_bg, stride_bn, stride_sxg, stride_sxm, stride_swg,
                stride_swn, offs_m, offs_n, SCALING, HAS_BIAS, STORE,
            )  # fmt: skip
    if STORE == 2:  # STORE_TMA
        tma.store_wait(0)  # the last stores have read the staging tile before the CTA's shared memory goes


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
    acc, out_ptr, out_desc, c_smem, sx_ptr, sw_ptr, bias_ptr, g, g_w, G, row0, rows_g, rows, col0, N, stride_om,
    stride_on, stride_bg, stride_bn, stride_sxg, stride_sxm, stride_swg, stride_swn, offs_m, offs_n,
    SCALING: gl.constexpr, HAS_BIAS: gl.constexpr, STORE: gl.constexpr,
):  # fmt: skip
    """Tensor/row scales, bias and the store of columns [col0, col0 + SUB_N) of this consumer's rows [row0,
    row0 + rows) of a finished tile (rows may exceed SUB_M, or be <= 0: none)."""
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
    out = acc.to(out_ptr.dtype.element_ty)
    if STORE != 0:  # STORE_ROWS, STORE_TMA
        SUB_M: gl.constexpr = acc.shape[0]
        if STORE == 2:  # STORE_TMA
            # This consumer's previous store has read the staging tile (the issuing thread waits; every thread
            # writes the tile after the barrier).
            tma.store_wait(0)
        thread_barrier()  # (and every thread read its rows of the staging tile's last use)
        if STORE == 2 and rows >= SUB_M:
            stage_out(out, out_desc, c_smem, row0, col0, False)
        elif rows > 0:
            # STORE_ROWS, or a part crossing its group's end (a TMA box would write the next group's rows):
            # through the staging tile into rows of 16-byte runs, stored under the row mask.
            c_smem.store(out)
            thread_barrier()
            layout: gl.constexpr = _row_store_layout(SUB_M, c_smem.shape[1], out_ptr.dtype.element_ty)
            om = gl.arange(0, SUB_M, layout=gl.SliceLayout(1, layout))
            on = gl.arange(0, c_smem.shape[1], layout=gl.SliceLayout(0, layout))
            offs = ((row0 + om).to(gl.int64) * stride_om)[:, None] + ((col0 + on) * stride_on)[None, :]
            mask = (om < rows)[:, None] & (on < N - col0)[None, :]
            gl.store(out_ptr + offs, c_smem.load(layout), mask=mask)
    else:
        out_offs = (rows_g * stride_om)[:, None] + ((col0 + offs_n) * stride_on)[None, :]
        gl.store(out_ptr + out_offs, out, mask=row_mask[:, None] & col_mask[None, :])


@gluon.constexpr_function
def _row_store_layout(rows, cols, dtype):
    """A [rows, cols] tile of a consumer warpgroup in 16-byte runs along its rows (a warp's store covers whole
    rows)."""
    vec = 16 // (dtype.primitive_bitwidth // 8)
    threads_n = min(32, cols // vec)
    return gl.BlockedLayout([1, vec], [32 // threads_n, threads_n], [4, 1], [1, 0])


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
    STORE: gl.constexpr,  # STORE_REGISTERS, STORE_ROWS (staging tiles: a 2-byte out), STORE_TMA (and a descriptor)
):
    gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 rows")
    gl.static_assert(
        SCALING != 2 or SCALE_BLOCK % BLOCK_K == 0, "blockwise scaling needs BLOCK_K dividing 128"
    )
    gl.static_assert(STORE == 0 or BLOCK_N % 128 == 0, "a staging tile holds one 128-column part")
    a_bufs = operand_ring(x_ptr.dtype.element_ty, NUM_STAGES, BLOCK_M, BLOCK_K)
    b_bufs = operand_ring(w_ptr.dtype.element_ty, NUM_STAGES, BLOCK_N, BLOCK_K)
    ready, empty = ring_barriers(NUM_STAGES)
    STAGE_N: gl.constexpr = 128  # STAGE_COLS (a module global, which a kernel cannot read)
    out_dtype: gl.constexpr = out_ptr.dtype.element_ty
    out_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, STAGE_N], out_dtype)
    if STORE != 0:  # STORE_ROWS, STORE_TMA
        c_bufs = gl.allocate_shared_memory(
            out_dtype, [2, BLOCK_M // 2, STAGE_N], out_layout
        )  # one a consumer
    else:
        c_bufs = gl.allocate_shared_memory(out_dtype, [2, 1, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    if STORE == 2:  # STORE_TMA
        # In Triton's global scratch, as the loader's: made once a program.
        out_desc = tma.make_tensor_descriptor(
            out_ptr, [M, N], [stride_om, 1], [BLOCK_M // 2, STAGE_N], out_layout
        )
    else:
        out_desc = out_ptr  # unread
    warp_specialize_ring(
        _loader,
        (
            x_ptr, w_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, N, K, G, stride_xm, stride_wn,
            NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_G,
        ),
        _consumer,
        (
            sx_ptr, sw_ptr, bias_ptr, out_ptr, out_desc, group_sizes_ptr, a_bufs, b_bufs, c_bufs, ready, empty, M,
            N, K, G, stride_om, stride_on, stride_bg, stride_bn, stride_sxg, stride_sxm, stride_sxk, stride_swg,
            stride_swn, stride_swk, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_G, HAS_BIAS, SCALING,
            SCALE_BLOCK, STORE,
        ),
        CONSUMER_REGS,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MGroupedFp8WsLaunch:
    """Grid and meta-parameters of one m_grouped_mm_fp8_ws_kernel launch, from static shapes only."""

    grid: tuple[int]
    meta: dict

    @staticmethod
    def make(
        M: int, N: int, K: int, G: int, *, recipe: str, config, num_programs_cap: int, has_bias: bool,
        store: int = STORE_REGISTERS,
    ):  # fmt: skip
        """config: ``configs.Fp8WsConfig``; num_programs_cap: the SM count (one CTA per SM:
        the ring takes most of shared memory); store: the epilogue's STORE_* (STORE_ROWS needs a 2-byte out,
        STORE_TMA one with a 16-byte aligned base and row stride, column stride 1)."""
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
            STORE=store,
            num_warps=LOADER_WARPS,
            maxnreg=MAXNREG,
        )
        return MGroupedFp8WsLaunch(grid=(num_programs,), meta=meta)


def shared_bytes(block_n: int, num_stages: int, store: int, out_itemsize: int = 2) -> int:
    """The ring (FP8 x and w tiles a slot) and, for a staged store, the consumers' two staging tiles."""
    return num_stages * 128 * (128 + block_n) + (2 * 64 * STAGE_COLS * out_itemsize if store else 0)
