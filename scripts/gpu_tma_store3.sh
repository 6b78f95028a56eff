#!/usr/bin/env bash
# Third device call (H100): the default path's GPU tests after the TMA-store changes, then
# compute-sanitizer memcheck over the TMA-store tests.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 380 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py tests/test_k_grouped.py \
  tests/test_launch.py tests/test_torch_ops.py tests/test_grouped_linear.py 2>&1 | tee "$OUT/gpu-pytest.log" | tail -15
timeout 170 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_k_grouped.py tests/test_m_grouped.py \
  -k "TmaStore and (edge_case or out_view or boundaries or small_launches or row_stride)" 2>&1 \
  | tee "$OUT/sanitizer.log" | tail -6
echo done
