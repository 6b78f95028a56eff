"""GPU probe (H100): the m-grouped (fwd/dgrad) kernel reading x and w through TMA descriptors
(MOEGEMM_M_TMA_LOAD) against the same launch with cp.async, next to torch._grouped_mm.

    OUT=/tmp/probe python scripts/probe_m_tma_load.py [--cases suite,heldout] [--ops fwd,dgrad]
    OUT=/tmp/probe python scripts/probe_m_tma_load.py --host   # host cost per call, TMA loads vs cp.async

Both variants run the launcher's own config. Per case-op the order is torch, cp.async, TMA, TMA, cp.async
(ABBA, so a drift of the clock within the case shows as a gap between the two readings of one variant).
Timing: triton.testing.do_bench medians (CUDA events, L2 cleared before each run); each variant's output is
checked against torch's first (NaN-poisoned). Appends JSON lines to $OUT/m_tma_load.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import triton.testing

from moegemm import shapes
from moegemm.torch import _launch

LOG = os.path.join(os.environ.get("OUT", "."), "m_tma_load.jsonl")
SPECS = []  # the spec of every m-grouped launch, to read back which loads it took


def _record_specs() -> None:
    for direct in (_launch.M_GROUPED, _launch.M_GROUPED_TMA):
        inner = direct.launch
        direct.launch = lambda spec, *a, inner=inner: (SPECS.append(spec), inner(spec, *a))


def record(**kw) -> None:
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    print(json.dumps(kw), flush=True)
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


def relerr(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def host(rounds: int = 7, calls: int = 200) -> None:
    """Host time per fwd call (G 8, M 4096, K = N = 512, bf16) with TMA loads and with cp.async, taking
    turns over rounds: median of the round medians."""
    from moegemm.bench.overhead import median_host_us

    G, M, K, N = 8, 4096, 512, 512
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    gs = torch.full((G,), M // G, dtype=torch.int32, device="cuda")
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    _launch.TMA_LOAD_MIN_FLOPS = 0  # this shape is below the gate
    call = functools.partial(_launch.launch_m_grouped, x, w, gs, out, transpose_w=True)
    samples = {"tma": [], "cp": []}
    for variant in samples:  # compile and bind both first
        _launch.M_TMA_LOAD = variant == "tma"
        call()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for variant, values in samples.items():
            _launch.M_TMA_LOAD = variant == "tma"
            call()
            values.append(median_host_us(call, calls))
            torch.cuda.synchronize()
    for variant, values in samples.items():
        values.sort()
        record(kind="host", variant=variant, host_us=values[len(values) // 2], rounds=values)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", action="store_true")
    p.add_argument("--cases", default="suite,heldout")
    p.add_argument("--ops", default="fwd,dgrad")
    p.add_argument("--split", default="dirichlet")
    args = p.parse_args()
    if args.host:
        host()
        return 0
    _record_specs()
    for case in shapes.select(args.cases.split(",")):
        sizes = shapes.group_sizes(case.M, case.G, split=args.split)
        gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        offs = gs.cumsum(0).to(torch.int32)
        x = torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(case.M, case.N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(case.G, case.N, case.K, device="cuda", dtype=torch.bfloat16)
        for op in args.ops.split(","):
            if op == "fwd":
                out = torch.empty(case.M, case.N, device="cuda", dtype=torch.bfloat16)
                peer = functools.partial(torch._grouped_mm, x, w.mT, offs=offs, out_dtype=torch.bfloat16)
                ours = functools.partial(_launch.launch_m_grouped, x, w, gs, out, transpose_w=True)
            else:
                out = torch.empty(case.M, case.K, device="cuda", dtype=torch.bfloat16)
                peer = functools.partial(torch._grouped_mm, dy, w, offs=offs, out_dtype=torch.bfloat16)
                ours = functools.partial(_launch.launch_m_grouped, dy, w, gs, out)
            want = peer()
            row = dict(case=case.name, op=op, G=case.G, M=case.M, K=case.K, N=case.N, split=args.split)
            row["torch_ms"] = triton.testing.do_bench(peer, warmup=10, rep=60, return_mode="median")
            for i, variant in enumerate(("cp", "tma", "tma", "cp")):
                _launch.M_TMA_LOAD = variant == "tma"
                key = f"{variant}{1 + (i in (2, 3))}"
                try:
                    out.fill_(float("nan"))
                    ours()
                    row[f"{key}_took_tma"] = _launch._m_launch(*SPECS[-1]).meta["TMA_LOAD"]
                    err = relerr(out, want)
                    ms = triton.testing.do_bench(ours, warmup=10, rep=60, return_mode="median")
                    row[f"{key}_ms"] = ms
                    row[f"{key}_relerr"] = err
                    if not err < 1e-2:
                        row[f"{key}_error"] = "relerr above 1e-2"
                except Exception as e:
                    row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            for variant in ("cp", "tma"):
                times = [row.get(f"{variant}{j}_ms") for j in (1, 2)]
                if all(times):
                    row[f"{variant}_vs_torch"] = row["torch_ms"] / min(times)
            if row.get("cp_vs_torch") and row.get("tma_vs_torch"):
                row["tma_over_cp"] = row["tma_vs_torch"] / row["cp_vs_torch"]
            record(**row)
    _launch.M_TMA_LOAD = False
    return 0


if __name__ == "__main__":
    sys.exit(main())
