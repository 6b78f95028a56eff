#!/usr/bin/env bash
# Device call 8 of perf-notes 27 (H100): the final kernels: k-grouped GPU tests (int32 step count), compute-sanitizer
# memcheck over the mixed-tile-height and flat-loop tests, then the bench (paired clock) once more.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
SAN="/usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1"
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py 2>&1 \
  | tee "$OUT/gpu-pytest-k-grouped.log" | tail -2
timeout 150 $SAN python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py \
  -k "mixed_m_half or mixed_m_needs or (UniformM and edge_case)" 2>&1 | tee "$OUT/sanitizer-mixed-m.log" | tail -3
timeout 120 $SAN python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py \
  -k "TritonFlat and (edge or empty)" 2>&1 | tee "$OUT/sanitizer-k-flat.log" | tail -3
timeout 150 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench-final.json" --no-plot 2>&1 | tail -3
echo done
