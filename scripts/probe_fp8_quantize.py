"""GPU probe: the grouped FP8 quantize (with the transposed copy) under candidate QuantizeConfigs.

For each suite case's activation x [M, K] (Dirichlet group sizes), every recipe and every candidate,
times ``quantize_fp8(x, recipe, group_sizes=gs, transpose=True)`` (device time from a CUPTI trace, and
the back-to-back CUDA-event median, after a check
that data and scale equal the first candidate's bit for bit) and reports GB/s counted as the issue
counts them: 2 bytes read + 2 written per element. Writes $OUT/quantize_probe.json.

With ``--kernels``: where the default config's device time goes, kernel by kernel (20 calls under
torch.profiler; each kernel's mean time per call and the bandwidth of the bytes it must move).
Writes $OUT/quantize_kernels.json.

    python scripts/probe_fp8_quantize.py [--kernels] [case ...]
"""

import collections
import dataclasses
import json
import os
import sys

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from moegemm import configs, shapes
from moegemm.bench import roofline, timing
from moegemm.torch import _launch_fp8
from moegemm.torch.fp8 import quantize_fp8

Q = configs.QuantizeConfig
CANDIDATES = [
    Q(),
    Q(t_warps=2),
    Q(t_warps=8),
    Q(t_cols=16, t_chunks=16, t_warps=2),
    Q(t_cols=64, t_chunks=4, t_warps=8),
    Q(t_cols=64, t_chunks=4, t_warps=2),
]


def use(config: configs.QuantizeConfig) -> None:
    configs.TABLE[("quantize_fp8", "sm90")] = [(config, "probe")]
    _launch_fp8._quantize_config.cache_clear()
    for launch in _launch_fp8.LAUNCHES:
        launch.clear()


RECIPES = ("tensorwise", "rowwise", "blockwise")
CALLS = 20  # per CUPTI trace


def _activations(names: list[str]):
    """(case name, x [M, K] bf16, group_sizes [G] with Dirichlet-skewed sizes) on the GPU, per case."""
    for name in names:
        case = shapes.get(name)
        gs = torch.tensor(shapes.group_sizes(case.M, case.G, seed=0), dtype=torch.int32, device="cuda")
        yield name, torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16), gs


def main(names: list[str]) -> None:
    rows = []
    for name, x, gs in _activations(names):
        M, K = x.shape
        for recipe in RECIPES:
            first = None
            for config in CANDIDATES:
                use(config)
                q = quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
                # data and scale are written whole (data_t's slack columns are not: check_fp8_quantize_bytes.py)
                got = (q.data.view(torch.uint8), q.scale)
                if first is None:
                    first = got
                same = all(torch.equal(a, b) for a, b in zip(got, first) if a is not None)
                del q, got
                fn = lambda x=x, recipe=recipe, gs=gs: quantize_fp8(x, recipe, group_sizes=gs, transpose=True)  # noqa: E731
                wall_ms = triton.testing.do_bench(fn, warmup=25, rep=100)  # back to back: max(host, device)
                ms = timing.device_ms(fn, x.device, calls=CALLS)  # the kernels' own time (CUPTI)
                gbps = 4 * M * K / ms / 1e6
                pct = 100 * gbps * 1e9 / roofline.PEAK_BYTES_PER_S
                rows.append(
                    dict(
                        case=name,
                        recipe=recipe,
                        config=dataclasses.asdict(config),
                        ms=ms,
                        wall_ms=wall_ms,
                        GBps=gbps,
                        pct_of_peak=pct,
                        same_bytes=same,
                    )  # fmt: skip
                )
                print(
                    f"{name:20s} {recipe:10s} {ms:7.3f} ms {gbps:6.0f} GB/s {pct:4.0f}% same={same} {config}"
                )
            del first
    with open(os.path.join(os.environ.get("OUT", "."), "quantize_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


def per_kernel(names: list[str]) -> None:
    rows = []
    for name, x, gs in _activations(names):
        M, K = x.shape
        for recipe in RECIPES:
            quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
                torch.cuda.synchronize()
            events = sorted(
                (
                    e
                    for e in prof.profiler.kineto_results.events()
                    if e.device_type() == timing.DEVICE_TYPE_CUDA
                ),
                key=lambda e: e.start_ns(),
            )
            per_call = len(events) // CALLS  # the launches of one call, in order (the tile kernel runs twice)
            times = collections.defaultdict(float)
            for i, e in enumerate(events[: per_call * CALLS]):
                times[f"{i % per_call}:{e.name()[:48]}"] += e.duration_ns() / CALLS / 1e6
            for kernel, ms in times.items():
                # amax: reads x; a data or transposed-copy launch reads x (2 B) and writes 1 B per element.
                nbytes = 2 * M * K if "amax" in kernel else 3 * M * K
                rows.append(dict(case=name, recipe=recipe, kernel=kernel, ms=ms, GBps=nbytes / ms / 1e6))
                print(f"{name:16s} {recipe:10s} {kernel:52s} {ms:7.3f} ms {nbytes / ms / 1e6:6.0f} GB/s")
    with open(os.path.join(os.environ.get("OUT", "."), "quantize_kernels.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--kernels"]:
        per_kernel(args[1:] or ["dsv3-ep8-fc1", "qwen3-30b-fc1"])
    else:
        main(
            args or ["dsv3-ep8-fc1", "qwen3-30b-fc1", "mixtral-fc1", "finegrain-e256-fc2", "gptoss-120b-fc1"]
        )
