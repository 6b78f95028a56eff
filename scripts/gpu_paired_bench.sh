#!/usr/bin/env bash
# Device call 13 (H100): the final code's bench with --paired (every op, suite + held-out), twice.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for run in 1 2; do
  timeout 280 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm --paired \
    --out "$OUT/bench-paired-run$run.json" --no-plot 2>&1 | tail -4
done
echo done
