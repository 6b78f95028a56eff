#!/usr/bin/env bash
# Device call 5 (H100): which TMA-load launches a CUDA graph can capture (scripts/repro_tma_load_capture.py).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for c in m-fwd m-dgrad k-wgrad gl-k gl-m gl-all; do
  for m in "" --thread-local; do
    timeout 60 python scripts/repro_tma_load_capture.py $c $m 2>&1 | tail -1 | cut -c1-600
  done
done
echo done
