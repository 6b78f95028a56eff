"""Quick perf probe on the GPU: moegemm vs torch._grouped_mm on the suite (fwd, dgrad, wgrad), medians.

The full benchmark is `python -m moegemm.bench`; this probe is for fast iteration on kernel changes.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import triton

from moegemm import shapes
from moegemm.torch import k_grouped_mm, m_grouped_mm


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else [c.name for c in shapes.SUITE]
    print(f"{'case':22s} {'op':6s} {'moegemm':>8s} {'torch':>8s} {'ratio':>6s}  (TF/s)")
    for case in map(shapes.get, names):
        G, M, K, N = case.G, case.M, case.K, case.N
        sizes = shapes.group_sizes(M, G, seed=0)
        gs = torch.tensor(sizes, device="cuda", dtype=torch.int32)
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
        for op, (ours, theirs) in ops.items():
            a, b = ours().float(), theirs().float()
            err = ((a - b).norm() / b.norm()).item()
            t_ours = triton.testing.do_bench(ours, warmup=10, rep=50, return_mode="median")
            t_theirs = triton.testing.do_bench(theirs, warmup=10, rep=50, return_mode="median")
            tf = case.flops / 1e9
            print(f"{case.name:22s} {op:6s} {tf / t_ours:8.1f} {tf / t_theirs:8.1f} {t_theirs / t_ours:6.2f}"
                  f"  relerr-vs-torch {err:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
