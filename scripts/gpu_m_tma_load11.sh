#!/usr/bin/env bash
# Device call 11 (H100): final code, m-grouped TMA loads on by default again (the capture failure was the test's
# eager y keeping x's AccumulateGrad on the legacy stream, perf-notes 26): GroupedLinear, launch, torch-ops and the
# m-grouped TMA-load GPU tests.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 250 python -m pytest -m gpu -q -p no:cacheprovider tests/test_grouped_linear.py tests/test_launch.py \
  tests/test_torch_ops.py 2>&1 | tee "$OUT/gpu-pytest-gl-launch-ops-final.log" | tail -3
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py -k "TmaLoad" \
  2>&1 | tee "$OUT/gpu-pytest-m-tma-load-final.log" | tail -2
echo done
