"""Scaled m-grouped GEMM (FP8 fprop and dgrad): ``for g: out[rows(g)] = (x * sx)[rows(g)] @ ((w * sw)[g])^T``.

Shapes: x [M, K] and w [G, N, K] in float8 (e4m3 or e5m2), both contiguous along K: Hopper's FP8
wgmma reads K-major operands only, so the layouts are planned (the quantize kernels write a
weight's [G, K, N] transposed copy for dgrad) instead of transposed here. group_sizes [G] on the
device, optional bias [G, N], out [M, N] (bf16/fp16/fp32). Rows past sum(group_sizes) are 0.

Scales (``moegemm._src.fp8`` has the layouts), by SCALING:

- TENSOR: ``sx[g]`` and ``sw[g]`` (a stride of 0 broadcasts one scale), applied once in the epilogue.
- ROW: ``sx[row]`` and ``sw[g, n]``, in the epilogue.
- BLOCK: ``sx[row, k // 128]`` and ``sw[g, n // 128, k // 128]``. Each BLOCK_K step's partial
  product leaves the tensor cores and is scaled into the fp32 accumulator (DeepSeek-V3's promotion).

The tile schedule is the BF16 kernel's (``moegemm._src.kernels.schedule``): a persistent grid over the
group-by-group tile space, slot G zero-filling the unowned rows. Expert parallelism
(``HAS_GROUP_OFFSET``) as in the BF16 kernel: group_sizes holds G_TOTAL groups, w (and its scales,
and a bias) the G local ones from ``*group_offset_ptr``; the local rows are read and written in place
and the others zero-filled. Activation scales stay global: per row, or (tensorwise, per group) indexed
by the global group when sx has G_TOTAL entries.

The expert block's options are the BF16 kernel's (``m_grouped.py``; docs/design.md, 'FP8 expert block'):
``GATHER`` reads x's rows (and their ROW/BLOCK scales) through gather [M], and ``EPILOGUE`` "swiglu" (fc1:
the tile's columns are gate and up halves, ``_swiglu_columns``; z and h stored) or "swiglu_bwd" (fc2's dgrad:
dz, s * h and the routing weights' partial gradient from the kept z) runs on the scaled fp32 accumulator.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from moegemm._src.kernels.m_grouped import _swiglu_bwd_epilogue, _swiglu_columns, _swiglu_epilogue
from moegemm._src.kernels.schedule import (
    clamped_group_offset,
    locate_row_tile,
    m_grouped_tile_space,
    store_zero_tiles,
)

TENSOR, ROW, BLOCK = 0, 1, 2
SCALINGS = {"tensorwise": TENSOR, "rowwise": ROW, "blockwise": BLOCK}


@triton.jit
def m_grouped_mm_fp8_kernel(
    x_ptr,
    w_ptr,
    sx_ptr,
    sw_ptr,
    group_sizes_ptr,
    group_offset_ptr,  # int32 [1]: the first local group (read only with HAS_GROUP_OFFSET)
    bias_ptr,
    gather_ptr,  # GATHER: int32 [M], the x row each out row reads
    act_ptr,  # EPILOGUE: the fc1 pre-activation z [M, 2n] ("swiglu": written; "swiglu_bwd": read)
    row_scale_ptr,  # "swiglu_bwd": fp32 [M], each row's routing weight
    act_out_ptr,  # "swiglu_bwd": [M, N], s * swiglu(z)
    ds_ptr,  # "swiglu_bwd": fp32 [cdiv(N, BLOCK_N), M], per column tile: sum over its columns of dh * h
    out_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    G_TOTAL: tl.constexpr,  # entries of group_sizes (G without a group offset)
    # The data strides are constexprs, as m_grouped_mm_kernel's (docs/design.md, 'Compiled-in sizes').
    stride_xm: tl.constexpr,
    stride_xk: tl.constexpr,
    stride_wg: tl.constexpr,
    stride_wn: tl.constexpr,
    stride_wk: tl.constexpr,
    stride_om: tl.constexpr,
    stride_on: tl.constexpr,
    stride_bg: tl.constexpr,
    stride_bn: tl.constexpr,
    stride_sxg,  # TENSOR: per group of group_sizes (G_TOTAL entries), or 0 (one scale)
    stride_sxm,  # ROW, BLOCK
    stride_sxk,  # BLOCK
    stride_swg,
    stride_swn,  # ROW, BLOCK
    stride_swk,  # BLOCK
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_G_TOTAL: tl.constexpr,
    HAS_GROUP_OFFSET: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    SCALING: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,  # 128
    IMPRECISE_ACC: tl.constexpr,  # max_num_imprecise_acc of tl.dot: None lets sm90 accumulate fast
    UPCAST: tl.constexpr,  # interpreter only: no FP8 tensor cores, so the operands go to fp32 (exact)
    GATHER: tl.constexpr = False,
    EPILOGUE: tl.constexpr = "",
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    (
        offs, starts, ends, m_tiles, tile_ends, total_tiles, first_row, local_end, head_tiles, zero_tiles,
        zero_per_tile,
    ) = m_grouped_tile_space(
        group_sizes_ptr, group_offset_ptr, G, G_TOTAL, M, n_tiles, NUM_PROGRAMS, BLOCK_M, BLOCK_G,
        BLOCK_G_TOTAL, HAS_GROUP_OFFSET,
    )  # fmt: skip
    if HAS_GROUP_OFFSET:
        first_group = clamped_group_offset(group_offset_ptr, G, G_TOTAL)  # of sx's per-group scales
    else:
        first_group = 0
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if WIDE_OFFSETS:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        offs_k = offs_k.to(tl.int64)
    for tile in range(pid, total_tiles, NUM_PROGRAMS):
        g, m_tile, n_tile, row0, row_end, _ = locate_row_tile(
            tile, offs, starts, ends, m_tiles, tile_ends, n_tiles, BLOCK_M, GROUP_M
        )
        row_mask = offs_m < row_end - row0
        col0 = n_tile * BLOCK_N
        col_mask = offs_n < N - col0
        g_w = tl.minimum(g, G - 1).to(tl.int64)  # the tail slot reads no weight or scale; keep it in bounds
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_steps = tl.where(g < G, tl.cdiv(K, BLOCK_K), 0)
        if GATHER:
            # 64-bit row offsets per tile row: x's rows by index (the expert block's token rows).
            src = tl.load(gather_ptr + row0 + offs_m, mask=row_mask, other=0).to(tl.int64)
            x_base = x_ptr
            x_offs = src[:, None] * stride_xm + offs_k[None, :] * stride_xk
        else:
            src = row0 + offs_m
            x_base = x_ptr + row0 * stride_xm
            x_offs = offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        if EPILOGUE == "swiglu":
            w_cols, col_mask = _swiglu_columns(col0, offs_n, N, BLOCK_N)  # w's rows: two runs (gate, up)
            w_base = w_ptr + g_w * stride_wg
            w_offs = w_cols[:, None] * stride_wn + offs_k[None, :] * stride_wk
        else:
            w_cols = col0 + offs_n
            w_base = w_ptr + g_w * stride_wg + col0.to(tl.int64) * stride_wn
            w_offs = offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
        if SCALING == 2:
            sx_base = sx_ptr + src * stride_sxm
            # The weight block of each output column (a BLOCK_N wider than 128 spans several).
            sw_base = sw_ptr + g_w * stride_swg + (w_cols // SCALE_BLOCK).to(tl.int64) * stride_swn
        for k in range(0, k_steps):
            k_mask = offs_k < K - k * BLOCK_K
            if EVEN_K:
                a = tl.load(x_base + (x_offs + k * BLOCK_K * stride_xk), mask=row_mask[:, None], other=0.0)
                b = tl.load(w_base + (w_offs + k * BLOCK_K * stride_wk), mask=col_mask[:, None], other=0.0)
            else:
                a = tl.load(
                    x_base + (x_offs + k * BLOCK_K * stride_xk),
                    mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_base + (w_offs + k * BLOCK_K * stride_wk),
                    mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
            b = tl.trans(b)  # [BLOCK_K, BLOCK_N], K-major in shared memory as wgmma wants
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if SCALING == 2:
                kb = (k * BLOCK_K) // SCALE_BLOCK
                sx = tl.load(sx_base + kb * stride_sxk, mask=row_mask, other=0.0)
                sw = tl.load(sw_base + kb * stride_swk, mask=col_mask, other=0.0)
                partial = tl.dot(a, b, max_num_imprecise_acc=IMPRECISE_ACC)
                acc += partial * sx[:, None] * sw[None, :]
            else:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        if SCALING == 0:
            sx_g = (first_group + g_w).to(tl.int64)
            acc *= tl.load(sx_ptr + sx_g * stride_sxg) * tl.load(sw_ptr + g_w * stride_swg)
        elif SCALING == 1:
            sx = tl.load(sx_ptr + src * stride_sxm, mask=row_mask, other=0.0)
            sw = tl.load(sw_ptr + g_w * stride_swg + w_cols * stride_swn, mask=col_mask, other=0.0)
            acc *= sx[:, None] * sw[None, :]
        if EPILOGUE == "swiglu":
            _swiglu_epilogue(
                acc, act_ptr, out_ptr, row0, row_end, col0, N, stride_om, stride_on, BLOCK_M, BLOCK_N
            )
        elif EPILOGUE == "swiglu_bwd":
            _swiglu_bwd_epilogue(
                acc, act_ptr, row_scale_ptr, act_out_ptr, ds_ptr, out_ptr, M, row0, row_end, col0, N, BLOCK_M,
                BLOCK_N,
            )  # fmt: skip
        else:
            if HAS_BIAS:
                bias_cols = tl.where(g < G, N - col0, 0)  # see m_grouped.py: the tail slot adds no bias
                bias_base = bias_ptr + g_w * stride_bg + col0.to(tl.int64) * stride_bn
                bias = tl.load(bias_base + offs_n * stride_bn, mask=offs_n < bias_cols, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            out_base = out_ptr + row0 * stride_om + col0.to(tl.int64) * stride_on
            out_offs = offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
            tl.store(
                out_base + out_offs,
                acc.to(out_ptr.dtype.element_ty),
                mask=row_mask[:, None] & col_mask[None, :],
            )
        if HAS_GROUP_OFFSET:
            zero_begin = tile * zero_per_tile
            store_zero_tiles(
                out_ptr, zero_begin, tl.minimum(zero_begin + zero_per_tile, zero_tiles), first_row, local_end,
                head_tiles, M, N, n_tiles, stride_om, stride_on, offs_m, offs_n, BLOCK_M, BLOCK_N,
            )  # fmt: skip
    if HAS_GROUP_OFFSET:  # zero tiles no GEMM tile took (all of them when no local group has rows)
        for z in range(total_tiles * zero_per_tile + pid, zero_tiles, NUM_PROGRAMS):
            store_zero_tiles(
                out_ptr, z, z + 1, first_row, local_end, head_tiles, M, N, n_tiles, stride_om, stride_on,
                offs_m, offs_n, BLOCK_M, BLOCK_N,
            )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MGroupedFp8Launch:
    """Grid and meta-parameters of one m_grouped_mm_fp8_kernel launch, from static shapes only."""

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
        has_bias: bool,
        fast_accum: bool,
        g_total: int | None = None,
        gather: bool = False,
        epilogue: str = "",
    ) -> MGroupedFp8Launch:
        """fast_accum: let the tensor cores accumulate a whole tile's K (sm90's default for FP8, like
        torch's use_fast_accum); otherwise partial sums are promoted to fp32 every BLOCK_K.
        g_total: expert parallelism, as MGroupedLaunch.make (None: no group offset). gather, epilogue: the
        expert block's options, as MGroupedLaunch.make's (no bias or group offset with an epilogue)."""
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        if recipe == "blockwise" and 128 % bk:
            raise ValueError(f"blockwise scaling needs BLOCK_K dividing 128, got {bk}")
        if epilogue not in ("", "swiglu", "swiglu_bwd"):
            raise ValueError(f"unknown epilogue {epilogue!r}")
        if epilogue and (has_bias or g_total is not None):
            raise ValueError(f"epilogue {epilogue!r} takes no bias or group offset")
        if epilogue == "swiglu" and (N % 2 or bn % 2):
            raise ValueError(f"the swiglu epilogue needs an even N and BLOCK_N, got N {N}, BLOCK_N {bn}")
        slots = G + 1 if g_total is None else G + 2  # the unowned rows: tail, and head with an offset
        max_tiles = (triton.cdiv(M, bm) + slots) * triton.cdiv(N, bn)
        num_programs = max(1, min(max_tiles, num_programs_cap * config.ctas_per_sm))
        meta = dict(
            NUM_PROGRAMS=num_programs,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            GROUP_M=config.group_m,
            BLOCK_G=max(16, triton.next_power_of_2(slots)),
            BLOCK_G_TOTAL=max(16, triton.next_power_of_2(G if g_total is None else g_total)),
            HAS_GROUP_OFFSET=g_total is not None,
            EVEN_K=K % bk == 0,
            HAS_BIAS=has_bias,
            WIDE_OFFSETS=2 * max(bm, bn, K + bk) * max_stride >= 2**31,
            SCALING=SCALINGS[recipe],
            SCALE_BLOCK=128,
            # Blockwise scales each step's fresh partial product anyway: nothing more to promote.
            IMPRECISE_ACC=None if fast_accum or interpret or recipe == "blockwise" else bk,
            UPCAST=interpret,
            GATHER=gather,
            EPILOGUE=epilogue,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        return MGroupedFp8Launch(grid=(num_programs,), meta=meta)
