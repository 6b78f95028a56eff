#!/usr/bin/env bash
# Device call 7 of perf-notes 32 (H100): memcheck over the whole-tile test (both loops in one kernel), then the
# PyTorch ops, GroupedLinear and launch tests that call 2's time limit cut.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_m_grouped.py -k "whole_tiles or flat_rule" 2>&1 | tee "$OUT/whole-tiles-sanitizer.log" | tail -3
timeout 130 python -m pytest -m gpu -q -p no:cacheprovider tests/test_torch_ops.py tests/test_grouped_linear.py \
  tests/test_launch.py 2>&1 | tee "$OUT/gpu-pytest-torch.log" | tail -2
echo done
