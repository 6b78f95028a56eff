"""First look at the FP8 kernels on a GPU: correctness on suite shapes, then device time per config.

Not the benchmark (``python -m moegemm.bench --fp8`` is): a probe that prints one JSON line per
measurement, to choose default configs and see where the kernels stand. Usage:
    python benchmarks/fp8_probe.py [--cases dsv3-ep8-fc1,qwen3-30b-fc1] [--configs] > probe.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import triton.testing

from moegemm import configs, shapes
from moegemm.torch import _launch_fp8, m_grouped_mm
from moegemm.torch.fp8 import k_grouped_mm_fp8, m_grouped_mm_fp8, quantize_fp8


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def relerr(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def grouped_ref(a, b_t_per_group, sizes):
    out = torch.zeros(a.shape[0], b_t_per_group.shape[1], dtype=torch.float32, device=a.device)
    s = 0
    for g, n in enumerate(sizes):
        if n:
            out[s : s + n] = a[s : s + n] @ b_t_per_group[g].T
        s += n
    return out


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def probe_case(case: shapes.Case, recipes, try_configs: bool) -> None:
    G, M, K, N = case.G, case.M, case.K, case.N
    sizes = shapes.group_sizes(M, G, seed=0)
    gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(G, N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", generator=gen, dtype=torch.bfloat16)
    flops = 2 * M * N * K
    bf16_fwd = bench(lambda: m_grouped_mm(x, w.mT, gs))
    emit(case=case.name, impl="moegemm-bf16", op="fwd", ms=bf16_fwd, tflops=flops / bf16_fwd / 1e9)
    # torch._scaled_grouped_mm rowwise, the only SM90 FP8 grouped recipe in torch.
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    xq_r = quantize_fp8(x, "rowwise")
    wq_r = quantize_fp8(w, "rowwise")
    xd, wd = xq_r.data.contiguous(), wq_r.data.contiguous()
    try:
        t = bench(
            lambda: torch._scaled_grouped_mm(
                xd,
                wd.transpose(-2, -1),
                xq_r.scale,
                wq_r.scale,
                offs=offs,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
        )
        emit(case=case.name, impl="torch._scaled_grouped_mm", op="fwd", ms=t, tflops=flops / t / 1e9)
    except Exception as e:  # noqa: BLE001
        emit(case=case.name, impl="torch._scaled_grouped_mm", op="fwd", error=repr(e)[:300])
    for recipe in recipes:
        for fast in [False, True] if recipe != "blockwise" else [False]:
            tag = f"{recipe}{'-fast' if fast else ''}"
            x_q = quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
            w_q = quantize_fp8(w, recipe, transpose=True)
            dy_q = quantize_fp8(dy, recipe, group_sizes=gs, transpose=True)
            torch.cuda.synchronize()
            out = m_grouped_mm_fp8(x_q, w_q, gs, fast_accum=fast)
            ref = grouped_ref(x_q.dequantize(), w_q.dequantize(), sizes)
            err_fwd = relerr(out.float(), ref)
            dx = m_grouped_mm_fp8(dy_q, w_q.t(), gs, fast_accum=fast)
            ref = grouped_ref(dy_q.dequantize(), w_q.t().dequantize(), sizes)
            err_dgrad = relerr(dx.float(), ref)
            dw = k_grouped_mm_fp8(dy_q, x_q, gs, fast_accum=fast)
            a, b = dy_q.dequantize_t(), x_q.dequantize_t()
            ref = torch.stack([a[s - n : s].T @ b[s - n : s] for s, n in zip(offs.tolist(), sizes)])
            err_wgrad = relerr(dw, ref)
            del ref, a, b
            for op, fn, err in (
                ("fwd", lambda: m_grouped_mm_fp8(x_q, w_q, gs, fast_accum=fast), err_fwd),
                ("dgrad", lambda: m_grouped_mm_fp8(dy_q, w_q.t(), gs, fast_accum=fast), err_dgrad),
                ("wgrad", lambda: k_grouped_mm_fp8(dy_q, x_q, gs, fast_accum=fast), err_wgrad),
            ):
                t = bench(fn)
                emit(
                    case=case.name, impl=f"moegemm-fp8-{tag}", op=op, ms=t, tflops=flops / t / 1e9, relerr=err
                )
            if fast:
                continue
            for name, fn, nbytes in (
                ("quantize-x-t", lambda: quantize_fp8(x, recipe, group_sizes=gs, transpose=True), M * K * 4),
                ("quantize-x", lambda: quantize_fp8(x, recipe, group_sizes=gs), M * K * 3),
                ("quantize-w-t", lambda: quantize_fp8(w, recipe, transpose=True), G * N * K * 4),
            ):
                t = bench(fn)
                emit(case=case.name, impl=name, recipe=recipe, ms=t, gbps=nbytes / t / 1e6)
            if try_configs:
                for op_name, key in (("fwd", "m_grouped_fp8"), ("wgrad", "k_grouped_fp8")):
                    table = configs.TABLE[(key, "sm90")]
                    for i, (cfg, _why) in enumerate(list(table)):
                        configs.TABLE[(key, "sm90")] = [table[i]] + [e for j, e in enumerate(table) if j != i]
                        _launch_fp8.clear_launch_cache()
                        fn = (
                            (lambda: m_grouped_mm_fp8(x_q, w_q, gs))
                            if op_name == "fwd"
                            else (lambda: k_grouped_mm_fp8(dy_q, x_q, gs))
                        )
                        try:
                            t = bench(fn)
                            emit(
                                case=case.name,
                                impl=f"cfg-{recipe}",
                                op=op_name,
                                config=dataclasses.asdict(cfg),
                                ms=t,
                                tflops=flops / t / 1e9,
                            )
                        except Exception as e:  # noqa: BLE001
                            emit(
                                case=case.name,
                                impl=f"cfg-{recipe}",
                                op=op_name,
                                config=dataclasses.asdict(cfg),
                                error=repr(e)[:300],
                            )
                    configs.TABLE[(key, "sm90")] = table
                    _launch_fp8.clear_launch_cache()
            del x_q, w_q, dy_q
            torch.cuda.empty_cache()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="dsv3-ep8-fc1,qwen3-30b-fc1")
    parser.add_argument("--recipes", default="blockwise,tensorwise,rowwise")
    parser.add_argument("--configs", action="store_true")
    args = parser.parse_args(argv)
    for name in args.cases.split(","):
        try:
            probe_case(shapes.get(name), args.recipes.split(","), args.configs)
        except Exception as e:  # noqa: BLE001
            emit(case=name, error=repr(e)[:1000])
            print(repr(e), file=sys.stderr)
            raise


if __name__ == "__main__":
    main()
