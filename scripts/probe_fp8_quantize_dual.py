"""GPU probe (not wired into the library): a one-read blockwise FP8 quantize in Gluon, against the two
Triton launches the library runs (perf-notes 22). Kept as the starting point for when the toolchain allows it.

What it computes: an activation x [M, K] (bf16, device-side group sizes) -> data (1x128 scales along K) and
data_t (group-aligned 128x1 scales along tokens), the bytes ``quantize_fp8(x, "blockwise", group_sizes,
transpose=True)`` writes, from one read of x (4 bytes of HBM traffic an element instead of 6).

How: a program per (group-aligned 128-row tile, CHUNKS 128-column tiles); a cp.async ring of NUM_STAGES
128 x 128 tiles in shared memory, each thread copying the elements it later reads (no barrier between copy,
read and reuse); 16 warps hold the tile, both amax reductions cross warps; data_t is stored through an
in-register reorder (same elements in the same threads, registers ordered along tokens: 4-byte stores).

What was measured (H100/H200, 2026-11-25): with div.rn per element (FAST_DIV=False) the bytes equal the two
launches' and the twin's, at 0.72-1.04x their speed: two div.rn an element (each a MUFU, five FFMA and a
branch to a slow path) bound it (PROBE=1, a multiply instead, runs dsv3 in 0.55 ms against 0.88). With
FAST_DIV=True (RN(1/s) per row and column by div.rn, then a multiply and two FMA corrections, Markstein)
the bytes are right under CUDA 13.0's ptxas (TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas) and data_t is
wrong under the ptxas the triton 3.6.0 wheel bundles.

    python scripts/probe_fp8_quantize_dual.py [case ...]     # writes $OUT/quantize_dual_probe.json
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

from moegemm.kernels.gluon_hopper import cp, gl, gluon
from moegemm.kernels.quantize_fp8 import T_ALIGN, _cast, _scale
from moegemm.kernels.schedule import (
    aligned_group_offsets,
    clamped_group_bounds,
    locate_row_tile,
    pick,
    row_tile_space,
)

BLOCK = 128  # rows (one group-aligned 128x1 scale block) and columns (one 1x128 scale block) of a tile
NUM_WARPS = 16


def geometry(R: int, C: int, G: int, chunks: int, sms: int) -> tuple[int, tuple[int, int]]:
    """(CHUNKS, grid) of a launch over x [R, C] in G groups: a program per (row tile, CHUNKS column
    tiles), halved while that leaves under 4 programs per SM; every row tile any group sizes can
    produce (each group adds at most one partial tile, plus the tail slot's), the extra programs exit."""
    row_tiles, col_tiles = triton.cdiv(R, BLOCK) + G + 1, triton.cdiv(C, BLOCK)
    while chunks > 1 and row_tiles * triton.cdiv(col_tiles, chunks) < 4 * sms:
        chunks //= 2
    return chunks, (row_tiles, triton.cdiv(col_tiles, chunks))


@gluon.constexpr_function
def _tile_layout(variant, rows_first):
    """The 128 x 128 tile over 16 warps, 32 elements a thread. ``rows_first`` orders a thread's
    registers along rows (consecutive tokens of a column: one vector store into data_t); the same
    elements sit in the same threads, so converting between the two orders moves no data.

    variant 0: a thread holds 4 rows x 8 columns; lanes 4 along columns, 8 along rows; warps 4 along
    rows, 4 along columns (both reductions cross warps; 32-byte runs of data and of data_t).
    variant 1: a thread holds 8 rows x 4 columns; a warp's lanes span a whole 128-column row, warps
    are stacked along rows (the row reduction stays in the warp; 8-byte runs of data_t per warp)."""
    if variant == 0:
        cols, rows = [[0, 1], [0, 2], [0, 4]], [[1, 0], [2, 0]]
        lanes = [[0, 8], [0, 16], [4, 0], [8, 0], [16, 0]]
        warps = [[0, 32], [0, 64], [32, 0], [64, 0]]
    elif variant == 2:  # variant 0 over 8 warps: each thread's 4 x 8 block twice, 64 columns apart
        cols, rows = [[0, 1], [0, 2], [0, 4]], [[1, 0], [2, 0]]
        lanes = [[0, 8], [0, 16], [4, 0], [8, 0], [16, 0]]
        warps = [[0, 32], [32, 0], [64, 0]]
        return gl.DistributedLinearLayout(
            reg_bases=(rows + cols if rows_first else cols + rows) + [[0, 64]],
            lane_bases=lanes,
            warp_bases=warps,
            block_bases=[],
            shape=[128, 128],
        )
    else:
        cols, rows = [[0, 1], [0, 2]], [[1, 0], [2, 0], [4, 0]]
        lanes = [[0, 4], [0, 8], [0, 16], [0, 32], [0, 64]]
        warps = [[8, 0], [16, 0], [32, 0], [64, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=rows + cols if rows_first else cols + rows,
        lane_bases=lanes,
        warp_bases=warps,
        block_bases=[],
        shape=[128, 128],
    )


@gluon.jit
def _div(a, b, inv):
    """RN(a / b) for inv = RN(1 / b) and a normal quotient: a multiply and two FMA corrections (the
    first leaves the quotient within one ulp, the second rounds it correctly: Markstein's theorem),
    5 instructions and no branch instead of a div.rn sequence (MUFU, FCHK, 5 FFMA and a branch to a
    slow path, which keeps ptxas from interleaving divisions). The residual is formed as
    fma(y, b, -a) and negated in the correction, so that a = -0.0 gives -0.0."""
    y = a * inv
    y = gl.fma(-gl.fma(y, b, -a), inv, y)
    return gl.fma(-gl.fma(y, b, -a), inv, y)


@gluon.jit
def _scale_fast(amax, FP8_MAX: gl.constexpr):
    """``quantize_fp8._scale`` (amax / FP8_MAX, or 1 for a zero block) for amax = 0 or >= 2^-90."""
    return gl.where(amax > 0, _div(amax, FP8_MAX, 1.0 / FP8_MAX), 1.0)


@gluon.jit
def _min_nonzero(v):
    return gl.min(gl.where(v > 0, v, 1.0), 0)


@gluon.jit
def _copy_tile(bufs, step, x_base, n_tile, last, offs_c, load_mask, C, stride_xc):
    """cp.async of column tile ``n_tile`` into ring slot step % NUM_STAGES (nothing past ``last``: an
    empty group keeps the wait counts uniform). Each thread copies the elements it later reads, so
    no barrier is needed between the copy, the read and the slot's reuse."""
    col0 = (n_tile * 128).to(gl.int64)
    mask = load_mask[:, None] & (offs_c < gl.where(n_tile < last, C - col0, 0))[None, :]
    cp.async_copy_global_to_shared(
        bufs.index(step % bufs.shape[0]), x_base + (col0 + offs_c[None, :]) * stride_xc, mask=mask
    )
    cp.commit_group()


@gluon.jit
def fp8_quantize_1x128_dual_kernel(
    x_ptr,
    group_sizes_ptr,
    q_ptr,
    s_ptr,  # [R, cdiv(C, 128)] (any strides)
    qt_ptr,  # data_t [C, >= R + 16 G] as uint8; group g's columns from its T_ALIGN-aligned offset
    st_ptr,  # [group-aligned 128-row blocks, C]
    R,
    C,
    G,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_qc,
    stride_tc,
    stride_tr,
    stride_sr,
    stride_sc,
    stride_stb,
    stride_stc,
    CHUNKS: gl.constexpr,  # 128-wide column tiles per program
    BLOCK_G: gl.constexpr,
    FP8_MAX: gl.constexpr,
    WIDE_OFFSETS: gl.constexpr,  # int64 offsets inside a tile
    NUM_STAGES: gl.constexpr,  # tiles in the cp.async ring (32 KB each)
    LAYOUT: gl.constexpr = 0,  # _tile_layout's variant
    PROBE: gl.constexpr = 0,  # measurement only: 1 multiplies by 1/scale, 2 skips data_t, 3 skips data
    FAST_DIV: gl.constexpr = True,
):
    BLOCK_R: gl.constexpr = 128
    BLOCK_C: gl.constexpr = 128
    gl.static_assert(gl.num_warps() == (8 if LAYOUT == 2 else 16), "the tile layout's warps")
    layout: gl.constexpr = _tile_layout(LAYOUT, False)
    t_layout: gl.constexpr = _tile_layout(LAYOUT, True)
    sched: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    row_tile = gl.program_id(0)
    offs = gl.arange(0, BLOCK_G, layout=sched)
    starts, ends = clamped_group_bounds(group_sizes_ptr, offs, G, R)
    t_units = aligned_group_offsets(offs, starts, ends, G, T_ALIGN)
    starts, ends, m_tiles, tile_ends, total = row_tile_space(offs, starts, ends, G, R, 1, BLOCK_R)
    g, m_tile, _, row0, row_end, block_base = locate_row_tile(
        row_tile, offs, starts, ends, m_tiles, tile_ends, 1, BLOCK_R, 1
    )
    first = gl.program_id(1) * CHUNKS
    # Programs past the last row tile run no iteration.
    last = gl.where(row_tile < total, gl.minimum(first + CHUNKS, gl.cdiv(C, BLOCK_C)), first)
    rows = row_end - row0
    in_group = g < G  # the tail slot (g == G) reads nothing and writes zero rows, no data_t

    offs_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
    t_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, t_layout))
    t_c = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, t_layout))
    if WIDE_OFFSETS:
        offs_r = offs_r.to(gl.int64)
        offs_c = offs_c.to(gl.int64)
        t_r = t_r.to(gl.int64)
        t_c = t_c.to(gl.int64)
    row_mask = offs_r < rows
    load_mask = offs_r < gl.where(in_group, rows, 0)
    x_base = x_ptr + row0 * stride_xr + offs_r[:, None] * stride_xr
    q_base = q_ptr + row0 * stride_qr + offs_r[:, None] * stride_qr
    s_base = s_ptr + (row0 + offs_r) * stride_sr
    # Group g's rows go to its own columns of data_t, from a T_ALIGN-aligned offset, through the
    # group's 16-aligned end (zeros past the group: x loads as 0 there), which the wgrad reads.
    t_col0 = (m_tile * BLOCK_R).to(gl.int64) + pick(t_units, offs, g) * T_ALIGN
    t_base = qt_ptr + (t_col0 + t_r[:, None]) * stride_tr
    t_row_mask = t_r < gl.where(in_group, gl.cdiv(rows, T_ALIGN) * T_ALIGN, 0)
    st_base = st_ptr + (block_base + m_tile).to(gl.int64) * stride_stb

    bufs = gl.allocate_shared_memory(
        x_ptr.dtype.element_ty,
        [NUM_STAGES, BLOCK_R, BLOCK_C],
        gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]),
    )
    for i in gl.static_range(NUM_STAGES - 1):  # the ring's first tiles in flight
        _copy_tile(bufs, i, x_base, first + i, last, offs_c, load_mask, C, stride_xc)
    for n_tile in range(first, last):
        step = n_tile - first
        _copy_tile(
            bufs,
            step + NUM_STAGES - 1,
            x_base,
            n_tile + NUM_STAGES - 1,
            last,
            offs_c,
            load_mask,
            C,
            stride_xc,
        )
        cp.wait_group(NUM_STAGES - 1)  # this tile's copies (this thread's own) landed
        x = bufs.index(step % NUM_STAGES).load(layout).to(gl.float32)
        col0 = (n_tile * BLOCK_C).to(gl.int64)
        col_mask = offs_c < C - col0
        a = gl.abs(x)
        row_amax = gl.max(a, 1)  # 1x128 along C
        col_amax = gl.max(a, 0)  # 128x1 along R (group-aligned)
        if FAST_DIV:
            # Normal scales and reciprocals: every amax 0 or >= 2^-90 (else the div.rn path).
            fast = gl.minimum(_min_nonzero(row_amax), _min_nonzero(col_amax)) >= 2.0**-90
        else:
            fast = False
        if fast:
            row_scale = _scale_fast(row_amax, FP8_MAX)
            col_scale = _scale_fast(col_amax, FP8_MAX)
            q = _div(x, row_scale[:, None], gl.div_rn(1.0, row_scale)[:, None]).to(dtype)
            qt = _div(x, col_scale[None, :], gl.div_rn(1.0, col_scale)[None, :]).to(dtype)
        else:
            row_scale = _scale(row_amax, FP8_MAX)
            col_scale = _scale(col_amax, FP8_MAX)
            q = _cast(x, row_scale[:, None], FP8_MAX, dtype, False)
            qt = _cast(x, col_scale[None, :], FP8_MAX, dtype, False)
        gl.store(s_base + n_tile.to(gl.int64) * stride_sc, row_scale, mask=row_mask)
        gl.store(
            st_base + (col0 + offs_c) * stride_stc, col_scale, mask=offs_c < gl.where(in_group, C - col0, 0)
        )
        if PROBE != 3:
            gl.store(
                q_base + (col0 + offs_c[None, :]) * stride_qc, q, mask=row_mask[:, None] & col_mask[None, :]
            )
        # Registers reordered along tokens, in place: vector stores along data_t's rows.
        qt = gl.convert_layout(qt.to(gl.uint8, bitcast=True), t_layout)
        if PROBE != 2:
            gl.store(
                t_base + (col0 + t_c[None, :]) * stride_tc,
                qt,
                mask=t_row_mask[:, None] & (t_c < C - col0)[None, :],
            )
    cp.wait_group(0)


