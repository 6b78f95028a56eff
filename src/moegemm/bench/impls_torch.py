"""PyTorch-side impls: moegemm, torch._grouped_mm, a loop of torch.mm, and dense cuBLAS.

Each ``prepare`` does its set-up once (views, offsets, host splits) and returns a callable that
allocates its output and runs the op, cycling over the problem's input copies.
"""

from __future__ import annotations

import itertools

import torch

from moegemm._src.torch.args import resolve_backend
from moegemm.bench.problem import exact_fp32
from moegemm.bench.registry import Impl, register
from moegemm.torch import api as moegemm_api


def _cycle(calls):
    """fn() running calls[0], calls[1], ... in turn; calls[0] first, the copy the oracle uses."""
    it = itertools.cycle(calls)
    return lambda: next(it)()


# ---------------------------------------------------------------- moegemm


def backend_label(device: torch.device) -> str:
    """What ``backend="auto"`` resolves to here: "triton", "interpret" or "reference"."""
    resolved = resolve_backend("auto", device)
    return "interpret" if resolved == "triton" and device.type == "cpu" else resolved


def _moegemm(problem, op):
    gs = problem.group_sizes

    def call(x, w, dy):
        if op == "fwd":
            return lambda: moegemm_api.m_grouped_mm(x, w.mT, gs)
        if op == "dgrad":
            return lambda: moegemm_api.m_grouped_mm(dy, w, gs)
        return lambda: moegemm_api.k_grouped_mm(dy, x, gs, out_dtype=problem.dtype)

    return _cycle([call(*c) for c in problem.copies])


register(Impl("moegemm", ("fwd", "dgrad", "wgrad"), _moegemm))


# ---------------------------------------------------------------- torch._grouped_mm


def _grouped_mm_available(problem, op) -> str | None:
    del op  # fwd/dgrad strides are K and N; wgrad's dy^T [N, M] has strides (1, N): the same K and N
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if problem.device.type == "cuda" and torch.cuda.get_device_capability(problem.device) < (8, 0):
        return "torch._grouped_mm needs sm80+ (its CUTLASS kernel needs sm90+)"
    # Every operand stride must be a multiple of 16 bytes (PyTorch checks this and raises).
    itemsize = problem.copies[0].x.element_size()
    odd = {d: v for d, v in (("K", problem.case.K), ("N", problem.case.N)) if v * itemsize % 16}
    if odd:
        return f"strides must be multiples of 16 bytes; {odd} x {itemsize} B is not"
    return None


def _grouped_mm(problem, op):
    offs = torch.tensor(problem.offsets, dtype=torch.int32, device=problem.device)
    out_dtype = problem.dtype

    def call(x, w, dy):
        if op == "fwd":  # 2D x 3D: [M, K] x [G, K, N] -> [M, N], groups along M
            return lambda: torch._grouped_mm(x, w.mT, offs=offs, out_dtype=out_dtype)
        if op == "dgrad":  # 2D x 3D: [M, N] x [G, N, K] -> [M, K]
            return lambda: torch._grouped_mm(dy, w, offs=offs, out_dtype=out_dtype)
        # 2D x 2D: [N, M] x [M, K] -> [G, N, K], groups along the contraction dim M
        return lambda: torch._grouped_mm(dy.t(), x, offs=offs, out_dtype=out_dtype)

    return _cycle([call(*c) for c in problem.copies])


register(Impl("torch._grouped_mm", ("fwd", "dgrad", "wgrad"), _grouped_mm, available=_grouped_mm_available))


# ---------------------------------------------------------------- loop of torch.mm


def _loop_mm(problem, op):
    """One torch.mm per non-empty group over host-side bounds computed here, outside the timing."""
    case, live = problem.case, [(g, s, e) for g, (s, e) in enumerate(problem.bounds) if e > s]
    empty = [g for g, (s, e) in enumerate(problem.bounds) if e == s]

    def call(x, w, dy):
        if op in ("fwd", "dgrad"):
            a, cols = (x, case.N) if op == "fwd" else (dy, case.K)
            weights = [w[g].mT if op == "fwd" else w[g] for g in range(case.G)]

            def run():
                out = torch.empty(case.M, cols, dtype=a.dtype, device=a.device)
                for g, s, e in live:
                    torch.mm(a[s:e], weights[g], out=out[s:e])
                return out

            return run

        def run_wgrad():
            out = torch.empty(case.G, case.N, case.K, dtype=x.dtype, device=x.device)
            for g, s, e in live:
                torch.mm(dy[s:e].t(), x[s:e], out=out[g])
            for g in empty:
                out[g].zero_()
            return out

        return run_wgrad

    return _cycle([call(*c) for c in problem.copies])


register(Impl("loop-torch.mm", ("fwd", "dgrad", "wgrad"), _loop_mm))


# ---------------------------------------------------------------- dense cuBLAS, same FLOPs


def _dense_operands(inputs, op):
    """One GEMM with the op's 2*M*K*N FLOPs: fwd x @ w[0]^T, dgrad dy @ w[0], wgrad dy^T @ x."""
    x, w, dy = inputs
    return {"fwd": (x, w[0].mT), "dgrad": (dy, w[0]), "wgrad": (dy.t(), x)}[op]


def _dense(problem, op):
    return _cycle([(lambda a, b: lambda: torch.mm(a, b))(*_dense_operands(c, op)) for c in problem.copies])


def _dense_reference(problem, op):
    a, b = _dense_operands(problem.copies[0], op)
    compute = torch.float64 if problem.device.type == "cpu" else torch.float32
    with exact_fp32():
        return a.to(compute) @ b.to(compute)


register(Impl("dense-cublas", ("fwd", "dgrad", "wgrad"), _dense, reference=_dense_reference))
