#!/usr/bin/env bash
# Device call 11 (perf-notes 28, H100): the warp-specialized wgrad wired into the launcher: its GPU tests, the k-grouped
# file, compute-sanitizer over its problems, then the bench (paired clock) on suite + held-out.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py 2>&1 | tee "$OUT/gpu-pytest-k-ws.log" | tail -3
timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_k_grouped.py -k "TestKGroupedWs and (ws_problems or fp16)" 2>&1 \
  | tee "$OUT/sanitizer-k-ws.log" | tail -3
timeout 200 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench-ws.json" --no-plot 2>&1 | tail -3
echo done
