#!/usr/bin/env bash
# Device call 6 (H100): the GroupedLinear TMA-load capture failure of call 4, narrowed down.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for c in gl-all gl-k gl-m m-fwd; do
  timeout 60 python scripts/repro_tma_load_capture.py $c --eager-first 2>&1 | tail -1 | cut -c1-700
done
timeout 60 python -m pytest -m gpu -q -p no:cacheprovider tests/test_grouped_linear.py -k test_tma_loads_in_backward \
  2>&1 | tail -2
timeout 150 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_grouped_linear.py 2>&1 | grep -E "passed|failed|FAILED|Error:" | head -5
echo done
