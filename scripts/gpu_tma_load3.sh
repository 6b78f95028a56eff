#!/usr/bin/env bash
# Third device call (H100): the bench with the new wgrad configs (every op, suite and held-out), the
# previous commit's wgrad in the same session (baseline_d42aa4b/src, untracked), then the k-grouped and
# launch GPU tests.
set -uo pipefail
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD/src timeout 170 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench-new.json" --no-plot 2>&1 | tail -2
PYTHONPATH=$PWD/baseline_d42aa4b/src timeout 90 python -m moegemm.bench --cases suite,heldout --ops wgrad \
  --impls moegemm,torch._grouped_mm --out "$OUT/bench-base-wgrad.json" --no-plot 2>&1 | tail -2
PYTHONPATH=$PWD/src timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py \
  tests/test_launch.py 2>&1 | tee "$OUT/gpu-pytest-k-launch.log" | tail -4
echo done
