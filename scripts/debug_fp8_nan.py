"""Debug probe (GPU): where does the tensorwise wgrad NaN of tests/test_fp8.py's dirichlet case come from?

Poisons the caching allocator with 0x7f bytes (NaN in e4m3), quantizes on the GPU and with the twin,
compares every byte of data / data_t / scales, then runs the wgrad on GPU operands and on the twin's.
"""

import dataclasses
import json
import os

import torch

from moegemm import shapes
from moegemm.torch.fp8 import k_grouped_mm_fp8, quantize_fp8

OUT = os.environ.get("OUT", ".")
log = []


def note(**kw):
    print(kw, flush=True)
    log.append(kw)


def outliers(M, K, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * scale
    idx = torch.randint(0, max(M * K, 1), (max(1, M * K // 200),), generator=gen)
    x.view(-1)[idx] *= 100
    return x


def poison():
    junk = torch.full((64 << 20,), 0x7F, dtype=torch.uint8, device="cuda")
    del junk


def diff(name, a, b):
    a = a.cpu().contiguous().view(torch.uint8) if a.dtype != torch.float32 else a.cpu()
    b = b.cpu().contiguous().view(torch.uint8) if b.dtype != torch.float32 else b.cpu()
    if a.shape != b.shape:
        note(what=name, shape_mismatch=[list(a.shape), list(b.shape)])
        return
    bad = (a != b) if a.dtype == torch.uint8 else ~((a == b) | (a.isnan() & b.isnan()))
    idx = bad.nonzero()[:12].tolist()
    note(
        what=name,
        n_bad=int(bad.sum()),
        first=idx,
        vals=[
            [
                int(a[tuple(i)]) if a.dtype == torch.uint8 else float(a[tuple(i)]),
                int(b[tuple(i)]) if b.dtype == torch.uint8 else float(b[tuple(i)]),
            ]
            for i in idx
        ],
    )


M, K, N = 96, 40, 48
sizes = list(shapes.group_sizes(96, 6, seed=3, empty=2))
note(sizes=sizes)
for recipe in ("tensorwise", "rowwise", "blockwise"):
    for trial in range(2):
        poison()
        gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        x = outliers(M, K, 0)
        dy = outliers(M, N, 1)
        q = {
            n: quantize_fp8(t.cuda(), recipe, group_sizes=gs, transpose=True)
            for n, t in (("x", x), ("dy", dy))
        }
        r = {
            n: quantize_fp8(t, recipe, group_sizes=torch.tensor(sizes), transpose=True, backend="reference")
            for n, t in (("x", x), ("dy", dy))
        }
        for n in q:
            for f in ("data", "scale", "data_t", "scale_t"):
                if getattr(q[n], f) is not None and getattr(q[n], f).numel():
                    diff(f"{recipe}/{trial}/{n}.{f}", getattr(q[n], f), getattr(r[n], f))
        dw = k_grouped_mm_fp8(q["dy"], q["x"], gs)
        note(what=f"{recipe}/{trial} wgrad gpu operands", nan_rows=dw.isnan().any(-1).nonzero().tolist())
        rg = {
            n: dataclasses.replace(
                t,
                data=t.data.cuda(),
                scale=t.scale.cuda(),
                data_t=t.data_t.cuda(),
                scale_t=t.scale_t.cuda(),
                group_sizes=gs,
            )
            for n, t in r.items()
        }
        dw2 = k_grouped_mm_fp8(rg["dy"], rg["x"], gs)
        note(
            what=f"{recipe}/{trial} wgrad twin operands",
            nan_rows=dw2.isnan().any(-1).nonzero().tolist(),
            maxdiff=float((dw - dw2).abs().nan_to_num(1e30).max()),
        )
with open(os.path.join(OUT, "debug_fp8_nan.json"), "w") as f:
    json.dump(log, f, indent=1)
