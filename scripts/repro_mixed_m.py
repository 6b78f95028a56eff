"""GPU repro: the m-grouped kernel with the table's default config (128 x 256) and half-high tail tiles, on small
odd shapes; prints where the output differs from torch (NaN-poisoned out) for each variant."""

import itertools

import torch

from moegemm import configs
from moegemm.torch import _launch, m_grouped_mm

default = configs.candidates("m_grouped", "sm90")[0]
inner = configs.pick_config
configs.pick_config = lambda op, *a, **kw: default if op == "m_grouped" else inner(op, *a, **kw)
torch.manual_seed(0)
for (M, K, N), bias, mixed, layout in itertools.product(
    [(45, 31, 17), (45, 32, 16), (45, 64, 64), (45, 31, 64), (45, 64, 17), (200, 31, 17)],
    [False, True],
    [False, True],
    ["t", "k"],
):
    configs.MIXED_M = mixed
    _launch.clear_launch_cache()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1, N, K, device="cuda", dtype=torch.bfloat16)
    wv = w.mT if layout == "t" else w.mT.contiguous()
    b = torch.randn(1, N, device="cuda", dtype=torch.bfloat16) if bias else None
    gs = torch.tensor([M], device="cuda", dtype=torch.int32)
    out = m_grouped_mm(x, wv, gs, bias=b)
    ref = x.float() @ wv[0].float() + (b.float() if bias else 0)
    bad = ~torch.isclose(out.float(), ref, rtol=3e-2, atol=3e-1)
    rows = bad.any(1).nonzero().flatten().tolist()
    cols = bad.any(0).nonzero().flatten().tolist()
    print(
        f"M={M} K={K} N={N} bias={bias} mixed={mixed} layout={layout}: bad={int(bad.sum())} "
        f"nan={int(out.isnan().sum())} rows={rows[:10]} cols={cols[:10]}",
        flush=True,
    )
