"""Experiment (perf-notes 28): a warp-specialized BF16 wgrad in Gluon with a TMA loader and a TMA-store epilogue,
against the launcher's pick and torch._grouped_mm.

Why: the Triton kernel's wgrad of mid-size groups keeps the tensor pipe ~61% busy because one warp stream issues
each step's copies, their address and mask work, and the wgmma (perf-notes 27). Here a loader warpgroup makes a
TMA descriptor pair per group on the device (a [rows_end, Ka] and b [rows_end, Nb], so the copy engine zero-fills
rows past the group's end) and issues three bulk copies a step; two consumer warpgroups each own 64 of the tile's
128 out rows and only wait, wgmma and release; a finished half tile leaves through shared memory and a TMA store.
Entry 23's cooperative kernel (cp.async loader, register epilogue) lost everywhere.

    OUT=/tmp/p python scripts/probe_wgrad_ws_tma.py --compile-only        # sm_90a compile, no GPU
    OUT=/tmp/p python scripts/probe_wgrad_ws_tma.py --cases gptoss-20b-fc2,... [--stages 3]

Semantics: out[g] = a[rows(g)]^T @ b[rows(g)], a [M, Ka] (dy), b [M, Nb] (x), out [G, Ka, Nb] bf16, an empty group
writes zeros. Takes Ka % 64 == 0 (a half tile's rows are all in out[g] or all past it), 16-byte aligned rows.
Appends JSON lines to $OUT/wgrad_ws_tma.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import triton

from moegemm.kernels.gluon_hopper import (
    CONSUMER_WARPS,
    LOADER_WARPS,
    MAXNREG,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    release_slot,
    ring_barriers,
    sched_layout,
    tma,
    tma_load,
    wait_slot_free,
    wait_slot_ready,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from moegemm.kernels.schedule import clamped_group_bounds, pick, swizzle_tile

# triton 3.9 renamed tma.async_copy_shared_to_global to tma.async_store (as it did the loads).
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
LOG = os.path.join(os.environ.get("OUT", "."), "wgrad_ws_tma.jsonl")
BLOCK_K, BLOCK_N, BLOCK_R = 128, 256, 64


@gluon.jit
def _bounds(group_sizes_ptr, G, M, BLOCK_G: gl.constexpr):
    offs = gl.arange(0, BLOCK_G, layout=sched_layout(gl.num_warps()))
    starts, ends = clamped_group_bounds(group_sizes_ptr, offs, G, M)
    return offs, starts.to(gl.int32), ends.to(gl.int32)


@gluon.jit
def _locate(tile, offs, starts, ends, K: gl.constexpr, N: gl.constexpr, BLOCK_K: gl.constexpr,
            BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """Tile -> (g, k0, n0, row_start, row_end), a group's tiles consecutive."""
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
    HALF_K: gl.constexpr = BLOCK_K // 2
    STEP_BYTES: gl.constexpr = BLOCK_R * (BLOCK_K + BLOCK_N) * 2
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, HALF_K], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], gl.bfloat16)
    offs, starts, ends = _bounds(group_sizes_ptr, G, M, BLOCK_G)
    total_tiles = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
    step = 0
    desc_g = -1
    a_desc = tma.make_tensor_descriptor(a_ptr, [1, K], [stride_am, 1], [BLOCK_R, HALF_K], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [1, N], [stride_bm, 1], [BLOCK_R, BLOCK_N], b_layout)
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, k0, n0, row_start, row_end = _locate(tile, offs, starts, ends, K, N, BLOCK_K, BLOCK_N, GROUP_M)
        # Descriptors end at the group's last row (the copy engine zero-fills past it); an empty group's one
        # step starts at the extent, so it reads only zeros (extents must be nonzero).
        extent = gl.maximum(row_end, 1)
        if g != desc_g:
            desc_g = g
            a_desc = tma.make_tensor_descriptor(
                a_ptr, [extent, K], [stride_am, 1], [BLOCK_R, HALF_K], a_layout
            )
            b_desc = tma.make_tensor_descriptor(
                b_ptr, [extent, N], [stride_bm, 1], [BLOCK_R, BLOCK_N], b_layout
            )
        row0 = gl.where(row_end > row_start, row_start, extent)
        for r in range(gl.maximum(gl.cdiv(row_end - row_start, BLOCK_R), 1)):
            slot = wait_slot_free(empty, step)
            bar = ready.index(slot)
            mbarrier.expect(bar, STEP_BYTES)
            row = row0 + r * BLOCK_R
            tma_load(a_desc, [row, k0], bar, a_bufs.index(2 * slot))
            tma_load(a_desc, [row, k0 + HALF_K], bar, a_bufs.index(2 * slot + 1))
            tma_load(b_desc, [row, n0], bar, b_bufs.index(slot))
            step += 1


