#!/usr/bin/env bash
# Device call 2 (perf-notes 29, H100): the HBM write ceiling (scripts/write_ceiling.py); the k-grouped GPU tests with
# the 4-slot WS wgrad routed above 192 rows a group; the bench twice (paired clock) on suite + held-out.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
python scripts/write_ceiling.py 2>&1 | tee "$OUT/write-ceiling.json"
timeout 180 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py tests/test_launch.py 2>&1 \
  | tee "$OUT/gpu-pytest-k.log" | tail -3
for run in 1 2; do
  timeout 200 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
    --out "$OUT/bench-ws4-run$run.json" --no-plot 2>&1 | tail -2
done
echo done
