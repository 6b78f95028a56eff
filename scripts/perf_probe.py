"""Quick perf probe on the GPU: moegemm vs torch._grouped_mm on the suite (fwd, dgrad, wgrad), medians.

The full benchmark is `python -m moegemm.bench`; this probe is for fast iteration on kernel changes.
`--sweep` times every candidate config of configs.TABLE per case/op; `--asm` reports wgmma use,
registers and spills of each compiled variant.

    python scripts/perf_probe.py [--cases a,b] [--sweep] [--asm]
"""

from __future__ import annotations

import argparse
import contextlib
from functools import partial

import torch
import triton

from moegemm import configs, shapes
from moegemm.bench.tune import force_config
from moegemm.kernels.k_grouped import k_grouped_mm_kernel
from moegemm.kernels.m_grouped import m_grouped_mm_kernel
from moegemm.torch import k_grouped_mm, m_grouped_mm


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(c.name for c in shapes.SUITE))
    parser.add_argument("--ops", default="fwd,dgrad,wgrad")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--asm", action="store_true")
    args = parser.parse_args()
    print(f"{'case':20s} {'op':6s} {'moegemm':>8s} {'torch':>8s} {'ratio':>6s}  (TF/s)  best config")
    for case in map(shapes.get, args.cases.split(",")):
        G, M, K, N = case.G, case.M, case.K, case.N
        gs = torch.tensor(shapes.group_sizes(M, G, seed=0), device="cuda", dtype=torch.int32)
        offs = torch.cumsum(gs, 0, dtype=torch.int32)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        ops = {
            "fwd": (partial(m_grouped_mm, x, w.mT, gs), partial(torch._grouped_mm, x, w.mT, offs=offs)),
            "dgrad": (partial(m_grouped_mm, dy, w, gs), partial(torch._grouped_mm, dy, w, offs=offs)),
            "wgrad": (
                partial(k_grouped_mm, dy, x, gs, out_dtype=torch.bfloat16),
                partial(torch._grouped_mm, dy.T, x, offs=offs),
            ),
        }
        for op in args.ops.split(","):
            ours, theirs = ops[op]
            want = theirs().float()
            t_theirs = bench(theirs)
            kind = "k_grouped" if op == "wgrad" else "m_grouped"
            candidates = configs.candidates(kind, "sm90") if args.sweep else [None]
            results = []
            for cfg in candidates:
                with force_config(cfg) if cfg else contextlib.nullcontext():
                    try:
                        got = ours().float()
                    except Exception as e:  # noqa: BLE001 - a config may not compile (smem); report it
                        print(f"   {cfg}: {type(e).__name__}: {str(e)[:100]}")
                        continue
                    err = ((got - want).norm() / want.norm()).item()
                    assert err < 1e-2, f"{case.name} {op} {cfg}: relerr vs torch {err}"
                    results.append((bench(ours), cfg))
                    if args.sweep:
                        print(f"   {case.flops / 1e9 / results[-1][0]:7.1f} {cfg}", flush=True)
            t_ours, best = min(results, key=lambda r: r[0])
            tf = case.flops / 1e9
            print(f"{case.name:20s} {op:6s} {tf / t_ours:8.1f} {tf / t_theirs:8.1f} {t_theirs / t_ours:6.2f}  {best}",
                  flush=True)  # fmt: skip
    if args.asm:
        for kernel in (m_grouped_mm_kernel, k_grouped_mm_kernel):
            for cache in kernel.device_caches.values():
                for compiled in cache[0].values():
                    ptx = compiled.asm.get("ptx", "")
                    print(kernel.fn.__name__, f"wgmma={'wgmma' in ptx} cp.async={'cp.async' in ptx}",
                          f"regs={compiled.n_regs} spills={compiled.n_spills} smem={compiled.metadata.shared}")


if __name__ == "__main__":
    main()
