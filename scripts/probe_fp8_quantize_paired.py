"""GPU probe (experiment, not wired in): the blockwise activation quantize as ONE launch in which the
data program and the transposed-copy program of each 128-row tile are neighbours (program 2i: data,
2i + 1: data_t), so the second read of x should come from L2 instead of HBM.

Checks, with outputs poisoned, that data, scale, data_t (the columns a wgrad reads) and scale_t (the
groups' blocks) equal ``quantize_fp8``'s bytes (the two-launch kernels), on odd widths and on suite
shapes: one kernel holding both stores is what ptxas 12.9 miscompiled (perf-notes 14). Then times
both by CUPTI device time. Writes $OUT/quantize_paired.json.
"""

import json
import os

import torch
import triton
import triton.language as tl

from moegemm import fp8, shapes
from moegemm.bench import timing
from moegemm.kernels.quantize_fp8 import _cast, _scale
from moegemm.kernels.schedule import (
    aligned_group_offsets,
    group_row_bounds,
    locate_row_tile,
    pick,
    row_tile_space,
)
from moegemm.torch.fp8 import quantize_fp8

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


@triton.jit
def paired_1x128_kernel(
    x_ptr, gs_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, R, C, G,
    stride_xr, stride_qr, stride_sr, stride_sc, stride_tc, stride_stb, stride_stc,
    Q_ROWS: tl.constexpr, T_COLS: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_G: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
):  # fmt: skip
    row_tile = tl.program_id(0) // 2
    offs, starts, ends = group_row_bounds(gs_ptr, G, R, BLOCK_G)
    t_units = aligned_group_offsets(offs, starts, ends, G, 16)
    starts, ends, m_tiles, tile_ends, total = row_tile_space(offs, starts, ends, G, R, 1, 128)
    g, m_tile, _, row0, row_end, block_base = locate_row_tile(
        row_tile, offs, starts, ends, m_tiles, tile_ends, 1, 128, 1
    )
    rows = row_end - row0
    load_rows = tl.where(g < G, rows, 0)
    first = tl.program_id(1) * CHUNKS
    last = tl.where(row_tile < total, tl.minimum(first + CHUNKS, tl.cdiv(C, 128)), first)
    dtype = q_ptr.dtype.element_ty
    if tl.program_id(0) % 2 == 0:  # data and its 1x128 scales
        offs_r = tl.arange(0, Q_ROWS)
        offs_c = tl.arange(0, 128)
        for c in range(0, last - first):
            n_tile = first + c
            col0 = (n_tile * 128).to(tl.int64)
            col_mask = offs_c < C - col0
            for j in tl.static_range(128 // Q_ROWS):
                r0 = row0 + j * Q_ROWS
                x = tl.load(
                    x_ptr + (r0 + offs_r[:, None]) * stride_xr + col0 + offs_c[None, :],
                    mask=(offs_r < load_rows - j * Q_ROWS)[:, None] & col_mask[None, :],
                    other=0.0,
                ).to(tl.float32)
                row_scale = _scale(tl.max(tl.abs(x), 1), 448.0)
                q = _cast(x, row_scale[:, None], 448.0, dtype, EMULATE_CAST)
                row_mask = offs_r < rows - j * Q_ROWS
                tl.store(
                    s_ptr + (r0 + offs_r) * stride_sr + n_tile.to(tl.int64) * stride_sc,
                    row_scale,
                    mask=row_mask,
                )
                tl.store(
                    q_ptr + (r0 + offs_r[:, None]) * stride_qr + col0 + offs_c[None, :],
                    q,
                    mask=row_mask[:, None] & col_mask[None, :],
                )
    else:  # the transposed copy and its group-aligned 128x1 scales
        t_offs_r = tl.arange(0, 128)
        t_offs_c = tl.arange(0, T_COLS)
        qt_col0 = (m_tile * 128).to(tl.int64) + pick(t_units, offs, g) * 16
        t_row_mask = t_offs_r < tl.where(g < G, tl.cdiv(rows, 16) * 16, 0)
        for tc in range(0, last - first):
            for k in tl.static_range(128 // T_COLS):
                t_c0 = ((first + tc) * 128 + k * T_COLS).to(tl.int64)
                t_col_mask = t_offs_c < C - t_c0
                tx = tl.load(
                    x_ptr + (row0 + t_offs_r[:, None]) * stride_xr + t_c0 + t_offs_c[None, :],
                    mask=(t_offs_r < load_rows)[:, None] & t_col_mask[None, :],
                    other=0.0,
                ).to(tl.float32)
                t_scale = _scale(tl.max(tl.abs(tx), 0), 448.0)
                tq = _cast(tx, t_scale[None, :], 448.0, dtype, EMULATE_CAST)
                tl.store(
                    st_ptr + (block_base + m_tile).to(tl.int64) * stride_stb + (t_c0 + t_offs_c) * stride_stc,
                    t_scale,
                    mask=t_offs_c < tl.where(g < G, C - t_c0, 0),
                )
                tl.store(
                    qt_ptr + (qt_col0 + t_offs_r[None, :]) + (t_c0 + t_offs_c[:, None]) * stride_tc,
                    tl.trans(tq.to(tl.uint8, bitcast=True)),
                    mask=t_col_mask[:, None] & t_row_mask[None, :],
                )


def paired(x, gs, like, chunks=2):
    R, C = x.shape
    G = gs.numel()
    q, s, qt, st = (torch.empty_like(t) for t in like)
    for t in (q, qt):
        t.view(torch.uint8).fill_(0x7F)  # NaN in e4m3: poison
    for t in (s, st):
        t.fill_(float("nan"))
    qt8 = qt.view(torch.uint8)
    grid = (2 * (triton.cdiv(R, 128) + G + 1), triton.cdiv(triton.cdiv(C, 128), chunks))

    def run():
        paired_1x128_kernel[grid](
            x, gs, q, s, qt8, st, R, C, G,
            x.stride(0), q.stride(0), s.stride(0), s.stride(1), qt.stride(0), st.stride(0), st.stride(1),
            Q_ROWS=32, T_COLS=32, CHUNKS=chunks, BLOCK_G=max(16, triton.next_power_of_2(G + 1)), EMULATE_CAST=INTERPRET, num_warps=4,
        )  # fmt: skip

    run()
    return (q, s, qt, st), run


def main() -> None:
    rows, bad = [], 0
    checks = [("odd", 300, C, 6) for C in (40, 128, 200, 256, 1000)]
    checks += [] if INTERPRET else [(n, shapes.get(n).M, shapes.get(n).K, shapes.get(n).G) for n in ("dsv3-ep8-fc1", "qwen3-30b-fc1", "mixtral-fc1", "gptoss-120b-fc1", "finegrain-e256-fc2")]  # fmt: skip
    for name, M, K, G in checks:
        sizes = (
            shapes.group_sizes(M, G, seed=K, empty=min(2, G - 1))
            if name == "odd"
            else shapes.group_sizes(M, G, seed=0)
        )
        gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
        x = (torch.randn(M, K, device=DEVICE) * 3).to(torch.bfloat16)
        ref = quantize_fp8(x, "blockwise", group_sizes=gs, transpose=True)
        like = (ref.data, ref.scale, ref.data_t, ref.scale_t)
        got, run = paired(x, gs, like)
        used_t = sum(fp8.cdiv(int(v), 16) * 16 for v in sizes)
        used_st = sum(fp8.cdiv(int(v), 128) for v in sizes)
        mism = {
            "data": int((got[0].view(torch.uint8) != ref.data.view(torch.uint8)).sum()),
            "scale": int((got[1] != ref.scale).sum()),
            "data_t": int(
                (got[2].view(torch.uint8)[:, :used_t] != ref.data_t.view(torch.uint8)[:, :used_t]).sum()
            ),
            "scale_t": int((got[3][:used_st] != ref.scale_t[:used_st]).sum()),
        }
        bad += sum(mism.values())
        row = dict(case=name, M=M, K=K, G=G, mismatches=mism)
        if name != "odd" and not INTERPRET:
            row["two_launch_ms"] = timing.device_ms(
                lambda x=x, gs=gs: quantize_fp8(x, "blockwise", group_sizes=gs, transpose=True), x.device
            )
            row["paired_ms"] = timing.device_ms(run, x.device)
        rows.append(row)
        print(row)
    print("mismatches:", bad)
    with open(os.path.join(os.environ.get("OUT", "."), "quantize_paired.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
