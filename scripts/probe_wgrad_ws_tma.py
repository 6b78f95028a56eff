"""GPU probe (perf-notes 28): the warp-specialized BF16 wgrad (``moegemm.kernels.k_grouped_ws``: TMA loader with
per-group device descriptors, TMA-store epilogue) launched directly, whatever the routing rule says, against the
launcher's pick and torch._grouped_mm, paired timing; edge cases checked first against an fp64 sum.

    OUT=/tmp/p python scripts/probe_wgrad_ws_tma.py --cases suite,heldout [--stages 2,3]

(The first run had the kernel in this file; it moved to src unchanged but for the order of its arguments.)
Appends JSON lines to $OUT/wgrad_ws_tma.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

from moegemm import configs
from moegemm.kernels import k_grouped_ws

LOG = os.path.join(os.environ.get("OUT", "."), "wgrad_ws_tma.jsonl")


def launch(a, b, group_sizes, out, stages: int = 3, rows: int = 64, module=k_grouped_ws, **changes) -> None:
    """out [G, Ka, Nb] = for g: a[rows(g)]^T @ b[rows(g)] (2-byte, contiguous, Ka % 64 == 0) on the kernel
    (``module``: the src one, or an earlier version of its file to compare against)."""
    from moegemm.kernels.gluon_hopper import TensorDescriptor, gl
    from moegemm.torch._launch import _ensure_allocator

    M, Ka = a.shape
    Nb = b.shape[1]
    G = out.shape[0]
    config = dataclasses.replace(
        configs.candidates("k_grouped_ws", "sm90")[0], num_stages=stages, block_k=rows, **changes
    )
    run = module.KGroupedWsLaunch.make(M, Nb, Ka, G, config=config, num_programs_cap=132)
    _ensure_allocator()
    kernel = module.k_grouped_mm_ws_kernel
    if kernel.arg_names[0] == "out_desc":  # before perf-notes 33: out's descriptor made on the host
        block = [module.BLOCK_K // 2, config.block_n]
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        out_desc = TensorDescriptor(out.view(G * Ka, Nb), [G * Ka, Nb], [Nb, 1], block, layout)
        kernel[run.grid](out_desc, a, b, group_sizes, M, Ka, Nb, G, a.stride(0), b.stride(0), **run.meta)
    else:
        kernel[run.grid](a, b, group_sizes, out, M, Ka, Nb, G, a.stride(0), b.stride(0), **run.meta)


EDGES = (  # empty groups, a group of 1 row, groups ending inside a step, one hot expert, a half tile past K
    ("edge-empty-tail", 1000, 256, 384, [0, 1, 63, 65, 0, 300, 571, 0]),
    ("edge-one-hot", 777, 192, 136, [0, 777, 0]),
    ("edge-narrow-n", 900, 320, 72, [500, 0, 400]),  # every column tile narrow (72 of 256 columns)
    ("edge-n-tail-64", 700, 128, 320, [64, 636]),  # a 64-column last tile
)


def check_edges(launch_fn) -> list[dict]:
    """``launch_fn(a, b, group_sizes, out)`` on the EDGES problems (NaN-poisoned out) against an fp64 sum:
    relative error, NaNs left, whether empty groups came out as exact zeros."""
    import torch

    rows = []
    for name, M, Ka, Nb, sizes in EDGES:
        gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        a = torch.randn(M, Ka, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(M, Nb, device="cuda", dtype=torch.bfloat16)
        out = torch.full((len(sizes), Ka, Nb), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch_fn(a, b, gs, out)
        ref = torch.zeros(len(sizes), Ka, Nb, device="cuda", dtype=torch.float64)
        start = 0
        for g, s in enumerate(sizes):
            ref[g] = a[start : start + s].double().T @ b[start : start + s].double()
            start += s
        rows.append(
            dict(
                case=name,
                relerr=((out.double() - ref).norm() / ref.norm()).item(),
                nan=int(out.isnan().sum()),
                zeros_ok=bool((out[[g for g, s in enumerate(sizes) if s == 0]] == 0).all()),
            )
        )
    return rows


def record(**kw) -> None:
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    print(json.dumps(kw), flush=True)
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="gptoss-20b-fc2,kimi-k2-ep8-fc1")
    p.add_argument("--stages", default="3")
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args()
    import torch
    from probe_m_tma_load import paired_ms

    from moegemm import shapes
    from moegemm.torch import _launch

    def variant_fn(variant):
        """ "3": 3 slots of 64 rows; "6r32": 6 slots of 32 rows; "6n128": 6 slots, 128 x 128 tiles; "prev4": the
        earlier file's kernel (scripts/k_grouped_ws_prev.py, written for the run); "top4": a variant file
        (scripts/k_grouped_ws_top.py, perf-notes 33); a suffix "-aa" repeats a variant (an A/A control)."""
        module = k_grouped_ws
        variant = variant.removesuffix("-aa")
        if variant.startswith("prev"):
            import k_grouped_ws_prev as module  # written next to this script for the run

            variant = variant[4:]
        elif variant.startswith("top"):
            import k_grouped_ws_top as module  # written next to this script for the run

            variant = variant[3:]
        variant, _, block_n = variant.partition("n")
        stages, _, rows = variant.partition("r")
        return functools.partial(
            launch, stages=int(stages), rows=int(rows or 64), module=module, block_n=int(block_n or 256)
        )

    for variant in args.stages.split(","):
        for row in check_edges(variant_fn(variant)):
            record(**row, variant=variant)
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
        for variant in args.stages.split(","):
            fn = functools.partial(variant_fn(variant), dy, x, gs, out)
            try:
                out.fill_(float("nan"))
                fn()
                err = ((out.double() - want.double()).norm() / want.double().norm()).item()
                row[f"ws{variant}_relerr"] = err
                if err < 1e-2:
                    fns[f"ws{variant}"] = (lambda: None, fn)
                else:
                    row[f"ws{variant}_error"] = "relerr above 1e-2"
            except Exception as e:
                row[f"ws{variant}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        for name, ms in paired_ms(fns, args.reps).items():
            row[f"{name}_ms"] = ms
            if name != "torch":
                row[f"{name}_vs_torch"] = row["torch_ms"] / ms
        record(**row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
