#!/usr/bin/env bash
# Device call 3 of perf-notes 33 (H100): the warp-specialized wgrad launched directly, paired with torch: the
# previous commit's kernel (host descriptor, prev4), this commit's (each consumer makes its descriptor, 4), and a
# variant that makes one descriptor before the partitions (top4), with an A/A control; then that variant's GPU
# tests and memcheck (src copy under .ab_top).
set -uo pipefail
export PYTHONUNBUFFERED=1
CASES=dsv3-ep8-fc1,dsv3-ep8-fc2,mixtral-fc1,finegrain-e256-fc2,kimi-k2-ep8-fc1,phi35moe-fc2,qwen3-235b-ep8-fc1
CASES=$CASES,dbrx-ep4-fc1,mixtral-8x22b-fc2,dsv2lite-fc1,dsv2lite-fc2,gptoss-20b-fc2,olmoe-fc1,glm45air-ep4-fc2
PYTHONPATH=$PWD/src:$PWD/scripts timeout 200 python scripts/probe_wgrad_ws_tma.py --cases $CASES \
  --stages prev4,4,top4,4-aa --reps 25 > "$OUT/ws-desc-probe.log" 2>&1
tail -c 400 "$OUT/ws-desc-probe.log"; echo
PYTHONPATH=$PWD/.ab_top/src timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py \
  -k "KGroupedWs" 2>&1 | tee "$OUT/gpu-pytest-ws-top.log" | tail -2
PYTHONPATH=$PWD/.ab_top/src timeout 90 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20 \
  python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py \
  -k "KGroupedWs and (edge_case or ws_problems or out_view or many_tiles)" 2>&1 | tee "$OUT/ws-top-sanitizer.log" | tail -3
echo done
