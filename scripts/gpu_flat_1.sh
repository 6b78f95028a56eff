#!/usr/bin/env bash
# Device call 5 of perf-notes 30 (H100): the flat m-grouped loop (configs.M_FLAT, uniform tiles, register store)
# against the launcher's pick (nested loop, TMA store, mixed heights, split tail) and an A/A control, on every
# fwd/dgrad launch with Dirichlet and with balanced sizes; its GPU correctness on the TMA-load test class first.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
MOEGEMM_M_FLAT=1 timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py \
  -k TmaLoad 2>&1 | tee "$OUT/gpu-pytest-flat.log" | tail -3
for split in dirichlet balanced; do
  OUT=$OUT timeout 200 python scripts/probe_m_tma_load.py --cases suite,heldout --ops fwd,dgrad --split $split \
    --variants tma,tma-flat,tma-aa --reps 25 > "$OUT/probe-$split.log" 2>&1; tail -c 200 "$OUT/probe-$split.log"
done
echo done
