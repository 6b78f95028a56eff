"""GPU probe (perf-notes 28): the warp-specialized wgrad with a 4-slot ring, made room for by storing each consumer's
64 x 256 half tile as two 64 x 128 column halves through one 16 KB staging tile (two accumulators, two wgmma a
step), against the routed kernel (3 slots, a 32 KB staging tile per consumer). ncu put the routed kernel's consumers
waiting on data 24% of the time (perf-notes 28); a fourth slot is the lever, at the cost of one wait on a TMA
store's read per tile.

    OUT=/tmp/p python scripts/probe_wgrad_ws_split.py --cases gptoss-20b-fc2,...

Appends JSON lines to $OUT/wgrad_ws_split.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from moegemm import configs
from moegemm.kernels import k_grouped_ws as kws
from moegemm.kernels.gluon_hopper import (
    CONSUMER_WARPS,
    fence_async_shared,
    gl,
    gluon,
    release_slot,
    ring_barriers,
    tma,
    wait_slot_ready,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG = os.path.join(os.environ.get("OUT", "."), "wgrad_ws_split.jsonl")


@gluon.jit
def _consumer_split(
    out_desc, group_sizes_ptr, a_bufs, b_bufs, c_bufs, ready, empty, M, K: gl.constexpr, N: gl.constexpr,
    G: gl.constexpr, HALF: gl.constexpr, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_R: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr,
):  # fmt: skip
    SUB_K: gl.constexpr = BLOCK_K // 2
    SUB_N: gl.constexpr = BLOCK_N // 2
    NUM_STAGES: gl.constexpr = b_bufs.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, SUB_N, 16]
    )
    c_smem = c_bufs.index(HALF)
    offs, starts, ends = kws._bounds(group_sizes_ptr, G, M, BLOCK_G)
    total_tiles = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, k0, n0, row_start, row_end = kws._locate(tile, offs, starts, ends, K, N, BLOCK_K, BLOCK_N, GROUP_M)
        acc0 = gl.zeros([SUB_K, SUB_N], gl.float32, mma_layout)
        acc1 = gl.zeros([SUB_K, SUB_N], gl.float32, mma_layout)
        for r in range(gl.maximum(gl.cdiv(row_end - row_start, BLOCK_R), 1)):
            slot = wait_slot_ready(ready, step, False)
            a = a_bufs.index(2 * slot + HALF).permute((1, 0))
            b = b_bufs.index(slot)
            acc0 = warpgroup_mma(a, b.slice(0, SUB_N, dim=1), acc0, is_async=True)
            acc1 = warpgroup_mma(a, b.slice(SUB_N, SUB_N, dim=1), acc1, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(2, deps=[acc0, acc1])
            if r > 0:
                release_slot(empty, (step + NUM_STAGES - 1) % NUM_STAGES)
            step += 1
        acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
        release_slot(empty, (step + NUM_STAGES - 1) % NUM_STAGES)
        row_out = k0 + HALF * SUB_K
        if row_out < K:
            tma.store_wait(0)
            c_smem.store(acc0.to(c_smem.dtype))
            fence_async_shared()
            kws.tma_store(out_desc, [g * K + row_out, n0], c_smem)
            tma.store_wait(0)  # the first half's copy has read the staging tile
            c_smem.store(acc1.to(c_smem.dtype))
            fence_async_shared()
            kws.tma_store(out_desc, [g * K + row_out, n0 + SUB_N], c_smem)
    tma.store_wait(0)


@gluon.jit
def k_grouped_mm_ws_split_kernel(
    out_desc, a_ptr, b_ptr, group_sizes_ptr, M, K: gl.constexpr, N: gl.constexpr, G: gl.constexpr, stride_am,
    stride_bm, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr,
    GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):  # fmt: skip
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
    c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, HALF_K, BLOCK_N // 2], out_desc.layout)
    ready, empty = ring_barriers(NUM_STAGES, True)
    # fmt: off
    gl.warp_specialize(
        [
            (kws._loader, (
                a_ptr, b_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, K, N, G, stride_am, stride_bm,
                NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G,
            )),
            (_consumer_split, (
                out_desc, group_sizes_ptr, a_bufs, b_bufs, c_bufs, ready, empty, M, K, N, G, 0, NUM_PROGRAMS,
                BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G,
            )),
            (_consumer_split, (
                out_desc, group_sizes_ptr, a_bufs, b_bufs, c_bufs, ready, empty, M, K, N, G, 1, NUM_PROGRAMS,
                BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G,
            )),
        ],
        [CONSUMER_WARPS, CONSUMER_WARPS],
        [CONSUMER_REGS, CONSUMER_REGS],
    )
    # fmt: on


def meta(M, Nb, Ka, G, stages):
    import dataclasses

    config = dataclasses.replace(configs.candidates("k_grouped_ws", "sm90")[0], num_stages=stages)
    return config, kws.KGroupedWsLaunch.make(M, Nb, Ka, G, config=config, num_programs_cap=132)


def launch(a, b, group_sizes, out, stages: int = 4) -> None:
    from moegemm.kernels.gluon_hopper import TensorDescriptor
    from moegemm.torch._launch import _ensure_allocator

    M, Ka = a.shape
    Nb = b.shape[1]
    G = out.shape[0]
    config, run = meta(M, Nb, Ka, G, stages)
    _ensure_allocator()
    block = [kws.BLOCK_K // 2, config.block_n // 2]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    out_desc = TensorDescriptor(out.view(G * Ka, Nb), [G * Ka, Nb], [Nb, 1], block, layout)
    k_grouped_mm_ws_split_kernel[run.grid](
        out_desc, a, b, group_sizes, M, Ka, Nb, G, a.stride(0), b.stride(0), **run.meta
    )


def compile_only() -> None:
    import torch

    from moegemm.testing import sm90

    config, run = meta(16384, 2880, 2880, 32, 4)
    x = torch.empty(16, 16, dtype=torch.bfloat16)
    pointers = {
        "out_desc": sm90._desc(x, [64, 128]),
        "a_ptr": "*bf16",
        "b_ptr": "*bf16",
        "group_sizes_ptr": "*i32",
    }
    c = sm90.compile_source(
        k_grouped_mm_ws_split_kernel, {**run.meta, "K": 2880, "N": 2880, "G": 32}, pointers
    )
    print(json.dumps({"shared": c.metadata.shared, "spill_bytes": sm90._spills(c.asm["ptx"])}))


def record(**kw) -> None:
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    print(json.dumps(kw), flush=True)
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--cases", default="gptoss-20b-fc2,kimi-k2-ep8-fc1")
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args()
    if args.compile_only:
        compile_only()
        return 0
    import torch
    from probe_m_tma_load import paired_ms
    from probe_wgrad_ws_tma import check_edges
    from probe_wgrad_ws_tma import launch as launch3

    from moegemm import shapes

    for row in check_edges(launch):
        record(**row)
    for case in shapes.select(args.cases.split(",")):
        sizes = shapes.group_sizes(case.M, case.G)
        gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        offs = gs.cumsum(0).to(torch.int32)
        x = torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(case.M, case.N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(case.G, case.N, case.K, device="cuda", dtype=torch.bfloat16)
        peer = functools.partial(torch._grouped_mm, dy.T, x, offs=offs, out_dtype=torch.bfloat16)
        want = peer()
        row = dict(case=case.name, op="wgrad", G=case.G, M=case.M, K=case.K, N=case.N)
        fns = {
            "torch": (lambda: None, peer),
            "ws3": (lambda: None, functools.partial(launch3, dy, x, gs, out)),
        }
        for stages in (4,):
            fn = functools.partial(launch, dy, x, gs, out, stages=stages)
            out.fill_(float("nan"))
            fn()
            err = ((out.double() - want.double()).norm() / want.double().norm()).item()
            row[f"split{stages}_relerr"] = err
            if err < 1e-2:
                fns[f"split{stages}"] = (lambda: None, fn)
        for name, ms in paired_ms(fns, args.reps).items():
            row[f"{name}_ms"] = ms
            if name != "torch":
                row[f"{name}_vs_torch"] = row["torch_ms"] / ms
        record(**row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
