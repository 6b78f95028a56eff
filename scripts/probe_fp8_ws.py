"""GPU probe (H100): the warp-specialized Gluon FP8 m-grouped GEMM (moegemm.kernels.m_grouped_fp8_ws)
against the Triton kernel, promoted and fast-accumulating.

Each variant runs in a child process with a timeout (a barrier protocol bug hangs, it does not crash).
A child quantizes x (randn with 100x outliers, one element in 500) and w with moegemm's quantizer,
poisons the output with NaN, runs the kernel, and checks ||out - ref|| / ||ref|| against an fp32 (TF32
off) product of the dequantized operands, that rows past sum(group_sizes) are exactly 0 and that no
NaN is left; then times it (triton.testing.do_bench, median of CUDA-event times) against
moegemm.torch.fp8.m_grouped_mm_fp8 (the Triton kernel) with fast_accum False and True.

    OUT=/tmp/probe python scripts/probe_fp8_ws.py [--quick] [--stages 4 5 6] [--regs 216] [--fence 1]

Prints and appends JSON lines to $OUT/fp8_ws.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

OUT_DIR = os.environ.get("OUT", ".")
LOG = os.path.join(OUT_DIR, "fp8_ws.jsonl")
SCALINGS = {"tensorwise": 0, "rowwise": 1, "blockwise": 2}

# (name, G, M, K, N, extra): correctness cases first (tails, empty groups, one hot expert, bias,
# K not a multiple of 128, N not a multiple of the tile), then suite shapes for timing.
CHECKS = [
    dict(name="small-tail", G=4, M=1000, K=256, N=384, tail=37, empty=1, bias=True),
    dict(name="k-uneven", G=6, M=777, K=2880, N=200, tail=5, empty=2, bias=False),
    dict(name="one-hot", G=8, M=640, K=512, N=256, sizes=[0, 0, 640, 0, 0, 0, 0, 0], bias=True),
    dict(name="all-empty", G=3, M=64, K=128, N=128, sizes=[0, 0, 0], bias=False),
]
PERF = [
    "dsv3-ep8-fc1",
    "dsv3-ep8-fc2",
    "qwen3-30b-fc1",
    "gptoss-120b-fc1",
    "mixtral-fc1",
    "finegrain-e256-fc2",
]


def record(**kw) -> None:
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    print(json.dumps(kw), flush=True)
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


def child(desc: dict) -> None:
    import torch
    import triton
    import triton.testing

    from moegemm import shapes
    from moegemm.kernels.m_grouped_fp8_ws import m_grouped_mm_fp8_ws_kernel
    from moegemm.torch import _launch_fp8
    from moegemm.torch.fp8 import m_grouped_mm_fp8, quantize_fp8

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda"
    G, M, K, N = desc["G"], desc["M"], desc["K"], desc["N"]
    recipe = desc["recipe"]
    gen = torch.Generator(device=dev).manual_seed(desc.get("seed", 0))
    x = torch.randn(M, K, device=dev, generator=gen)
    idx = torch.randint(0, M * K, (max(1, M * K // 500),), device=dev, generator=gen)
    x.view(-1)[idx] *= 100.0
    x = x.to(torch.bfloat16)
    w = (torch.randn(G, N, K, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
    sizes = desc.get("sizes") or shapes.group_sizes(
        M - desc.get("tail", 0), G, seed=1, empty=desc.get("empty")
    )
    gs = torch.tensor(sizes, dtype=torch.int32, device=dev)
    bias = torch.randn(G, N, device=dev, generator=gen).to(torch.bfloat16) if desc.get("bias") else None
    x_q = quantize_fp8(x, recipe, group_sizes=gs)
    w_q = quantize_fp8(w, recipe)
    out = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)

    bm, bn, bk = 128, desc.get("block_n", 128), 128
    stages, regs, fence = desc["stages"], desc["regs"], bool(desc["fence"])
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    programs = max(1, min((triton.cdiv(M, bm) + G + 1) * triton.cdiv(N, bn), sms))
    xd, sx, wd, sw = x_q.data, x_q.scale, w_q.data, w_q.scale

    def ws():
        sb = (0, 0) if bias is None else bias.stride()
        m_grouped_mm_fp8_ws_kernel[(programs,)](
            xd, wd, sx, sw, gs, sx if bias is None else bias, out, M, N, K, G,
            xd.stride(0), wd.stride(0), wd.stride(1), *out.stride(), *sb,
            *_launch_fp8._m_scale_strides(recipe, sx, sw),
            NUM_PROGRAMS=programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=desc.get("group_m", 8),
            BLOCK_G=max(16, triton.next_power_of_2(G + 1)), EVEN_K=K % bk == 0, HAS_BIAS=bias is not None,
            SCALING=SCALINGS[recipe], SCALE_BLOCK=128, NUM_STAGES=stages, CONSUMER_REGS=regs,
            PROXY_FENCE=fence, num_warps=4, maxnreg=168,
        )  # fmt: skip
        return out

    ws()
    torch.cuda.synchronize()
    owned = sum(sizes)
    res = dict(desc)
    res.pop("sizes", None)
    if desc.get("check", True):
        xf, wf = x_q.dequantize(torch.float32), w_q.dequantize(torch.float32)
        ref = torch.zeros(M, N, device=dev)
        r = 0
        for g, n in enumerate(sizes):
            if n:
                ref[r : r + n] = xf[r : r + n] @ wf[g].T + (0 if bias is None else bias[g].float())
            r += n
        o = out.float()
        res["nan"] = int(torch.isnan(o).sum())
        res["tail_nonzero"] = int((o[owned:] != 0).sum())
        err = (torch.nan_to_num(o[:owned], nan=1e30) - ref[:owned]).norm() / ref[:owned].norm().clamp_min(
            1e-30
        )
        res["relerr"] = float(err)
        res["ok"] = res["nan"] == 0 and res["tail_nonzero"] == 0 and (owned == 0 or res["relerr"] < 2e-3)
    if desc.get("time"):
        flops = 2 * owned * K * N
        ms = triton.testing.do_bench(ws, warmup=10, rep=100, return_mode="median")
        res["ws_ms"], res["ws_tflops"] = ms, flops / ms * 1e-9
        for fast in (False, True):
            fn = lambda fast=fast: m_grouped_mm_fp8(x_q, w_q, gs, bias=bias, fast_accum=fast)  # noqa: E731
            ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
            key = "triton_fast" if fast else "triton_promoted"
            res[key + "_ms"], res[key + "_tflops"] = ms, flops / ms * 1e-9
        res["speedup_vs_promoted"] = res["triton_promoted_ms"] / res["ws_ms"]
    record(**res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stages", type=int, nargs="+", default=[5])
    ap.add_argument("--regs", type=int, nargs="+", default=[216])
    ap.add_argument("--fence", type=int, nargs="+", default=[1])
    ap.add_argument("--block-n", type=int, nargs="+", default=[128], help="each with its --stages entry")
    ap.add_argument("--recipes", nargs="+", default=["blockwise", "tensorwise", "rowwise"])
    ap.add_argument("--cases", nargs="+", default=PERF)
    ap.add_argument("--timeout", type=int, default=90)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    os.makedirs(OUT_DIR, exist_ok=True)
    from moegemm import shapes

    jobs = []
    for recipe in args.recipes:
        for c in CHECKS:
            for bn, st in zip(args.block_n, args.stages):
                jobs.append(
                    dict(c, recipe=recipe, block_n=bn, stages=st, regs=args.regs[0], fence=args.fence[0])
                )
    for name in args.cases if not args.quick else args.cases[:1]:
        case = shapes.get(name)
        for recipe in args.recipes if not args.quick else ["blockwise"]:
            for bn, st in zip(args.block_n, args.stages):
                for regs in args.regs:
                    for fence in args.fence:
                        jobs.append(
                            dict(name=name, G=case.G, M=case.M, K=case.K, N=case.N, recipe=recipe, block_n=bn, stages=st,
                                 regs=regs, fence=fence, time=True)
                        )  # fmt: skip
    for job in jobs:
        try:
            p = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(job)],
                timeout=args.timeout,
                capture_output=True,
                text=True,
            )
            if p.returncode:
                record(**job, error=(p.stderr or p.stdout)[-1500:])
            else:
                print(p.stdout.strip(), flush=True)
        except subprocess.TimeoutExpired:
            record(**job, error=f"timeout after {args.timeout} s (hang)")


if __name__ == "__main__":
    main()
