#!/usr/bin/env bash
# Device call 5 of perf-notes 32 (H100): the fwd/dgrad launches below the TMA FLOP gates (finegrain, and registry
# cases at fewer tokens) with the gates as they are and at 0, plus an A/A control, Dirichlet and balanced sizes.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
for split in dirichlet balanced; do
  OUT=$OUT timeout 140 python scripts/probe_m_tma_load.py --cases finegrain-e64-fc1,finegrain-e256-fc2,small \
    --ops fwd,dgrad --split $split --variants pick,pick-gate0,pick-aa --reps 31 > "$OUT/probe-$split.log" 2>&1
  tail -c 200 "$OUT/probe-$split.log"; echo
done
echo done
