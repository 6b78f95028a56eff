"""Host-side cost of moegemm calls (tiny shapes, so the GPU never limits): us/call and a cProfile.

    python scripts/profile_host.py [--json PATH] [--cprofile]
    MOEGEMM_DIRECT_LAUNCH=0 python scripts/profile_host.py ...   # every launch through JITFunction.run

Rows marked [JITFunction.run launches] repeat a row with the direct launch path switched off, in the
same rounds.

Rows: the bare Triton launch, each public op, GroupedLinear forward and forward+backward, and floors
measured in the same process (a one-op autograd round trip, torch._grouped_mm forward+backward) so the
numbers can be read against what this host costs for anything.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import statistics

import torch

from moegemm.bench.overhead import median_host_us
from moegemm.torch import GroupedLinear, _launch, _ops, k_grouped_mm, m_grouped_mm


def us_per_call(fn, calls: int, reset, warmup: int = 20) -> float:
    median_host_us(fn, warmup, reset)
    us = median_host_us(fn, calls, reset)
    torch.cuda.synchronize()
    return us


def through_jit(fn) -> None:
    saved, _launch.DIRECT_LAUNCH = _launch.DIRECT_LAUNCH, False
    try:
        fn()
    finally:
        _launch.DIRECT_LAUNCH = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--cprofile", action="store_true", help="also print a cProfile of GroupedLinear fwd+bwd")
    args = parser.parse_args()
    G, M, K, N = 8, 64, 64, 64
    dt = torch.bfloat16
    x = torch.randn(M, K, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(G, N, K, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=dt)
    gs = torch.full((G,), M // G, device="cuda", dtype=torch.int32)
    out = torch.empty(M, N, device="cuda", dtype=dt)
    wgrad = torch.empty(G, N, K, device="cuda", dtype=dt)
    lin = GroupedLinear(G, K, N, dtype=dt, device="cuda")
    lin_nobias = GroupedLinear(G, K, N, bias=False, dtype=dt, device="cuda")
    xd, wd = x.detach(), w.detach()
    scale = torch.randn(M, K, device="cuda", dtype=dt, requires_grad=True)

    def clear():
        for t in (x, w, scale, lin.weight, lin.bias, lin_nobias.weight):
            t.grad = None

    def grouped_mm_fwd_bwd():
        offs = gs.cumsum(0, dtype=torch.int32)
        torch._grouped_mm(x, w.mT, offs=offs).backward(dy)

    calls = {
        "bare launch_m_grouped": lambda: _ops.launch_m_grouped(xd, wd.mT, gs, out),
        "bare launch_k_grouped": lambda: _ops.launch_k_grouped(dy, xd, gs, wgrad, accumulate=False),
        "m_grouped_mm fwd (no grad)": lambda: m_grouped_mm(xd, wd.mT, gs),
        "k_grouped_mm wgrad": lambda: k_grouped_mm(dy, xd, gs, out_dtype=dt),
        "torch._grouped_mm fwd (no grad)": lambda: torch._grouped_mm(xd, wd.mT, offs=gs.cumsum(0, dtype=torch.int32)),
        "floor: (x*s).backward(dy) one-op autograd": lambda: (x * scale).sum().backward(),
        "torch._grouped_mm fwd+bwd": grouped_mm_fwd_bwd,
        "GroupedLinear fwd (grad enabled)": lambda: lin(x, gs),
        "GroupedLinear fwd+bwd": lambda: lin(x, gs).backward(dy),
        "GroupedLinear no-bias fwd+bwd": lambda: lin_nobias(x, gs).backward(dy),
    }
    # The same calls with every launch through JITFunction.run, in the same rounds (an A/B that the
    # host's drift between processes cannot bias).
    for name in ("bare launch_m_grouped", "m_grouped_mm fwd (no grad)", "GroupedLinear fwd+bwd"):
        calls[f"{name} [JITFunction.run launches]"] = functools.partial(through_jit, calls[name])
    # Rounds in turns, median of the round medians: the host's speed drifts between (and within) runs.
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(5):
        for name, fn in calls.items():
            samples[name].append(us_per_call(fn, calls=100, reset=clear))
    rows = []
    for name, values in samples.items():
        us = statistics.median(values)
        rows.append({"case": name, "us_per_call": us, "round_medians": values})
        print(f"{name:45s} {us:7.1f} us/call (host)  rounds {min(values):.0f}-{max(values):.0f}")
    if args.json:
        with open(args.json, "w") as f:
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
            json.dump({**meta, "direct_launch": _launch.DIRECT_LAUNCH, "rows": rows}, f, indent=1)
    if not args.cprofile:
        return
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        clear()
        lin(x, gs).backward(dy)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
