#!/usr/bin/env bash
# Device call 6 of perf-notes 32 (H100): the flat loop for whole-tile group sizes at K 2048-3072 (FLAT_WHOLE_TILES,
# both loops in one kernel): the GPU tests of the TMA-store and flat classes, the paired probe against the same
# launcher without it, Dirichlet and balanced sizes, then the bench on the final code with both routings.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py \
  -k "Flat or flat_rule or TmaStore or tail_split" 2>&1 | tee "$OUT/gpu-pytest-whole-tiles.log" | tail -2
for split in balanced dirichlet; do
  OUT=$OUT timeout 110 python scripts/probe_m_tma_load.py --cases suite,heldout --ops fwd,dgrad --split $split \
    --variants pick,pick-nowhole --reps 21 > "$OUT/probe-$split.log" 2>&1; tail -c 150 "$OUT/probe-$split.log"; echo
done
timeout 140 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bf16-whole-tiles.json" --no-plot > "$OUT/bench.log" 2>&1; tail -3 "$OUT/bench.log"
timeout 80 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm --split balanced \
  --out "$OUT/bf16-whole-tiles-balanced.json" --no-plot > "$OUT/bench-balanced.log" 2>&1; tail -3 "$OUT/bench-balanced.log"
echo done
