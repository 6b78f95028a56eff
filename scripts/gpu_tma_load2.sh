#!/usr/bin/env bash
# Second device call for the TMA-load wgrad (H100): the flat-loop GPU tests (cp.async and TMA loads, runs
# of tiles) and compute-sanitizer over the TMA-load ones, then the probe: pick, flat cp.async, flat TMA
# loads with runs of tiles (k_grouped.tile_chunk) and without.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py -k "Flat or tile_chunk" 2>&1 \
  | tee "$OUT/gpu-pytest-flat.log" | tail -4
timeout 90 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_k_grouped.py -k "FlatTmaLoad and (edge_case or group_ends or runs_of_tiles)" 2>&1 \
  | tee "$OUT/sanitizer.log" | tail -4
timeout 330 python scripts/probe_wgrad_tma_load.py --cases suite,heldout --variants pick,0f,0ft,0ft1 2>&1 \
  | grep -v Warn | tail -2
echo done
