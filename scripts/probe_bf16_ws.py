"""GPU probe (H100): the warp-specialized BF16 m-grouped kernel (moegemm.kernels.m_grouped_ws) against
the Triton kernel and torch._grouped_mm, on fwd (K-contiguous weight) and dgrad (N-contiguous weight).

    OUT=/tmp/probe python scripts/probe_bf16_ws.py check      # correctness, both layouts, edge cases
    OUT=/tmp/probe python scripts/probe_bf16_ws.py time [--cases suite,heldout] [--configs 256x64x4,128x64x6]

check: NaN-poisoned output, relerr against an fp64 product, rows past sum(group_sizes) exactly 0,
for each forced config. time: triton.testing.do_bench medians (CUDA events; inputs not rotated, so
small problems may sit in L2: the bench, not this probe, gives the numbers to quote), correctness of
every timed variant checked first. Prints and appends JSON lines to $OUT/bf16_ws.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton.testing

from moegemm import configs, shapes
from moegemm.torch import _launch

LOG = os.path.join(os.environ.get("OUT", "."), "bf16_ws.jsonl")


def record(**kw) -> None:
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    print(json.dumps(kw), flush=True)
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


def parse_config(text: str) -> configs.WsConfig:
    """ "256x64x4" (TMA loader where it applies), "256x64x4x208" (consumer registers), a "c" suffix
    ("256x64x4c") for the cp.async loader, "g16" for GROUP_M 16."""
    tma = not text.endswith("c")
    group_m = 16 if "g16" in text else 8
    bn, bk, stages, *rest = (int(v) for v in text.removesuffix("c").replace("g16", "").split("x") if v)
    return configs.WsConfig(bn, bk, stages, group_m, rest[0] if rest else 232, tma)


def force(config) -> None:
    """config: a WsConfig, or None for the Triton kernel."""
    _launch.WS = config is not None
    configs.pick_ws_config = lambda **_: config
    _launch.clear_launch_cache()


def run(x, w, gs, bias=None, poison=True):
    """m_grouped through the launcher, W = w [G, K, N] (any of the two contiguous layouts), into a
    NaN-poisoned output (``poison``; timed calls allocate it empty, as torch._grouped_mm does: the
    first 2026-11-25 runs timed the NaN fill with every moegemm variant, ~3% of dsv3-ep8-fc1 fwd)."""
    shape = (x.shape[0], w.shape[2])
    out = torch.full(shape, float("nan"), device=x.device, dtype=x.dtype) if poison else x.new_empty(shape)
    _launch.launch_m_grouped(x, w, gs, out, bias)
    return out


def reference(x, w, sizes, bias=None):
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64, device=x.device)
    row = 0
    for g, n in enumerate(sizes):
        n = max(0, min(n, x.shape[0] - row))
        out[row : row + n] = x[row : row + n].double() @ w[g].double()
        if bias is not None:
            out[row : row + n] += bias[g].double()
        row += n
    return out


def relerr(a, b) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def clamp_sizes(sizes, M):
    """The kernels' clamping rule (moegemm.kernels.schedule)."""
    out, end = [], 0
    for s in sizes:
        s = min(max(s, 0), M)
        s = min(s, M - end)
        out.append(s)
        end += s
    return out


