"""Roofline floor per (case, op): floor = max(FLOPs / peak FLOP/s, bytes / bandwidth).

Bytes count every input once and every output once, all G weights included:
fwd x + w + out, dgrad dy + w + dx, wgrad x + dy + dw. The floor is reported as TF/s-equivalent
(FLOPs / floor time), so an impl's share of it is simply its TF/s over the floor's TF/s.
Constants are the H100 anchor (/work/shared/anchors/h100-baseline.md): 740 TF/s bf16 measured with
cuBLAS, 3.0 TB/s copy bandwidth.
"""

from __future__ import annotations

import dataclasses

from moegemm.shapes import Case

PEAK_FLOPS = 740e12
PEAK_BYTES_PER_S = 3.0e12
OPS = ("fwd", "dgrad", "wgrad")


def op_flops(case: Case, op: str) -> int:
    """2*M*K*N for every op: each token row meets one expert's K x N weight once."""
    _check_op(op)
    return case.flops


def op_bytes(case: Case, op: str, itemsize: int = 2) -> int:
    """Bytes touched at least once: inputs and output, each counted once."""
    G, M, K, N = case.G, case.M, case.K, case.N
    elements = {
        "fwd": M * K + G * N * K + M * N,  # x, w, out
        "dgrad": M * N + G * N * K + M * K,  # dy, w, dx
        "wgrad": M * K + M * N + G * N * K,  # x, dy, dw
    }[_check_op(op)]
    return elements * itemsize


@dataclasses.dataclass(frozen=True)
class Floor:
    seconds: float
    tflops: float  # FLOPs / seconds / 1e12
    bound: str  # "compute" or "memory"


def floor(case: Case, op: str, itemsize: int = 2) -> Floor:
    compute_s = op_flops(case, op) / PEAK_FLOPS
    memory_s = op_bytes(case, op, itemsize) / PEAK_BYTES_PER_S
    seconds = max(compute_s, memory_s)
    return Floor(
        seconds, op_flops(case, op) / seconds / 1e12, "compute" if compute_s >= memory_s else "memory"
    )


def tflops(case: Case, op: str, ms: float) -> float:
    return op_flops(case, op) / (ms * 1e-3) / 1e12


def _check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return op
