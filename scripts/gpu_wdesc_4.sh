#!/usr/bin/env bash
# Device call 4 of perf-notes 33 (H100), final code (the Triton wgrad makes its store descriptor, the warp-specialized
# one keeps the host's): the k-grouped TMA-store and warp-specialized GPU tests, then the bench with Dirichlet and
# balanced sizes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py -k "KGroupedWs or TmaStore or RegisterStore" \
  2>&1 | tee "$OUT/gpu-pytest-k-grouped-final.log" | tail -2
timeout 170 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bf16-wgrad-desc-final.json" --no-plot > "$OUT/bench.log" 2>&1; tail -4 "$OUT/bench.log"
timeout 150 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm --split balanced \
  --out "$OUT/bf16-wgrad-desc-final-balanced.json" --no-plot > "$OUT/bench-balanced.log" 2>&1
tail -4 "$OUT/bench-balanced.log"
echo done
