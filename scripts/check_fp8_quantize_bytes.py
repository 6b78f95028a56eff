"""GPU check: the quantize kernels' bytes equal the twin's over many widths (K multiple of 16 or not),
for activations and weights, every recipe, with the allocator poisoned by 0x7f (NaN in e4m3).
Writes $OUT/quantize_bytes.json; exits 1 on any mismatch in the region a GEMM reads."""

import json
import os
import sys

import torch

from moegemm import fp8, shapes
from moegemm.torch.fp8 import quantize_fp8

bad, rows = 0, []
for dtype in (torch.float32, torch.bfloat16):
    for C in (16, 32, 40, 48, 64, 96, 128, 200, 256, 512, 1024):
        for recipe in fp8.RECIPES:
            torch.full((64 << 20,), 0x7F, dtype=torch.uint8, device="cuda")  # freed at once: poison
            M, G = 300, 6
            sizes = list(shapes.group_sizes(M, G, seed=C, empty=2))
            x = torch.randn(M, C) * 3
            x.view(-1)[:: max(1, M * C // 50)] *= 100
            x = x.to(dtype)
            w = (torch.randn(3, 80, C) * 0.05).to(dtype)
            for kind, t, gs in (("act", x, sizes), ("weight", w, None)):
                g_dev = None if gs is None else torch.tensor(gs, dtype=torch.int32, device="cuda")
                g_cpu = None if gs is None else torch.tensor(gs)
                q = quantize_fp8(t.cuda(), recipe, group_sizes=g_dev, transpose=True)
                r = quantize_fp8(t, recipe, group_sizes=g_cpu, transpose=True, backend="reference")
                for f in ("data", "data_t"):
                    a, b = getattr(q, f).cpu().view(torch.uint8), getattr(r, f).view(torch.uint8)
                    if kind == "act" and f == "data_t":
                        used = sum(fp8.cdiv(s, 16) * 16 for s in gs)  # the columns a wgrad reads
                        a, b = a[:, :used], b[:, :used]
                    n = int((a != b).sum())
                    bad += n
                    rows.append(dict(dtype=str(dtype), C=C, recipe=recipe, kind=kind, field=f, mismatches=n))
                for f in ("scale", "scale_t"):
                    a, b = getattr(q, f), getattr(r, f)
                    if kind == "act" and f == "scale_t" and recipe == "blockwise":
                        used = sum(fp8.cdiv(s, 128) for s in gs)  # block rows of the groups
                        a, b = a[:used], b[:used]
                    if a is not None and a.numel():
                        n = int((a.cpu() != b).sum())
                        bad += n
                        rows.append(
                            dict(dtype=str(dtype), C=C, recipe=recipe, kind=kind, field=f, mismatches=n)
                        )
summary = [r for r in rows if r["mismatches"]]
print("mismatching:", summary if summary else "none", f"({len(rows)} checks)")
with open(os.path.join(os.environ.get("OUT", "."), "quantize_bytes.json"), "w") as f:
    json.dump(rows, f)
sys.exit(1 if bad else 0)
