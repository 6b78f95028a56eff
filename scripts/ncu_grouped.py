"""One BF16 grouped call for Nsight Compute: warm-up calls, then the profiled ones (the launcher's own
config and loads; MOEGEMM_* switches apply).

    ncu --launch-skip 3 --launch-count 1 -k regex:grouped python scripts/ncu_grouped.py CASE OP [--mixed-any-k]

OP is fwd, dgrad or wgrad. ``--mixed-any-k`` lets half-high tail tiles run at any K (m_grouped.MIXED_M_MAX_K
lifted), to profile the launches the rule keeps them off (perf-notes 27).
"""

import sys

import torch

from moegemm import shapes
from moegemm.kernels import m_grouped
from moegemm.torch import k_grouped_mm, m_grouped_mm

case = shapes.get(sys.argv[1])
op = sys.argv[2]
if "--mixed-any-k" in sys.argv:
    m_grouped.MIXED_M_MAX_K = 1 << 40
gs = torch.tensor(shapes.group_sizes(case.M, case.G), dtype=torch.int32, device="cuda")
w = torch.randn(case.G, case.N, case.K, device="cuda", dtype=torch.bfloat16)
x = torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16)
dy = torch.randn(case.M, case.N, device="cuda", dtype=torch.bfloat16)
call = {
    "fwd": lambda: m_grouped_mm(x, w.mT, gs),
    "dgrad": lambda: m_grouped_mm(dy, w, gs),
    "wgrad": lambda: k_grouped_mm(dy, x, gs, out_dtype=torch.bfloat16),  # dW [G, N, K]
}[op]
for _ in range(5):
    call()
torch.cuda.synchronize()
