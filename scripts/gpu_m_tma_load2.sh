#!/usr/bin/env bash
# Device call 2 (H100): the m-grouped TMA-load probe with paired timing (variants take turns call by call),
# two passes over suite + held-out fwd/dgrad.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
for run in 1 2; do
  OUT=$OUT timeout 270 python scripts/probe_m_tma_load.py 2>&1 | tail -40 | cut -c1-200
  mv "$OUT/m_tma_load.jsonl" "$OUT/m_tma_load_paired_run$run.jsonl"
done
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv | tee -a "$OUT/gpu.txt"
echo done
