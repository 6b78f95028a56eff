"""One BF16 m-grouped call (dsv3-ep8-fc1 fwd by default) for Nsight Compute: warm-up calls, then one
profiled call, on the warp-specialized kernel (MOEGEMM_WS=1, the default) or the Triton one (MOEGEMM_WS=0).

    ncu --launch-skip 3 --launch-count 1 -k regex:m_grouped python scripts/ncu_bf16_ws.py [case] [fwd|dgrad]
"""

import sys

import torch

from moegemm import shapes
from moegemm.torch import m_grouped_mm

case = shapes.get(sys.argv[1] if len(sys.argv) > 1 else "dsv3-ep8-fc1")
op = sys.argv[2] if len(sys.argv) > 2 else "fwd"
gs = torch.tensor(shapes.group_sizes(case.M, case.G), dtype=torch.int32, device="cuda")
w = torch.randn(case.G, case.N, case.K, device="cuda", dtype=torch.bfloat16)
if op == "fwd":
    a, b = torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16), w.mT
else:
    a, b = torch.randn(case.M, case.N, device="cuda", dtype=torch.bfloat16), w
for _ in range(4):
    m_grouped_mm(a, b, gs)
torch.cuda.synchronize()
