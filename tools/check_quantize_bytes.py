"""Do the FP8 quantize kernels write exactly what the reference twin writes, over many widths?

Usage:
    python tools/check_quantize_bytes.py [--widths 16,40,128,200] [--out quantize_bytes.json]

For activations [M, K] (Dirichlet group sizes with empty groups) and weights [G, N, K], every recipe,
input dtypes fp32 and bf16, and widths K that are multiples of 16 or not, it quantizes with
``transpose=True`` through the kernels (``backend="auto"``) and through the reference twin
(``backend="reference"``), then compares bit for bit: ``data`` and ``scale``, and the transposed copy
as the GEMMs read it (``dequantize_t()``, which reads only the rows and columns the groups own). Inputs
carry outliers (every 50th element x100), and on a GPU the allocator is first filled with 0x7f (NaN in
e4m3), so a byte the kernel forgot to write shows up. Exit status 1 on any mismatch.

On a GPU this checks the compiled kernels; without one it sets TRITON_INTERPRET=1 and checks them
under the interpreter (slow: pass fewer ``--widths``). Uses the public API only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

RECIPES = ("tensorwise", "rowwise", "blockwise")
WIDTHS = (16, 32, 40, 48, 64, 96, 128, 200, 256, 512, 1024)


def mismatches(a, b) -> int:
    """Elements that differ bit for bit (NaN == NaN when the bits agree); a shape change counts all."""
    import torch

    if a is None or b is None:
        return 0 if a is b else 1
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.shape != b.shape:
        return max(a.numel(), b.numel(), 1)
    if a.dtype.is_floating_point and a.element_size() == 4:
        return int((a.view(torch.int32) != b.view(torch.int32)).sum())
    return int((a.view(torch.uint8) != b.view(torch.uint8)).sum())


def check(widths, device) -> list[dict]:
    import torch

    from moegemm import shapes
    from moegemm.torch import quantize_fp8

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for C in widths:
            for recipe in RECIPES:
                if device.type == "cuda":  # freed at once: the next allocations start as NaN bytes
                    torch.full((64 << 20,), 0x7F, dtype=torch.uint8, device=device)
                M, G = 300, 6
                sizes = shapes.group_sizes(M, G, seed=C, empty=2)
                x = torch.randn(M, C) * 3
                x.view(-1)[:: max(1, M * C // 50)] *= 100
                w = torch.randn(3, 80, C) * 0.05
                for kind, t, gs in (("act", x.to(dtype), sizes), ("weight", w.to(dtype), None)):
                    kw = {} if gs is None else {"group_sizes": torch.tensor(gs, dtype=torch.int32)}
                    ref = quantize_fp8(t, recipe, transpose=True, backend="reference", **kw)
                    kw = {k: v.to(device) for k, v in kw.items()}
                    got = quantize_fp8(t.to(device), recipe, transpose=True, **kw)
                    for field, a, b in (
                        ("data", got.data, ref.data),
                        ("scale", got.scale, ref.scale),
                        ("dequantize_t", got.dequantize_t(), ref.dequantize_t()),
                    ):
                        n = mismatches(a, b)
                        rows.append(
                            dict(dtype=str(dtype), K=C, recipe=recipe, kind=kind, field=field, mismatches=n)
                        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="comma-separated K values")
    p.add_argument("--out", help="also write every check as JSON here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before moegemm first imports triton
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = check([int(v) for v in args.widths.split(",") if v.strip()], device)
    bad = [r for r in rows if r["mismatches"]]
    for r in bad:
        print(f"MISMATCH {r}")
    print(f"{len(bad)} of {len(rows)} checks mismatch ({device.type})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