@gluon.jit
def _consumer(
    out_desc, group_sizes_ptr, a_bufs, b_bufs, c_bufs, ready, empty, M, K: gl.constexpr, N: gl.constexpr,
    G: gl.constexpr, HALF: gl.constexpr, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_R: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr,
):  # fmt: skip
    """Out rows [k0 + HALF * 64, k0 + HALF * 64 + 64) of every tile."""
    SUB_K: gl.constexpr = BLOCK_K // 2
    NUM_STAGES: gl.constexpr = b_bufs.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 16]
    )
    c_smem = c_bufs.index(HALF)
    offs, starts, ends = _bounds(group_sizes_ptr, G, M, BLOCK_G)
    total_tiles = G * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
    step = 0
    for tile in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
        g, k0, n0, row_start, row_end = _locate(tile, offs, starts, ends, K, N, BLOCK_K, BLOCK_N, GROUP_M)
        acc = gl.zeros([SUB_K, BLOCK_N], gl.float32, mma_layout)
        n_steps = gl.maximum(gl.cdiv(row_end - row_start, BLOCK_R), 1)
        for r in range(n_steps):
            slot = wait_slot_ready(ready, step, False)  # TMA writes through the async proxy wgmma reads
            a = a_bufs.index(2 * slot + HALF).permute((1, 0))  # [SUB_K, BLOCK_R], read transposed
            acc = warpgroup_mma(a, b_bufs.index(slot), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            if r > 0:
                release_slot(empty, (step + NUM_STAGES - 1) % NUM_STAGES)
            step += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        release_slot(empty, (step + NUM_STAGES - 1) % NUM_STAGES)
        row_out = k0 + HALF * SUB_K
        if row_out < K:  # K % 64 == 0: this half's rows are all in out[g]
            tma.store_wait(0)  # the previous tile's store has read the staging tile
            c_smem.store(acc.to(gl.bfloat16))
            fence_async_shared()
            tma_store(out_desc, [g * K + row_out, n0], c_smem)
    tma.store_wait(0)


@gluon.jit
def k_grouped_mm_ws_tma_kernel(
    a_ptr, b_ptr, group_sizes_ptr, out_desc, M, K: gl.constexpr, N: gl.constexpr, G: gl.constexpr, stride_am,
    stride_bm, NUM_PROGRAMS: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr,
    GROUP_M: gl.constexpr, BLOCK_G: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):  # fmt: skip
    gl.static_assert(BLOCK_K == 128, "two consumer warpgroups of 64 out rows")
    HALF_K: gl.constexpr = BLOCK_K // 2
    a_bufs = gl.allocate_shared_memory(
        gl.bfloat16,
        [2 * NUM_STAGES, BLOCK_R, HALF_K],
        gl.NVMMASharedLayout.get_default_for([BLOCK_R, HALF_K], gl.bfloat16),
    )
    b_bufs = gl.allocate_shared_memory(
        gl.bfloat16,
        [NUM_STAGES, BLOCK_R, BLOCK_N],
        gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], gl.bfloat16),
    )
    c_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_K, BLOCK_N], out_desc.layout)
    ready, empty = ring_barriers(NUM_STAGES, True)
    # fmt: off
    gl.warp_specialize(
        [
            (_loader, (
                a_ptr, b_ptr, group_sizes_ptr, a_bufs, b_bufs, ready, empty, M, K, N, G, stride_am, stride_bm,
                NUM_PROGRAMS, BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G,
            )),
            (_consumer, (
                out_desc, group_sizes_ptr, a_bufs, b_bufs, c_bufs, ready, empty, M, K, N, G, 0, NUM_PROGRAMS,
                BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G,
            )),
            (_consumer, (
                out_desc, group_sizes_ptr, a_bufs, b_bufs, c_bufs, ready, empty, M, K, N, G, 1, NUM_PROGRAMS,
                BLOCK_K, BLOCK_N, BLOCK_R, GROUP_M, BLOCK_G,
            )),
        ],
        [CONSUMER_WARPS, CONSUMER_WARPS],
        [CONSUMER_REGS, CONSUMER_REGS],
    )
    # fmt: on


def meta(
    M: int, Ka: int, Nb: int, G: int, stages: int = 3, group_m: int = 8, regs: int = 232, programs: int = 132
):
    tiles = G * triton.cdiv(Ka, BLOCK_K) * triton.cdiv(Nb, BLOCK_N)
    return dict(
        NUM_PROGRAMS=max(1, min(tiles, programs)),
        BLOCK_K=BLOCK_K,
        BLOCK_N=BLOCK_N,
        BLOCK_R=BLOCK_R,
        GROUP_M=group_m,
        BLOCK_G=max(16, triton.next_power_of_2(G)),
        NUM_STAGES=stages,
        CONSUMER_REGS=regs,
        num_warps=LOADER_WARPS,
        maxnreg=MAXNREG,
    )


