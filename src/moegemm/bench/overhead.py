"""``--overhead`` (issue 4): host CPU time per call on a tiny shape, where the GPU work is negligible.

Launches are asynchronous, so timing N back-to-back calls without a sync in between measures what the
Python/dispatch/launch path costs the host per call. Under the interpreter it measures the interpreter.
"""

from __future__ import annotations

import time

import torch

from moegemm import shapes
from moegemm.bench.problem import make_problem
from moegemm.bench.registry import REGISTRY

CASE = shapes.Case("overhead-e8", G=8, M=128, K=64, N=64)
IMPLS = ("moegemm", "torch._grouped_mm")


def measure(device: torch.device, dtype: torch.dtype, calls: int | None = None) -> list[dict]:
    calls = calls or (200 if device.type == "cuda" else 2)
    problem = make_problem(CASE, device=device, dtype=dtype, split="balanced")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for name in IMPLS:
        impl = REGISTRY.get(name)
        for op in ("fwd", "wgrad"):
            if impl is None or impl.available(problem, op):
                continue
            fn = impl.prepare(problem, op)
            fn()  # compile / warm caches
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            host_us = (time.perf_counter() - start) / calls * 1e6
            sync()
            rows.append({"impl": name, "op": op, "host_us_per_call": host_us, "calls": calls,
                         "shape": f"G{CASE.G} M{CASE.M} K{CASE.K} N{CASE.N}"})  # fmt: skip
    return rows


def line(rows: list[dict], device: torch.device) -> str:
    parts = ", ".join(f"{r['impl']} {r['op']} {r['host_us_per_call']:.1f} us" for r in rows)
    note = "" if device.type == "cuda" else " (CPU/interpreter: not meaningful)"
    return f"host overhead per call ({CASE.name}){note}: {parts}"
