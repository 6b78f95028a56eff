"""GPU probe (H100): the warp-specialized Gluon FP8 wgrad (moegemm.kernels.k_grouped_fp8_ws) against
the Triton k-grouped kernel, per tile width.

Each (case, recipe) runs in a child process with a timeout (a barrier protocol bug hangs, it does not
crash). A child quantizes dy and x (randn with 100x outliers, one element in 500; Dirichlet group
sizes with empty groups and a tail) with their transposed copies, and for each variant (the Triton
kernel, and the warp-specialized one at each --block-n) runs ``moegemm.torch.fp8.k_grouped_mm_fp8``
into a NaN-poisoned dW, checks ||dW - ref|| / ||ref|| against an fp32 (TF32 off) product of the
dequantized copies and that no NaN is left, then times it (triton.testing.do_bench, median of
CUDA-event times), with and without accumulating into an fp32 main_grad.

    OUT=/tmp/probe python scripts/probe_fp8_wgrad_ws.py [--cases ...] [--recipes ...] [--block-n 256 128]

Prints and appends JSON lines to $OUT/fp8_wgrad_ws.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

OUT_DIR = os.environ.get("OUT", ".")
LOG = os.path.join(OUT_DIR, "fp8_wgrad_ws.jsonl")
PERF = ["dsv3-ep8-fc1", "dsv3-ep8-fc2", "qwen3-30b-fc1", "gptoss-120b-fc1", "mixtral-fc1"]
STAGES = {256: (4, 216), 128: (6, 200)}


def record(**kw) -> None:
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    print(json.dumps(kw), flush=True)
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


def child(desc: dict) -> None:
    import torch
    import triton.testing

    from moegemm import configs, shapes
    from moegemm.torch import _launch_fp8
    from moegemm.torch.fp8 import k_grouped_mm_fp8, quantize_fp8

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda"
    case = shapes.get(desc["name"])
    G, M, K, N, recipe = case.G, case.M, case.K, case.N, desc["recipe"]
    gen = torch.Generator(device=dev).manual_seed(0)

    def act(cols):
        t = torch.randn(M, cols, device=dev, generator=gen)
        idx = torch.randint(0, M * cols, (max(1, M * cols // 500),), device=dev, generator=gen)
        t.view(-1)[idx] *= 100.0
        return t.to(torch.bfloat16)

    sizes = shapes.group_sizes(M - 37, G, seed=1, empty=max(1, G // 16))
    gs = torch.tensor(sizes, dtype=torch.int32, device=dev)
    x_q = quantize_fp8(act(K), recipe, group_sizes=gs, transpose=True)
    dy_q = quantize_fp8(act(N), recipe, group_sizes=gs, transpose=True)
    # Reference dW [G, N, K] in fp32 from the dequantized transposed copies.
    dyt, xt = dy_q.dequantize_t(torch.float32), x_q.dequantize_t(torch.float32)  # [M, N], [M, K]
    ref = torch.zeros(G, N, K, device=dev)
    r = 0
    for g, n in enumerate(sizes):
        if n:
            ref[g] = dyt[r : r + n].T @ xt[r : r + n]
        r += n
    del dyt, xt
    flops = 2 * sum(sizes) * N * K
    variants = [("triton", None)] + [(f"ws{bn}", bn) for bn in desc["block_n"]]
    res = dict(name=case.name, recipe=recipe, G=G, M=M, N=N, K=K)
    for label, bn in variants:
        _launch_fp8.clear_launch_cache()
        _launch_fp8.FP8_WS = bn is not None
        if bn is not None:
            st, regs = STAGES[bn]
            cfg = configs.Fp8WsConfig(bn, st, 8, regs)
            _launch_fp8.configs.pick_fp8_ws_config = lambda *a, cfg=cfg, **k: cfg
        calls = []
        launch = _launch_fp8.K_GROUPED_FP8_WS.launch
        _launch_fp8.K_GROUPED_FP8_WS.launch = lambda *a, launch=launch, calls=calls: (
            calls.append(1),
            launch(*a),
        )
        out = torch.full((G, N, K), float("nan"), device=dev)
        k_grouped_mm_fp8(dy_q, x_q, gs, out=out)
        torch.cuda.synchronize()
        res[label + "_ran_ws"] = bool(calls)
        res[label + "_nan"] = int(torch.isnan(out).sum())
        res[label + "_relerr"] = float((torch.nan_to_num(out, nan=1e30) - ref).norm() / ref.norm())
        ms = triton.testing.do_bench(
            lambda out=out: k_grouped_mm_fp8(dy_q, x_q, gs, out=out), warmup=10, rep=100
        )
        res[label + "_tflops"] = flops / ms * 1e-9
        main = torch.zeros(G, N, K, device=dev)
        ms = triton.testing.do_bench(
            lambda main=main: k_grouped_mm_fp8(dy_q, x_q, gs, out=main, accumulate=True), warmup=10, rep=100
        )
        res[label + "_acc_tflops"] = flops / ms * 1e-9
        # Half the output bytes, the same number of store instructions: store-bandwidth-bound or not.
        ms = triton.testing.do_bench(
            lambda: k_grouped_mm_fp8(dy_q, x_q, gs, out_dtype=torch.bfloat16), warmup=10, rep=100
        )
        res[label + "_bf16out_tflops"] = flops / ms * 1e-9
        _launch_fp8.K_GROUPED_FP8_WS.launch = launch
        del out, main
    record(**res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--recipes", nargs="+", default=["blockwise", "tensorwise", "rowwise"])
    ap.add_argument("--cases", nargs="+", default=PERF)
    ap.add_argument("--block-n", type=int, nargs="+", default=[256, 128])
    ap.add_argument("--timeout", type=int, default=150)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    os.makedirs(OUT_DIR, exist_ok=True)
    for name in args.cases:
        for recipe in args.recipes:
            job = dict(name=name, recipe=recipe, block_n=args.block_n)
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
