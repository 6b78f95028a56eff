#!/usr/bin/env bash
# Device call 9 (H100): the capture failure with the parameters' and x's grads set to None before capture (as the
# tests' capture_step does), with C++ stack traces.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCH_SHOW_CPP_STACKTRACES=1
for c in gl-all gl-m gl-k; do
  for f in "--zero-grad" "--zero-grad --eager-first"; do
    OUT=$OUT timeout 60 python scripts/repro_tma_load_capture.py $c $f 2>&1 | tail -1 | cut -c1-500
  done
done
echo done
