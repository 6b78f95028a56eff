"""GPU debug (perf-notes 29): the ping-pong WS wgrad on growing problems, one launch each, synchronized, so a
fault names its problem. python scripts/debug_pingpong.py [--stages 5]"""

import sys

import torch
from probe_wgrad_ws_tma import launch

PROBLEMS = [  # (M, Ka, Nb, G): every program gets tiles for both consumers from the second one on
    (4096, 512, 1024, 16),
    (16384, 512, 1024, 128),
    (16384, 1536, 2048, 128),
]
stages = int(sys.argv[sys.argv.index("--stages") + 1]) if "--stages" in sys.argv else 4
for M, Ka, Nb, G in PROBLEMS:
    a = torch.randn(M, Ka, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(M, Nb, device="cuda", dtype=torch.bfloat16)
    gs = torch.full((G,), M // G, dtype=torch.int32, device="cuda")
    out = torch.full((G, Ka, Nb), float("nan"), device="cuda", dtype=torch.bfloat16)
    launch(a, b, gs, out, stages=stages, block_n=128, pingpong=True)
    torch.cuda.synchronize()
    ref = torch.bmm(a.view(G, M // G, Ka).mT.double(), b.view(G, M // G, Nb).double())
    print(
        M,
        Ka,
        Nb,
        G,
        "relerr",
        ((out.double() - ref).norm() / ref.norm()).item(),
        "nan",
        int(out.isnan().sum()),
        flush=True,
    )
