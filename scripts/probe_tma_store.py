"""GPU probe (H100): the TMA-store epilogue (MOEGEMM_TMA_STORE) against the register store, per config,
next to torch._grouped_mm, on the BF16 m-grouped (fwd, dgrad) and k-grouped (wgrad) launches.

    OUT=/tmp/probe python scripts/probe_tma_store.py [--cases suite,heldout] [--ops wgrad] [--configs pick,0,1]
    OUT=/tmp/probe python scripts/probe_tma_store.py --host     # host cost per call, TMA store on vs off

Configs: "pick" is what the launcher picks (cache, then cost model), an integer forces that entry of
``configs.candidates(op, "sm90")``. Each variant runs with the TMA store on and off (a config whose
shared memory leaves no room runs the register store both times, marked ``tma_fits: false``).
Timing: triton.testing.do_bench medians (CUDA events, L2 cleared before each run), every variant's
output checked against torch's first. Appends JSON lines to $OUT/tma_store.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import triton.testing

from moegemm import configs, shapes
from moegemm.kernels import k_grouped, m_grouped
from moegemm.torch import _launch

LOG = os.path.join(os.environ.get("OUT", "."), "tma_store.jsonl")
PICK = configs.pick_config


def record(**kw) -> None:
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    print(json.dumps(kw), flush=True)
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


PICKED: dict = {}


def picked(op, *a, **k):
    PICKED[op] = PICK(op, *a, **k)
    return PICKED[op]


def force(op: str, config, tma: bool) -> None:
    """config None: the launcher's own pick (remembered in PICKED)."""
    _launch.TMA_STORE = tma
    configs.pick_config = (
        picked if config is None else (lambda o, *a, **k: config if o == op else PICK(o, *a, **k))
    )
    _launch.clear_launch_cache()


def relerr(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def calls(op, x, w, dy, gs, offs):
    """(torch's call, ours, ours's output) of one op; wgrad is dW [G, N, K] = dy[rows]^T @ x[rows]."""
    if op == "wgrad":
        out = torch.empty(w.shape, device="cuda", dtype=torch.bfloat16)
        return (
            functools.partial(torch._grouped_mm, dy.T, x, offs=offs, out_dtype=torch.bfloat16),
            functools.partial(_launch.launch_k_grouped, dy, x, gs, out, False),
            out,
        )
    a, b = (x, w.mT) if op == "fwd" else (dy, w)
    out = torch.empty(a.shape[0], b.shape[2], device="cuda", dtype=torch.bfloat16)
    return (
        functools.partial(torch._grouped_mm, a, b, offs=offs, out_dtype=torch.bfloat16),
        functools.partial(_launch.launch_m_grouped, a, b, gs, out),
        out,
    )


def host(rounds: int = 7, calls: int = 200) -> None:
    """Host time per call of the public ops on the --overhead shape (G 8, M 128, K 64, N 64, bf16; GPU
    work negligible), the TMA store on and off taking turns over rounds: median of the round medians."""
    from moegemm.bench.overhead import median_host_us
    from moegemm.torch import k_grouped_mm, m_grouped_mm

    G, M, K, N = 8, 128, 64, 64
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    gs = torch.full((G,), M // G, dtype=torch.int32, device="cuda")
    ops = {
        "fwd": lambda: m_grouped_mm(x, w.mT, gs),
        "wgrad": lambda: k_grouped_mm(dy, x, gs, out_dtype=torch.bfloat16),
    }
    samples = {(op, tma): [] for op in ops for tma in (False, True)}
    for tma in (False, True):  # compile and bind both paths first
        _launch.TMA_STORE = tma
        for fn in ops.values():
            fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for (op, tma), values in samples.items():
            _launch.TMA_STORE = tma
            values.append(median_host_us(ops[op], calls))
            torch.cuda.synchronize()
    for (op, tma), values in samples.items():
        values.sort()
        record(kind="host", op=op, tma_store=tma, host_us=values[len(values) // 2], rounds=values)
    _launch.TMA_STORE = True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", action="store_true")
    p.add_argument("--cases", default="suite,heldout")
    p.add_argument("--ops", default="fwd,dgrad,wgrad")
    p.add_argument("--configs", default="pick")
    args = p.parse_args()
    if args.host:
        host()
        return 0
    for case in shapes.select(args.cases.split(",")):
        name = case.name
        sizes = shapes.group_sizes(case.M, case.G)
        gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        offs = gs.cumsum(0).to(torch.int32)
        x = torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(case.G, case.N, case.K, device="cuda", dtype=torch.bfloat16) / case.K**0.5
        dy = torch.randn(case.M, case.N, device="cuda", dtype=torch.bfloat16)
        for op in args.ops.split(","):
            kind = "k_grouped" if op == "wgrad" else "m_grouped"
            peer, ours, out = calls(op, x, w, dy, gs, offs)
            want = peer()
            row = dict(case=name, op=op, G=case.G, M=case.M, K=case.K, N=case.N)
            row["torch_ms"] = triton.testing.do_bench(peer, warmup=10, rep=60, return_mode="median")
            for text in args.configs.split(","):
                config = None if text == "pick" else configs.candidates(kind, "sm90")[int(text)]
                for tma in (False, True):
                    label = f"{text}-{'tma' if tma else 'reg'}"
                    force(kind, config, tma)
                    try:
                        out.fill_(float("nan"))
                        ours()
                        err = relerr(out, want)
                        ms = triton.testing.do_bench(ours, warmup=10, rep=60, return_mode="median")
                        row[f"{label}_ms"] = ms
                        row[f"{label}_vs_torch"] = row["torch_ms"] / ms
                        row[f"{label}_relerr"] = err
                        if err > 1e-2:
                            row[f"{label}_error"] = "relerr above 1e-2"
                    except Exception as e:  # a config that does not compile for this shape
                        row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                if config is None and kind in PICKED:
                    config = PICKED[kind]
                    row["pick"] = str(config)
                if config is not None:
                    itemsize = 2
                    fits = (
                        k_grouped.tma_store_fits(config, itemsize)
                        if kind == "k_grouped"
                        else m_grouped.tma_store_fits(config, itemsize)
                    )
                    row[f"{text}_tma_fits"] = fits
            record(**row)
    force("", None, True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
