#!/usr/bin/env bash
# Device call 8 (H100): with the m-grouped TMA loads opt-in again, the GroupedLinear and launch GPU tests
# (call 4's capture failure came from the m-grouped TMA loads in the backward), the m-grouped TMA-load class.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_grouped_linear.py tests/test_launch.py \
  2>&1 | tee "$OUT/gpu-pytest-gl-launch-final.log" | tail -3
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py -k "TmaLoad" \
  2>&1 | tee "$OUT/gpu-pytest-m-tma-load-final.log" | tail -3
echo done
