"""GPU probe: where the grouped FP8 quantize's device time goes, kernel by kernel (CUPTI trace).

For each case's activation x [M, K] and recipe, runs ``quantize_fp8(x, recipe, group_sizes=gs,
transpose=True)`` 20 times under torch.profiler and prints each kernel's mean time per call and the
bandwidth of its own traffic (bytes it must read and write). Writes $OUT/quantize_kernels.json.

    python scripts/probe_fp8_quantize_kernels.py [case ...]
"""

import collections
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from moegemm import shapes
from moegemm.torch.fp8 import quantize_fp8

CALLS = 20
DEVICE_CUDA = torch.autograd.DeviceType.CUDA


def main(names: list[str]) -> None:
    rows = []
    for name in names:
        case = shapes.get(name)
        M, K, G = case.M, case.K, case.G
        gs = torch.tensor(shapes.group_sizes(M, G, seed=0), dtype=torch.int32, device="cuda")
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        for recipe in ("tensorwise", "rowwise", "blockwise"):
            quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
                torch.cuda.synchronize()
            events = sorted(
                (e for e in prof.profiler.kineto_results.events() if e.device_type() == DEVICE_CUDA),
                key=lambda e: e.start_ns(),
            )
            per_call = len(events) // CALLS  # the launches of one call, in order (the tile kernel runs twice)
            per_kernel = collections.defaultdict(float)
            for i, e in enumerate(events[: per_call * CALLS]):
                per_kernel[f"{i % per_call}:{e.name()[:48]}"] += e.duration_ns() / CALLS / 1e6
            for kernel, ms in per_kernel.items():
                # amax: reads x; a data or transposed-copy launch reads x (2 B) and writes 1 B per element.
                nbytes = 2 * M * K if "amax" in kernel else 3 * M * K
                rows.append(dict(case=name, recipe=recipe, kernel=kernel, ms=ms, GBps=nbytes / ms / 1e6))
                print(f"{name:16s} {recipe:10s} {kernel:52s} {ms:7.3f} ms {nbytes / ms / 1e6:6.0f} GB/s")
    with open(os.path.join(os.environ.get("OUT", "."), "quantize_kernels.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:] or ["dsv3-ep8-fc1", "qwen3-30b-fc1"])
