#!/usr/bin/env bash
# Device call 7 (H100): the GroupedLinear TMA-load capture failure, with the tests' output poisoning and launch
# recorder added to the repro one at a time.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for flags in "--poison" "--record" "--poison --record" "--poison --eager-first"; do
  for c in gl-all gl-m gl-k; do
    timeout 60 python scripts/repro_tma_load_capture.py $c $flags 2>&1 | tail -1 | cut -c1-400
  done
done
echo done
