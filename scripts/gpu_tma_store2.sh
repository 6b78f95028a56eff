#!/usr/bin/env bash
# Second device call (H100): the GPU tests of the default path with both store paths, host cost per
# call with the TMA store on and off, and the bench A/B again in the other order (noise estimate).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py tests/test_k_grouped.py \
  tests/test_launch.py tests/test_torch_ops.py tests/test_grouped_linear.py 2>&1 | tee "$OUT/gpu-pytest.log" | tail -4
OUT=$OUT timeout 60 python scripts/probe_tma_store.py --host 2>&1 | tail -4
for tma in 0 1; do
  MOEGEMM_TMA_STORE=$tma timeout 150 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
    --out "$OUT/bench-tma$tma.json" --no-plot 2>&1 | tail -3
done
echo done
