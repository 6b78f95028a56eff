#!/usr/bin/env bash
# Device call 6 of perf-notes 30 (H100): the flat loop on by rule (K <= FLAT_MAX_K with TMA loads): the m-grouped
# GPU tests (the flat class included), compute-sanitizer over the flat class, then the bench with Dirichlet and
# with balanced sizes.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
SAN="/usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1"
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py 2>&1 \
  | tee "$OUT/gpu-pytest-m-grouped.log" | tail -3
timeout 120 $SAN python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py -k "Flat and (edge or both_layouts or nan)" \
  2>&1 | tee "$OUT/sanitizer-flat.log" | tail -3
timeout 130 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench.json" --no-plot 2>&1 | tail -2
timeout 130 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm --split balanced \
  --out "$OUT/bench-balanced.json" --no-plot 2>&1 | tail -2
echo done