# ---------------------------------------------------------------- the probe

# (name, meta overrides): the division and the ring depth
VARIANTS = [
    ("div-s2", dict(FAST_DIV=False, NUM_STAGES=2)),
    ("div-s4", dict(FAST_DIV=False, NUM_STAGES=4)),
    ("fast-s2", dict(FAST_DIV=True, NUM_STAGES=2)),
]
PROBES = [("mul", dict(PROBE=1)), ("no-data_t", dict(PROBE=2)), ("no-data", dict(PROBE=3))]  # wrong bytes


def quantize_dual(x, gs, dtype, chunks=8, **meta):
    """(data, scale, data_t, scale_t) storage of one launch, laid out as the library's quantize_fp8 op."""
    from moegemm.torch import _ops_fp8

    M, K = x.shape
    G = gs.shape[0]
    shapes = _ops_fp8.storage_shapes((M, K), "blockwise", G, True)
    data_s, scale_s, data_t_s, scale_t_s = (
        torch.empty(s, dtype=t, device=x.device) for s, t in zip(shapes, (dtype, torch.float32) * 2)
    )
    q, s, qt, st = data_s[:, :K], scale_s.T, data_t_s.view(torch.uint8), scale_t_s
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    chunks, grid = geometry(M, K, G, chunks, sms)
    args = dict(CHUNKS=chunks, BLOCK_G=max(16, triton.next_power_of_2(G + 1)), WIDE_OFFSETS=False)
    args.update(FP8_MAX=448.0 if dtype == torch.float8_e4m3fn else 57344.0, NUM_STAGES=2, LAYOUT=0)
    args.update(PROBE=0, FAST_DIV=False, num_warps=NUM_WARPS)
    args.update(meta)
    fp8_quantize_1x128_dual_kernel[grid](
        x,
        gs,
        q,
        s,
        qt,
        st,
        M,
        K,
        G,
        *x.stride(),
        *q.stride(),
        *qt.stride(),
        *s.stride(),
        *st.stride(),
        **args,
    )
    return data_s, scale_s, data_t_s, scale_t_s


