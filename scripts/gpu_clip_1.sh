#!/usr/bin/env bash
# Device call 1 of perf-notes 32 (H100): the flat m-grouped loop storing every tile through the clipped 3-D view
# of out (CLIPPED_STORE): its GPU tests and memcheck, then the probe at every K against the per-tile loop
# (TMA store, mixed heights, split tail) and the flat loop with the register store.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py -k "Flat" \
  2>&1 | tee "$OUT/gpu-pytest-flat-clipped.log" | tail -3
timeout 110 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_m_grouped.py -k "FlatClipped and (edge_case or tma_loads or nan)" \
  2>&1 | tee "$OUT/flat-clipped-sanitizer.log" | tail -4
for split in dirichlet balanced; do
  OUT=$OUT timeout 165 python scripts/probe_m_tma_load.py --cases suite,heldout --ops fwd,dgrad --split $split \
    --variants tma,tma-flat-clip,tma-flat-reg --reps 15 > "$OUT/probe-$split.log" 2>&1
  tail -c 300 "$OUT/probe-$split.log"
done
echo done
