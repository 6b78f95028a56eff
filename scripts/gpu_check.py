"""GPU correctness run (interpreter off): the named edge cases per dtype, a >2^31-element input,
and a no-host-sync check. Prints relerr per case and the worst per dtype; writes JSON to --out.

    python scripts/gpu_check.py --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cases import edge_cases, invalid_sizes  # noqa: E402

from moegemm.testing import REL_TOL, relerr  # noqa: E402
from moegemm.torch import k_grouped_mm, k_grouped_mm_reference, m_grouped_mm, m_grouped_mm_reference  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def ref_m(x, w, gs):
    return m_grouped_mm_reference(x, w, gs, out_dtype=torch.float64, compute_dtype=torch.float64)


def ref_k(a, b, gs):
    return k_grouped_mm_reference(a, b, gs, out_dtype=torch.float64, compute_dtype=torch.float64)


def run_cases() -> list[dict]:
    rows = []
    cases = [(n, M, K, N, s) for n, M, K, N, s in edge_cases()]
    cases += [(n, M, 40, 56, s) for n, M, s in invalid_sizes()]
    cases += [("moe-skewed-128x", 4096, 512, 384, None)]
    for name, M, K, N, sizes in cases:
        if sizes is None:
            from moegemm.shapes import group_sizes

            sizes = group_sizes(M, 32, seed=7)
        print(f"case {name} M={M} K={K} N={N} G={len(sizes)}", flush=True)
        for dtype in DTYPES:
            gs = torch.tensor(sizes, dtype=torch.int64, device="cuda")
            x = torch.randn(M, K, device="cuda").to(dtype)
            for layout in ("nn-linear", "k-major"):
                w = (torch.randn(len(sizes), N, K, device="cuda").to(dtype).mT if layout == "nn-linear"
                     else torch.randn(len(sizes), K, N, device="cuda").to(dtype))  # fmt: skip
                out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
                out = m_grouped_mm(x, w, gs)
                err = relerr(out.cpu(), ref_m(x.cpu(), w.cpu(), gs.cpu()))
                rows.append(dict(op="m_grouped", case=name, layout=layout, dtype=str(dtype), relerr=err,
                                 ok=err <= REL_TOL[dtype]))  # fmt: skip
            b = torch.randn(M, N, device="cuda").to(dtype)
            for out_dtype in (torch.float32, torch.bfloat16):
                out = k_grouped_mm(x, b, gs, out_dtype=out_dtype)
                err = relerr(out.cpu(), ref_k(x.cpu(), b.cpu(), gs.cpu()))
                rows.append(dict(op="k_grouped", case=name, layout=f"out={out_dtype}", dtype=str(dtype),
                                 relerr=err, ok=err <= REL_TOL[out_dtype]))  # fmt: skip
            main_grad = torch.randn(len(sizes), K, N, device="cuda")
            want = main_grad.cpu().double() + ref_k(x.cpu(), b.cpu(), gs.cpu())
            k_grouped_mm(x, b, gs, out=main_grad, accumulate=True)
            err = relerr(main_grad.cpu(), want)
            rows.append(dict(op="k_grouped", case=name, layout="accumulate", dtype=str(dtype), relerr=err,
                             ok=err <= REL_TOL[torch.float32]))  # fmt: skip
    return rows


def run_int64_case() -> dict:
    """x with more than 2^31 elements: the last group's rows sit past the int32 element range."""
    M, K, N = 262_400, 8192, 64
    x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    x[-512:].normal_()
    x[:-512].zero_()  # only the last group's rows matter here; random data there, zero elsewhere
    w = torch.randn(2, N, K, device="cuda", dtype=torch.bfloat16)
    gs = torch.tensor([M - 300, 300], device="cuda")
    out = m_grouped_mm(x, w.mT, gs)
    ref = x[-300:].double() @ w[1].double().T
    err_m = relerr(out[-300:].cpu(), ref.cpu())
    dw = k_grouped_mm(x, torch.randn(M, N, device="cuda", dtype=torch.bfloat16), gs)
    return dict(op="int64", case=f"x {M}x{K} = {M * K / 2**31:.2f} * 2^31 elements", relerr=err_m,
                ok=err_m <= REL_TOL[torch.bfloat16] and bool(torch.isfinite(dw).all()))  # fmt: skip


def run_no_sync_check() -> dict:
    M, K, N, G = 2048, 256, 512, 8
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gs = torch.full((G,), M // G, device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = m_grouped_mm(x, w.mT, gs)
        out.backward(torch.ones_like(out))
        k_grouped_mm(x.detach(), out.detach(), gs, out_dtype=torch.bfloat16)
        ok, msg = True, "no host sync under set_sync_debug_mode('error')"
    except RuntimeError as e:
        ok, msg = False, str(e)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return dict(op="no-sync", case="fwd+bwd+k_grouped with CUDA group_sizes", relerr=0.0, ok=ok, note=msg)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--skip-cases", action="store_true",
                        help="only the int64 and no-sync checks (pytest on the GPU runs the edge cases)")
    args = parser.parse_args()
    rows = [] if args.skip_cases else run_cases()
    print("int64 case", flush=True)
    rows.append(run_int64_case())
    rows.append(run_no_sync_check())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                                             indent=1))  # fmt: skip
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print("FAIL", r)
    worst: dict[str, float] = {}
    for r in rows:
        if "dtype" in r:
            worst[r["dtype"]] = max(worst.get(r["dtype"], 0.0), r["relerr"])
    print(f"device: {torch.cuda.get_device_name()}; {len(rows)} checks, {len(bad)} failed")
    for dtype, err in worst.items():
        print(f"worst relerr {dtype}: {err:.3e}")
    for r in rows[-2:]:
        print(r)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
