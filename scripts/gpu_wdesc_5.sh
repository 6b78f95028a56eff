#!/usr/bin/env bash
# Device call 5 of perf-notes 33 (H100): the tile order of the output-bound wgrads (128 rows a group, the Triton
# kernel): the pick with GROUP_M 1, 4, 8 (the pick's), 16 and 64, paired with torch, A/A control; both routings.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/scripts
CASES=qwen3-30b-fc1,qwen3-30b-fc2,gptoss-120b-fc1,qwen3next-ep2-fc2,finegrain-e256-fc2
for split in dirichlet balanced; do
  timeout 150 python scripts/probe_wgrad_tma_load.py --paired --cases $CASES --split $split \
    --variants pickt,pickt@gm1,pickt@gm4,pickt@gm16,pickt@gm64,pickt-aa > "$OUT/gm-$split.log" 2>&1
  tail -c 300 "$OUT/gm-$split.log"; echo
done
echo done
