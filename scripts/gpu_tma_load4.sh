#!/usr/bin/env bash
# Fourth device call (H100): GroupedLinear and the torch ops on the GPU (the wgrad's TMA loads from
# autograd's thread, graphs), then a second bench pair: new code, and the previous commit's wgrad.
set -uo pipefail
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD/src timeout 230 python -m pytest -m gpu -q -p no:cacheprovider tests/test_torch_ops.py \
  tests/test_grouped_linear.py 2>&1 | tee "$OUT/gpu-pytest-ops-gl.log" | tail -4
PYTHONPATH=$PWD/src timeout 170 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench-new.json" --no-plot 2>&1 | tail -1
PYTHONPATH=$PWD/baseline_d42aa4b/src timeout 90 python -m moegemm.bench --cases suite,heldout --ops wgrad \
  --impls moegemm,torch._grouped_mm --out "$OUT/bench-base-wgrad.json" --no-plot 2>&1 | tail -1
echo done
