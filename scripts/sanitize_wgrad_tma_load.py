"""compute-sanitizer target (H100): the wgrad's default TMA-load config (flat 128 x 256, TMA loads and store)
on shapes with tails in both output dimensions, an empty group, a group ending inside a step, and a first
group with no rows, checked against torch._grouped_mm.

    compute-sanitizer --tool memcheck python scripts/sanitize_wgrad_tma_load.py
"""

from __future__ import annotations

import dataclasses

import torch

from moegemm import configs
from moegemm.torch import _launch

config = next(c for c in configs.candidates("k_grouped", "sm90") if c.tma_load)
inner = configs.pick_config
configs.pick_config = lambda op, *a, **k: config if op == "k_grouped" else inner(op, *a, **k)
_launch.TMA_STORE_MIN_FLOPS = _launch.TMA_LOAD_MIN_FLOPS = (
    0  # (run on the H100 before the load threshold existed)
)
for sizes, K, N in (([300, 0, 517, 183], 520, 264), ([0, 64, 1, 999], 136, 392)):
    M = sum(sizes)
    gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    offs = gs.cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    out = torch.full((len(sizes), N, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    _launch.launch_k_grouped(dy, x, gs, out, False)
    want = torch._grouped_mm(dy.T, x, offs=offs, out_dtype=torch.bfloat16)
    err = ((out.double() - want.double()).norm() / want.double().norm()).item()
    print(sizes, K, N, dataclasses.asdict(config), "relerr", err, flush=True)
    assert err < 1e-2, err
print("ok")
