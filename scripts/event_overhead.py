"""GPU probe (H100): what the bench's event clock reads for a kernel that does almost nothing.

The bench times each call with CUDA events around it after flushing the L2 (triton's do_bench, and
``timing.paired_ms``); on problems of 40-80 us the events' own reading is a visible share. This times a
one-element ``zero_`` the same two ways, and a finegrain forward on both clocks (events with the flush, and
CUPTI device time of back-to-back calls), and writes $OUT/event_overhead.json.

    OUT=/tmp/probe python scripts/event_overhead.py
"""

from __future__ import annotations

import json
import os

import torch
import triton.testing

from moegemm import shapes
from moegemm.bench import timing
from moegemm.torch import m_grouped_mm


def main() -> None:
    tiny = torch.empty(1, device="cuda")
    cfg = timing.TimingConfig()
    row = {
        "zero_1_do_bench_ms": triton.testing.do_bench(tiny.zero_, warmup=25, rep=100, return_mode="median"),
        "zero_1_paired_ms": timing.paired_ms({"z": tiny.zero_}, tiny.device, cfg, 0.005)["z"],
        "zero_1_device_ms": timing.device_ms(tiny.zero_, tiny.device),
    }
    case = shapes.get("finegrain-e64-fc1")
    gs = torch.tensor(shapes.group_sizes(case.M, case.G), dtype=torch.int32, device="cuda")
    x = torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(case.G, case.N, case.K, device="cuda", dtype=torch.bfloat16)
    fwd = lambda: m_grouped_mm(x, w.mT, gs)  # noqa: E731
    row["finegrain_e64_fwd_do_bench_ms"] = triton.testing.do_bench(
        fwd, warmup=25, rep=100, return_mode="median"
    )
    row["finegrain_e64_fwd_device_ms"] = timing.device_ms(fwd, x.device)
    row["device"] = torch.cuda.get_device_name()
    print(json.dumps(row))
    with open(os.path.join(os.environ.get("OUT", "."), "event_overhead.json"), "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
