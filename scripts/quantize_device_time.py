"""GPU: device time (CUPTI) of ``quantize_fp8(x, recipe, group_sizes, transpose=True)`` on every suite
activation x [M, K] (bf16, Dirichlet-skewed group sizes), as the bench's quantize column counts bytes
(2 read + 2 written per element). Writes $OUT/quantize_device.json.

    python scripts/quantize_device_time.py [case ...]
"""

import json
import os
import sys

import torch

from moegemm import shapes
from moegemm.bench import roofline, timing
from moegemm.torch.fp8 import quantize_fp8

rows = []
for case in [shapes.get(n) for n in sys.argv[1:]] or shapes.SUITE:
    gs = torch.tensor(shapes.group_sizes(case.M, case.G, seed=0), dtype=torch.int32, device="cuda")
    x = torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16)
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        call = lambda x=x, recipe=recipe, gs=gs: quantize_fp8(x, recipe, group_sizes=gs, transpose=True)  # noqa: E731
        ms = timing.device_ms(call, x.device)
        pct = 100 * 4 * case.M * case.K / (ms / 1e3) / roofline.PEAK_BYTES_PER_S
        rows.append(dict(case=case.name, recipe=recipe, device_ms=ms, pct_of_peak=pct))
        print(f"{case.name:20s} {recipe:10s} {ms:.4f} ms {pct:5.1f}%", flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "quantize_device.json"), "w") as f:
    json.dump(rows, f, indent=1)
