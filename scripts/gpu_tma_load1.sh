#!/usr/bin/env bash
# First device call for the TMA-load wgrad (H100): its GPU tests and compute-sanitizer, then the probe
# (scripts/probe_wgrad_tma_load.py) over the suite and held-out wgrad cases.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 130 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py -k "Flat" 2>&1 \
  | tee "$OUT/gpu-pytest-flat.log" | tail -8
timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_k_grouped.py -k "FlatTmaLoad and (edge_case or group_ends or empty_pattern)" 2>&1 \
  | tee "$OUT/sanitizer.log" | tail -6
timeout 330 python scripts/probe_wgrad_tma_load.py --cases suite,heldout --variants pick,0f,0ft,9ft,10ft 2>&1 \
  | grep -v Warn | tail -3
echo done
