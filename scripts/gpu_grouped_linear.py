"""GroupedLinear on the GPU: CUDA-graph replay with changing group sizes, no host sync, host overhead,
and peak memory against a per-expert nn.Linear loop. Prints a table; writes JSON to --out.

    python scripts/gpu_grouped_linear.py --out /tmp/out
    python scripts/gpu_grouped_linear.py --cpu-smoke     # no GPU: the same logic, eager, interpreter

1. capture fwd+bwd in one torch.cuda.graph with static x, dy and a static CUDA group_sizes tensor;
   replay with new sizes written into that tensor (``gs.copy_(new)``); check y, dx, dW, db against
   an fp64 nn.Linear loop each replay (plain and fuse_wgrad_accumulation modes).
2. eager fwd+bwd with CUDA group sizes under ``torch.cuda.set_sync_debug_mode("error")``.
3. host time per fwd+bwd call at G=8, M=64, K=N=64 (median of 200, no sync inside the timed loop).
4. peak memory of fwd+bwd at G=8, M=4096, K=N=1024 bf16 against a per-expert nn.Linear loop.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

G_REPLAY = 8
SIZES_REPLAY = (  # each sums to <= M_REPLAY: empty groups, one hot expert, a zero tail, an all-tail
    [64, 0, 40, 100, 12, 0, 30, 10],
    [256, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 200],
    [20, 20, 20, 20, 20, 20, 20, 20],
    [0, 0, 0, 0, 0, 0, 0, 0],
    [33, 1, 0, 77, 5, 64, 0, 11],
)


def check_replays(device: str, dtype: torch.dtype, fuse: bool, capture: bool) -> list[dict]:
    """Section 1: one captured fwd+bwd, replayed for every entry of SIZES_REPLAY."""
    from moegemm.testing import REL_TOL, linear_loop_reference, relerr
    from moegemm.torch import GroupedLinear

    M, K, N = 256, 96, 80
    torch.manual_seed(0)
    module = GroupedLinear(G_REPLAY, K, N, dtype=dtype, device=device, fuse_wgrad_accumulation=fuse)
    if fuse:
        module.weight.main_grad = torch.zeros(G_REPLAY, N, K, device=device)
    x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device=device, dtype=dtype)
    gs = torch.tensor(SIZES_REPLAY[0], dtype=torch.int32, device=device)

    def step():
        y = module(x, gs)
        y.backward(dy)
        return y

    if capture:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (Triton compiles) on a side stream, as capture wants
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        module.zero_grad(set_to_none=True)
        x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = step()  # .grad tensors are allocated in the graph pool and rewritten each replay
        run = graph.replay
    else:

        def run():  # the eager stand-in: the same static tensors, fresh gradients each call
            nonlocal static_y
            module.zero_grad(set_to_none=True)
            x.grad = None
            static_y = step()

        static_y = None

    rows = []
    tol = REL_TOL[dtype]
    for i, sizes in enumerate(SIZES_REPLAY):
        gs.copy_(torch.tensor(sizes, dtype=torch.int32))
        with torch.no_grad():
            x.normal_()
            dy.normal_()
        if fuse:
            module.weight.main_grad.zero_()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        ry, rdx, rdw, rdb = linear_loop_reference(module.weight, module.bias, x, sizes, dy)
        dw = module.weight.main_grad if fuse else module.weight.grad
        errs = {
            "y": relerr(static_y.detach().cpu(), ry),
            "dx": relerr(x.grad.cpu(), rdx),
            "dW": relerr(dw.cpu(), rdw),
            "db": relerr(module.bias.grad.cpu(), rdb),
        }
        owned = sum(sizes)
        tail_zero = bool((static_y[owned:] == 0).all()) and bool((x.grad[owned:] == 0).all())
        ok = all(e <= (REL_TOL[torch.float32] if k == "dW" and fuse else tol) for k, e in errs.items())
        rows.append(dict(section="graph-replay" if capture else "eager-replay", dtype=str(dtype), fuse=fuse,
                         replay=i, sizes=sizes, relerr=errs, tail_zero=tail_zero, ok=ok and tail_zero))  # fmt: skip
    return rows


def check_no_sync() -> list[dict]:
    """Section 2: eager fwd+bwd under set_sync_debug_mode('error'), CUDA group sizes (and a list, for info)."""
    from moegemm.torch import GroupedLinear

    M, K, N, G = 2048, 256, 512, 8
    module = GroupedLinear(G, K, N, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gs = torch.full((G,), M // G, device="cuda", dtype=torch.int32)
    module(x, gs).sum().backward()  # warm-up: Triton compiles outside the checked region
    torch.cuda.synchronize()
    rows = []
    for name, sizes, required in (("cuda-tensor", gs, True), ("list (pinned copy)", [M // G] * G, False)):
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = module(x, sizes)
            y.backward(torch.ones_like(y))
            ok, note = True, "no host sync"
        except RuntimeError as e:
            ok, note = False, str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rows.append(dict(section="no-sync", case=name, required=required, ok=ok or not required, note=note))
    return rows


def time_host_overhead(device: str, calls: int = 200, warmup: int = 20) -> list[dict]:
    """Section 3: host time per fwd+bwd call, GroupedLinear (two group_sizes kinds) vs an nn.Linear loop."""
    from moegemm.torch import GroupedLinear

    G, M, K, N = 8, 64, 64, 64
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    module = GroupedLinear(G, K, N, dtype=dtype, device=device)
    experts = nn.ModuleList(nn.Linear(K, N, dtype=dtype, device=device) for _ in range(G))
    sizes = [M // G] * G
    gs = torch.tensor(sizes, dtype=torch.int32, device=device)
    x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device=device, dtype=dtype)

    def loop_call():
        torch.cat([lin(part) for lin, part in zip(experts, x.split(sizes))]).backward(dy)

    variants = {
        "GroupedLinear, device group_sizes": lambda: module(x, gs).backward(dy),
        "GroupedLinear, list group_sizes": lambda: module(x, sizes).backward(dy),
        "nn.Linear loop (host sizes)": loop_call,
    }
    rows = []
    for name, call in variants.items():
        times = []
        for i in range(warmup + calls):
            module.zero_grad(set_to_none=True)
            experts.zero_grad(set_to_none=True)
            x.grad = None
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times.append(elapsed)
        if device == "cuda":
            torch.cuda.synchronize()
        rows.append(dict(section="host-overhead", case=name, shape=f"G={G} M={M} K={K} N={N} {dtype}",
                         us_per_call=statistics.median(times) * 1e6, ok=True))  # fmt: skip
    return rows


def measure_peak_memory() -> list[dict]:
    """Section 4: peak allocated bytes over fwd+bwd, above the live inputs and parameters."""
    from moegemm import shapes
    from moegemm.torch import GroupedLinear

    G, M, K, N = 8, 4096, 1024, 1024
    dtype = torch.bfloat16
    sizes = shapes.group_sizes(M, G, seed=0)
    module = GroupedLinear(G, K, N, dtype=dtype, device="cuda")
    experts = nn.ModuleList(nn.Linear(K, N, dtype=dtype, device="cuda") for _ in range(G))
    with torch.no_grad():
        for g, lin in enumerate(experts):
            lin.weight.copy_(module.weight[g])
            lin.bias.copy_(module.bias[g])
    gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=dtype)

    def grouped():
        module(x, gs).backward(dy)

    def loop():
        torch.cat([lin(part) for lin, part in zip(experts, x.split(sizes))]).backward(dy)

    peaks = {}
    for name, call in (("GroupedLinear", grouped), ("nn.Linear loop", loop)):
        for measured in (False, True):  # the first run compiles/loads kernels and fills caches
            module.zero_grad(set_to_none=True)
            experts.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            call()
            torch.cuda.synchronize()
            if measured:
                peaks[name] = torch.cuda.max_memory_allocated() - base
    ratio = peaks["GroupedLinear"] / peaks["nn.Linear loop"]
    return [
        dict(
            section="peak-memory",
            case=f"{name} G={G} M={M} K={K} N={N} bf16",
            peak_mib=peak / 2**20,
            ratio_vs_loop=peak / peaks["nn.Linear loop"],
            ok=name != "GroupedLinear" or ratio <= 1.0,
        )  # fmt: skip
        for name, peak in peaks.items()
    ]


def guarded(name: str, fn, *args, **kwargs) -> list[dict]:
    """Runs one section; an exception becomes a failed row, so the other sections still run."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - report every failure, keep going
        traceback.print_exc()
        return [dict(section=name, case="exception", ok=False, note=f"{type(e).__name__}: {e}")]


