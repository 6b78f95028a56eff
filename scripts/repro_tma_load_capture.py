"""GPU repro (H100): which TMA-load launches can be captured in a CUDA graph. One case per process:

    python scripts/repro_tma_load_capture.py CASE [--thread-local] [--eager-first] [--poison] [--record]
        [--zero-grad]

CASE: m-fwd, m-dgrad, k-wgrad (one launch captured on the main thread), gl-k (GroupedLinear fwd+bwd,
TMA loads in the wgrad only), gl-m (fwd/dgrad only), gl-all. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from moegemm.torch import GroupedLinear, _launch


def _without_tma(launch):
    """``launch`` with TMA loads off for its own calls."""

    def call(*args, **kwargs):
        _launch.TMA_LOAD = False
        try:
            launch(*args, **kwargs)
        finally:
            _launch.TMA_LOAD = True

    return call


def main() -> None:
    case = sys.argv[1]
    mode = "thread_local" if "--thread-local" in sys.argv else "global"
    _launch.TMA_LOAD = True
    _launch.TMA_LOAD_MIN_FLOPS = 0
    G, M, K, N = 8, 256, 96, 128
    gs = torch.tensor([64, 0, 40, 100, 12, 0, 30, 10], dtype=torch.int32, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    took = {}
    if "--poison" in sys.argv:  # as tests/conftest.py: library outputs start as NaN
        from moegemm.torch import _ops

        def nan_empty(*size, dtype=None, device=None, **kwargs):
            out = torch.empty(*size, dtype=dtype, device=device, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out

        _ops.empty = nan_empty
    if "--record" in sys.argv:  # as tests/conftest.record_launches
        for name in ("M_GROUPED", "K_GROUPED", "K_GROUPED_TMA"):
            direct = getattr(_launch, name)
            inner = direct.launch
            direct.launch = lambda *a, inner=inner, name=name: (took.setdefault(name, 0), inner(*a))
    if case.startswith("gl-"):
        import dataclasses

        from moegemm import configs

        inner_pick = configs.pick_config
        configs.pick_config = lambda op, *a, **k: (
            dataclasses.replace(inner_pick(op, *a, **k), flat=True, tma_load=True)
            if op == "k_grouped"
            else inner_pick(op, *a, **k)
        )
        if case == "gl-k":  # m-grouped launches keep cp.async
            _launch.launch_m_grouped = _without_tma(_launch.launch_m_grouped)
        if case == "gl-m":  # k-grouped launches keep cp.async
            _launch.launch_k_grouped = _without_tma(_launch.launch_k_grouped)
        module = GroupedLinear(G, K, N, dtype=torch.bfloat16, device="cuda")
        xr = x.clone().requires_grad_()

        def step():
            module(xr, gs).backward(dy)

    else:
        out_m = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        out_d = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
        out_k = torch.empty(G, N, K, device="cuda", dtype=torch.bfloat16)

        def step():
            if case == "m-fwd":
                _launch.launch_m_grouped(x, w, gs, out_m, transpose_w=True)
            elif case == "m-dgrad":
                _launch.launch_m_grouped(dy, w, gs, out_d)
            else:
                _launch.launch_k_grouped(dy, x, gs, out_k, False)

    result = dict(case=case, mode=mode, eager_first="--eager-first" in sys.argv)
    try:
        if result["eager_first"]:  # as the GroupedLinear test: one step on the default stream first
            step()
            torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if "--zero-grad" in sys.argv and case.startswith("gl-"):  # as the tests' capture_step
            module.zero_grad(set_to_none=True)
            xr.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=mode):
            step()
        graph.replay()
        torch.cuda.synchronize()
        result["ok"] = True
    except Exception as e:
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        result["where"] = traceback.format_exc().splitlines()[-6:-4]
        with open(os.path.join(os.environ.get("OUT", "."), f"capture-{case}.txt"), "a") as f:
            f.write(" ".join(sys.argv) + "\n" + traceback.format_exc() + "\n")
    result["took"] = took
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
