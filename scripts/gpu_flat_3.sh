#!/usr/bin/env bash
# Device call 7 of perf-notes 31 (H100): the final code's bench (paired clock) once more with each routing.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 150 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench.json" --no-plot 2>&1 | tail -2
timeout 120 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm --split balanced \
  --out "$OUT/bench-balanced.json" --no-plot 2>&1 | tail -2
echo done