def used(parts, sizes):
    from moegemm import fp8

    data_s, scale_s, data_t_s, scale_t_s = parts
    cols = sum(fp8.cdiv(n, 16) * 16 for n in sizes)
    blocks = sum(fp8.cdiv(n, 128) for n in sizes)
    return dict(
        data=data_s.view(torch.uint8),
        scale=scale_s,
        data_t=data_t_s.view(torch.uint8)[:, :cols],
        scale_t=scale_t_s[:blocks],
    )


def main(names) -> int:
    from moegemm import shapes
    from moegemm.bench import roofline, timing
    from moegemm.torch import _ops_fp8

    rows, bad = [], 0
    for name in names:
        case = shapes.get(name)
        sizes = [int(n) for n in shapes.group_sizes(case.M, case.G, seed=0)]
        gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        x = torch.randn(case.M, case.K, device="cuda") * 2
        x.view(-1)[:: max(1, x.numel() // 5000)] *= 100  # outliers
        x[: case.M // 64, :16] = 0.0
        x[1, :] = -0.0
        x[2, :] *= 1e-30  # a tiny row amax
        x = x.to(torch.bfloat16)
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):

            def two_launches(x=x, gs=gs, dtype=dtype):
                return _ops_fp8.quantize(x, gs, "blockwise", dtype, True, gs.shape[0], "triton")

            ref = used(two_launches(), sizes)
            entry = dict(case=name, dtype=str(dtype), two_launch_ms=timing.device_ms(two_launches, x.device))
            for vname, meta in VARIANTS + PROBES:
                call = lambda x=x, gs=gs, dtype=dtype, meta=meta: quantize_dual(x, gs, dtype, **meta)  # noqa: E731
                if not vname.startswith(tuple(p[0] for p in PROBES)):
                    got = used(call(), sizes)
                    mism = {f: int((got[f] != ref[f]).sum()) for f in ref}
                    entry[f"mismatches_{vname}"] = mism
                    bad += sum(mism.values()) if vname.startswith("div") else 0
                entry[f"{vname}_ms"] = timing.device_ms(call, x.device)
            nbytes = 4 * case.M * case.K
            for k in [k for k in entry if k.endswith("_ms")]:
                entry[k[:-3] + "_pct"] = 100 * nbytes / (entry[k] / 1e3) / roofline.PEAK_BYTES_PER_S
            rows.append(entry)
            print(json.dumps(entry), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "quantize_dual_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return bad


if __name__ == "__main__":
    default = ["finegrain-e256-fc2", "dsv3-ep8-fc1", "qwen3-30b-fc1", "gptoss-120b-fc1", "mixtral-fc1"]
    sys.exit(1 if main(sys.argv[1:] or default) else 0)
