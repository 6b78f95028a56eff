#!/usr/bin/env bash
# Device call 4 of perf-notes 30 (H100): the split-tail test on the GPU (call 1 deselected it: it lacked the gpu
# mark) and under compute-sanitizer; the JAX GPU tests call 3 cut off; the held-out set with balanced sizes.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
SAN="/usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1"
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py -k tail_split 2>&1 \
  | tee "$OUT/gpu-pytest-tail-split.log" | tail -3
timeout 100 $SAN python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py -k tail_split 2>&1 \
  | tee "$OUT/sanitizer-tail-split.log" | tail -3
timeout 110 python -m moegemm.bench --cases heldout --impls moegemm,torch._grouped_mm --split balanced \
  --out "$OUT/bench-balanced-heldout.json" --no-plot 2>&1 | tail -3
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/test_jax.py tests/test_jax_flax.py \
  -k "not edge_case" 2>&1 | tee "$OUT/gpu-pytest-jax.log" | tail -3
echo done
