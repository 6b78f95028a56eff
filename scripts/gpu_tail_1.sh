#!/usr/bin/env bash
# Device call 1 of perf-notes 30 (H100): the m-grouped GPU tests with the split tail round, compute-sanitizer
# memcheck over the split-tail and whole-tile tests, the paired probe (split tail vs whole tiles, with an A/A
# control), then the bench (paired clock).
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
SAN="/usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py 2>&1 \
  | tee "$OUT/gpu-pytest-m-grouped.log" | tail -3
timeout 150 $SAN python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py \
  -k "tail_split or mixed_m_half or (UniformM and edge_case)" 2>&1 | tee "$OUT/sanitizer-tail-split.log" | tail -3
OUT=$OUT timeout 240 python scripts/probe_m_tma_load.py --cases suite,heldout --ops fwd,dgrad \
  --variants tma,tma-whole,tma-whole-aa --reps 25 > "$OUT/probe.log" 2>&1; tail -c 300 "$OUT/probe.log"
timeout 170 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench.json" --no-plot 2>&1 | tail -3
echo done
