"""What the fused bias costs on the GPU (bf16, CUDA-event medians via triton.testing.do_bench).

fwd:   m_grouped_mm with bias in the epilogue  vs  without bias  vs  torch._grouped_mm + a gathered bias add
wgrad: k-grouped with fused dbias (one launch)  vs  without dbias  vs  torch._grouped_mm + index_add dbias

    python scripts/bias_fusion_probe.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from moegemm import shapes
from moegemm.testing import relerr
from moegemm.torch import _ops, m_grouped_mm
from moegemm.torch.reference import grouped_column_sums, m_grouped_mm_reference


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def probe(case: shapes.Case) -> list[dict]:
    rows = []
    G, M, K, N = case.G, case.M, case.K, case.N
    sizes = shapes.group_sizes(M, G, seed=0)
    gs = torch.tensor(sizes, device="cuda", dtype=torch.int32)
    offs = torch.cumsum(gs, 0, dtype=torch.int32)
    row_group = torch.repeat_interleave(torch.arange(G, device="cuda"), gs.long(), output_size=M)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(G, N, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    # Correctness before timing: the whole problem against fp64-accumulated references, once.
    y = m_grouped_mm(x, w.mT, gs, bias=bias)
    ref = m_grouped_mm_reference(x, w.mT, gs, bias, out_dtype=torch.float64)
    _, dbias = _ops.k_grouped_colsum(dy, x, gs, torch.bfloat16, torch.bfloat16, "triton")
    dbias_ref = grouped_column_sums(dy, gs, out_dtype=torch.float64)
    errs = {"fwd": relerr(y, ref), "dbias": relerr(dbias, dbias_ref)}
    timings = {
        "fwd+bias moegemm (fused)": lambda: m_grouped_mm(x, w.mT, gs, bias=bias),
        "fwd moegemm (no bias)": lambda: m_grouped_mm(x, w.mT, gs),
        "fwd+bias torch._grouped_mm + bias[row_group] add": lambda: torch._grouped_mm(x, w.mT, offs=offs).add_(
            bias[row_group]
        ),
        "wgrad+dbias moegemm (fused)": lambda: _ops.k_grouped_colsum(
            dy, x, gs, torch.bfloat16, torch.bfloat16, "triton"
        ),
        "wgrad moegemm (no dbias)": lambda: _ops.k_grouped(dy, x, gs, torch.bfloat16, "triton"),
        "wgrad+dbias torch._grouped_mm + index_add": lambda: (
            torch._grouped_mm(dy.T, x, offs=offs),
            torch.zeros(G, N, device="cuda", dtype=torch.float32).index_add_(0, row_group, dy.float()),
        ),
    }
    for name, fn in timings.items():
        ms = bench(fn)
        row = {"case": case.name, "variant": name, "ms": ms, "tflops": case.flops / ms / 1e9}
        rows.append(row)
        print(f"{case.name:18s} {name:50s} {ms * 1e3:8.1f} us {row['tflops']:7.1f} TF/s", flush=True)
    rows.append({"case": case.name, "relerr": errs})
    print(case.name, "relerr", errs, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="dsv3-ep8-fc1,qwen3-30b-fc1,mixtral-fc1")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [row for case in map(shapes.get, args.cases.split(",")) for row in probe(case)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
