#!/usr/bin/env bash
# One device call (H100): GPU tests of the BF16 kernels with both store paths, then the bench with the
# TMA store on and off (suite + held-out, dirichlet, moegemm and torch._grouped_mm in the same run),
# then the config probe on the short-reduction wgrad cases. Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 200 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_m_grouped.py tests/test_k_grouped.py \
  tests/test_launch.py 2>&1 | tee "$OUT/gpu-pytest.log" | tail -4
for tma in 1 0; do
  MOEGEMM_TMA_STORE=$tma timeout 170 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
    --out "$OUT/bench-tma$tma.json" --no-plot 2>&1 | tail -3
done
OUT=$OUT timeout 100 python scripts/probe_tma_store.py --ops wgrad --configs pick,0,1 \
  --cases gptoss-20b-fc2,qwen3-30b-fc1,qwen3-30b-fc2,qwen3next-ep2-fc2,dsv2lite-fc2 > /dev/null 2>&1
echo done
