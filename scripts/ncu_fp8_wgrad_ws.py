"""One dsv3-ep8-fc1 blockwise wgrad through moegemm.torch.fp8.k_grouped_mm_fp8 (the warp-specialized kernel
on sm90 unless MOEGEMM_FP8_WS=0), for Nsight Compute: warm-up calls, then one NVTX-free profiled call.

    ncu --launch-skip 3 --launch-count 1 -k regex:k_grouped python scripts/ncu_fp8_wgrad_ws.py [case] [recipe]
"""

import sys

import torch

from moegemm import shapes
from moegemm.torch.fp8 import k_grouped_mm_fp8, quantize_fp8

case = shapes.get(sys.argv[1] if len(sys.argv) > 1 else "dsv3-ep8-fc1")
recipe = sys.argv[2] if len(sys.argv) > 2 else "blockwise"
sizes = shapes.group_sizes(case.M, case.G, seed=1)
gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
x_q = quantize_fp8(torch.randn(case.M, case.K, device="cuda"), recipe, group_sizes=gs, transpose=True)
dy_q = quantize_fp8(torch.randn(case.M, case.N, device="cuda"), recipe, group_sizes=gs, transpose=True)
out = torch.empty(case.G, case.N, case.K, device="cuda")
for _ in range(5):
    k_grouped_mm_fp8(dy_q, x_q, gs, out=out)
torch.cuda.synchronize()
