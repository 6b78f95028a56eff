#!/usr/bin/env bash
# Device call 7 of perf-notes 27 (H100): the bench (every op, suite + held-out, torch._grouped_mm in the same run,
# paired clock), twice, on the final kernels.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for run in 1 2; do
  timeout 280 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
    --out "$OUT/bench-run$run.json" --no-plot 2>&1 | tail -4
done
echo done