def out_layout():
    return gl.NVMMASharedLayout.get_default_for([BLOCK_K // 2, BLOCK_N], gl.bfloat16)


def launch(a, b, group_sizes, out, **kw) -> None:
    """out [G, Ka, Nb] = for g: a[rows(g)]^T @ b[rows(g)] (bf16, contiguous, Ka % 64 == 0)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from moegemm.torch._launch import _ensure_allocator

    M, Ka = a.shape
    Nb = b.shape[1]
    G = out.shape[0]
    assert Ka % 64 == 0 and Nb % 8 == 0 and a.stride(1) == 1 and b.stride(1) == 1 and out.is_contiguous()
    _ensure_allocator()  # the loader's device-side descriptors live in Triton's global scratch
    out_desc = TensorDescriptor(
        out.view(G * Ka, Nb), [G * Ka, Nb], [Nb, 1], [BLOCK_K // 2, BLOCK_N], out_layout()
    )
    m = meta(M, Ka, Nb, G, **kw)
    k_grouped_mm_ws_tma_kernel[(m["NUM_PROGRAMS"],)](
        a, b, group_sizes, out_desc, M, Ka, Nb, G, a.stride(0), b.stride(0), **m
    )


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from moegemm.testing.sm90 import _desc, _spills

    G, M, Ka, Nb = 32, 16384, 2880, 2880
    import torch

    m = meta(M, Ka, Nb, G)
    t = torch.empty(16, 16, dtype=torch.bfloat16)
    pointers = {
        "a_ptr": "*bf16",
        "b_ptr": "*bf16",
        "group_sizes_ptr": "*i32",
        "out_desc": _desc(t, [BLOCK_K // 2, BLOCK_N]),
    }
    values = dict(K=Ka, N=Nb, G=G)
    fn = k_grouped_mm_ws_tma_kernel
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        if param.name in pointers:
            signature[param.name] = pointers[param.name]
            if pointers[param.name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif param.name in m:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = m[param.name]
        elif param.name in values:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = values[param.name]
        else:
            signature[param.name] = "i32"
            if param.name != "M":
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: m[k] for k in ("num_warps", "maxnreg")}
    compiled = triton.compile(
        GluonASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=options
    )
    print(json.dumps({"shared": compiled.metadata.shared, "spill_bytes": _spills(compiled.asm["ptx"])}))


def record(**kw) -> None:
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    print(json.dumps(kw), flush=True)
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--cases", default="gptoss-20b-fc2,kimi-k2-ep8-fc1")
    p.add_argument("--stages", default="3")
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args()
    if args.compile_only:
        compile_only()
        return 0
    import torch

    from moegemm import shapes
    from moegemm.torch import _launch
    from probe_m_tma_load import paired_ms

    # Edge cases first: empty groups, a group of 1 row, groups ending inside a step, one hot expert, K tail.
    edge = [
        ("edge-empty-tail", 1000, 256, 384, [0, 1, 63, 65, 0, 300, 571, 0]),
        ("edge-one-hot", 777, 192, 136, [0, 777, 0]),
    ]
    for name, M, Ka, Nb, sizes in edge:
        gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        a = torch.randn(M, Ka, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(M, Nb, device="cuda", dtype=torch.bfloat16)
        out = torch.full((len(sizes), Ka, Nb), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch(a, b, gs, out)
        ref = torch.zeros(len(sizes), Ka, Nb, device="cuda", dtype=torch.float64)
        start = 0
        for g, s in enumerate(sizes):
            ref[g] = a[start : start + s].double().T @ b[start : start + s].double()
            start += s
        err = ((out.double() - ref).norm() / ref.norm()).item()
        record(
            case=name,
            relerr=err,
            nan=int(out.isnan().sum()),
            zeros_ok=bool((out[[g for g, s in enumerate(sizes) if s == 0]] == 0).all()),
        )
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
            "pick": (lambda: None, functools.partial(_launch.launch_k_grouped, dy, x, gs, out, False)),
        }
        for stages in map(int, args.stages.split(",")):
            fn = functools.partial(launch, dy, x, gs, out, stages=stages)
            try:
                out.fill_(float("nan"))
                fn()
                err = ((out.double() - want.double()).norm() / want.double().norm()).item()
                row[f"ws{stages}_relerr"] = err
                if err < 1e-2:
                    fns[f"ws{stages}"] = (lambda: None, fn)
                else:
                    row[f"ws{stages}_error"] = "relerr above 1e-2"
            except Exception as e:
                row[f"ws{stages}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        for name, ms in paired_ms(fns, args.reps).items():
            row[f"{name}_ms"] = ms
            if name != "torch":
                row[f"{name}_vs_torch"] = row["torch_ms"] / ms
        record(**row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
