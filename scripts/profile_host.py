"""Host-side cost of one moegemm call (tiny shapes, so the GPU never limits): us/call and a cProfile.

    python scripts/profile_host.py
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from moegemm.torch import k_grouped_mm, m_grouped_mm


def main() -> None:
    G, M, K, N = 8, 128, 64, 64
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    gs = torch.full((G,), M // G, device="cuda", dtype=torch.int32)
    calls = {
        "m_grouped fwd": lambda: m_grouped_mm(x, w.mT, gs),
        "k_grouped wgrad": lambda: k_grouped_mm(dy, x, gs, out_dtype=torch.bfloat16),
        "torch._grouped_mm": lambda: torch._grouped_mm(x, w.mT, offs=gs.cumsum(0, dtype=torch.int32)),
    }
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{name:20s} {(t1 - t0) / 500 * 1e6:7.1f} us/call (host)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        calls["m_grouped fwd"]()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