def check(config_texts) -> None:
    cases = [
        ("skew-empty-tail", 300, 256, 384, [100, 0, 150, 20]),
        ("k1040-n208-dirichlet", 777, 1040, 208, shapes.group_sizes(770, 6, seed=5, empty=2)),
        ("one-hot", 640, 512, 256, [0, 0, 640, 0]),
        ("all-empty", 64, 128, 128, [0, 0, 0]),
        ("odd-rows", 129, 48, 48, [64, 1, 64]),
        ("many-tiles", 4096, 2048, 1024, shapes.group_sizes(4000, 32, seed=1)),
        ("negative-size", 40, 128, 128, [10, -5, 20]),
        ("sum-above-M", 40, 128, 128, [30, 0, 25]),
        ("huge-size", 40, 128, 128, [2**31 - 1, 3]),
    ]
    calls = []
    for kind, direct in (("cp.async", _launch.M_GROUPED_WS), ("tma", _launch.M_GROUPED_WS_TMA)):
        direct.launch = lambda *a, kind=kind, launch=direct.launch: (calls.append(kind), launch(*a))
    for text in config_texts:
        force(parse_config(text))
        for name, M, K, N, sizes in cases:
            for layout in ("k-contiguous", "n-contiguous"):
                for dtype, has_bias in ((torch.bfloat16, True), (torch.float16, False)):
                    gen = torch.Generator(device="cuda").manual_seed(len(calls))
                    G = len(sizes)
                    x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
                    if layout == "k-contiguous":
                        w = torch.randn(G, N, K, device="cuda", generator=gen).to(dtype).mT
                    else:
                        w = torch.randn(G, K, N, device="cuda", generator=gen).to(dtype)
                    bias = (
                        (torch.randn(G, N, device="cuda", generator=gen) + 3).to(dtype) if has_bias else None
                    )
                    gs = torch.tensor(sizes, dtype=torch.int64, device="cuda")
                    before = len(calls)
                    out = run(x, w, gs, bias)
                    torch.cuda.synchronize()
                    clamped = clamp_sizes(sizes, M)
                    want = reference(x, w, clamped, bias)
                    owned = sum(clamped)
                    err = relerr(out[:owned], want[:owned]) if owned else 0.0
                    record(
                        kind="check", config=text, case=name, layout=layout, dtype=str(dtype), bias=has_bias,
                        ws=calls[-1] if len(calls) > before else None, relerr=err, nan=bool(out.isnan().any()),
                        tail_zero=bool((out[owned:] == 0).all()),
                        ok=err <= 4e-3 and not out.isnan().any() and bool((out[owned:] == 0).all()),
                    )  # fmt: skip


def time_cases(case_names, config_texts) -> None:
    variants = [(t, parse_config(t)) for t in config_texts] + [("triton", None)]
    for name in case_names:
        case = shapes.get(name)
        sizes = shapes.group_sizes(case.M, case.G)
        gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        offs = torch.tensor(sizes, dtype=torch.int32, device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(case.G, case.N, case.K, device="cuda", dtype=torch.bfloat16) / case.K**0.5
        dy = torch.randn(case.M, case.N, device="cuda", dtype=torch.bfloat16)
        for op in ("fwd", "dgrad"):
            a, b = (x, w.mT) if op == "fwd" else (dy, w)
            peer = lambda a=a, b=b, offs=offs: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
            want = peer().float()
            flops = 2 * case.M * case.K * case.N
            row = dict(kind="time", case=name, op=op, G=case.G, M=case.M, K=case.K, N=case.N)
            ms = triton.testing.do_bench(peer, warmup=10, rep=60, return_mode="median")
            row["torch_ms"] = ms
            for label, config in variants:
                force(config)
                try:
                    out = run(a, b, gs)
                    err = relerr(out.float(), want.double())
                    ms = triton.testing.do_bench(
                        lambda a=a, b=b, gs=gs: run(a, b, gs, poison=False),
                        warmup=10,
                        rep=60,
                        return_mode="median",
                    )
                    row[f"{label}_ms"] = ms
                    row[f"{label}_tflops"] = flops / ms / 1e9
                    row[f"{label}_relerr_vs_torch"] = err
                except Exception as e:  # a config that does not compile for this shape
                    row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            timed = [(row[k], k) for k in row if k.endswith("_ms") and k != "torch_ms"]
            if timed:
                row["best"] = min(timed)[1].removesuffix("_ms")
                row["best_vs_torch"] = row["torch_ms"] / min(timed)[0]
            record(**row)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["check", "time"])
    p.add_argument("--cases", default="suite,heldout")
    p.add_argument("--configs", default="256x64x4,128x64x6")
    args = p.parse_args()
    config_texts = args.configs.split(",")
    if args.what == "check":
        check(config_texts)
    else:
        time_cases([case.name for case in shapes.select(args.cases.split(","))], config_texts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
