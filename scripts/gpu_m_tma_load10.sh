#!/usr/bin/env bash
# Device call 10 (H100): bisect the GroupedLinear TMA-load capture failure in pytest, one process per variant.
# (The bisect test file was temporary; it is kept as benchmarks/results/capture-bisect-2026-11-26/test_capture_bisect.py.txt.)
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCH_SHOW_CPP_STACKTRACES=1
for v in exact no-tma n80-k-only n80-no-tma drop-y drop-y-no-tma k-only m-only; do
  timeout 60 python -m pytest -m gpu -q -p no:cacheprovider "tests/test_zz_capture_bisect.py::test_capture[$v]" \
    > "$OUT/bisect-$v.log" 2>&1
  echo "$v: $(tail -1 "$OUT/bisect-$v.log")"
done
echo done