def print_table(rows: list[dict]) -> None:
    print(f"\n{'section':14s} {'case':58s} {'result':>28s}  ok")
    for r in rows:
        if "exception" == r.get("case"):
            case, result = "exception (traceback above)", r["note"][-28:]
        elif r["section"].endswith("replay"):
            case = f"{r['dtype'].removeprefix('torch.')} fuse={r['fuse']} replay {r['replay']} {r['sizes']}"
            result = f"max relerr {max(r['relerr'].values()):.2e}, tail0={r['tail_zero']}"
        elif r["section"] == "host-overhead":
            case, result = f"{r['case']} ({r['shape']})", f"{r['us_per_call']:.1f} us/call"
        elif r["section"] == "peak-memory":
            case, result = r["case"], f"{r['peak_mib']:.1f} MiB ({r['ratio_vs_loop']:.2f}x loop)"
        else:
            case, result = r.get("case", ""), r.get("note", "")[:28]
        print(f"{r['section']:14s} {case[:58]:58s} {result:>28s}  {'ok' if r['ok'] else 'FAIL'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for gpu_grouped_linear.json")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: run sections 1 and 3 eagerly on the CPU under the Triton interpreter")  # fmt: skip
    args = parser.parse_args()
    if args.cpu_smoke:
        if "triton" in sys.modules:
            raise RuntimeError("--cpu-smoke must set TRITON_INTERPRET before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("gpu_grouped_linear.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "use --cpu-smoke to exercise the logic on the CPU", file=sys.stderr)  # fmt: skip
        return 2

    import triton

    rows: list[dict] = []
    if args.cpu_smoke:
        for dtype in (torch.float32,):
            for fuse in (False, True):
                rows += guarded("eager-replay", check_replays, "cpu", dtype, fuse, capture=False)
        rows += guarded("host-overhead", time_host_overhead, "cpu", calls=3, warmup=1)
    else:
        for dtype in (torch.bfloat16, torch.float32):
            for fuse in (False, True):
                rows += guarded("graph-replay", check_replays, "cuda", dtype, fuse, capture=True)
        rows += guarded("no-sync", check_no_sync)
        rows += guarded("host-overhead", time_host_overhead, "cuda")
        rows += guarded("peak-memory", measure_peak_memory)

    env = dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu_smoke else "cpu",
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        driver=_driver_version(), python=platform.python_version(), cpu_smoke=args.cpu_smoke,
    )  # fmt: skip
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_grouped_linear.json").write_text(
        json.dumps(dict(env=env, rows=rows), indent=1, default=str)
    )
    print_table(rows)
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}: {len(rows)} rows, {len(bad)} failed; "
          f"JSON in {out_dir / 'gpu_grouped_linear.json'}")  # fmt: skip
    return 1 if bad else 0


def _driver_version() -> str | None:
    try:
        import subprocess

        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
