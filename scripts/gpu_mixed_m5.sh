#!/usr/bin/env bash
# Device call 6 of perf-notes 27 (H100): GPU tests (m-grouped with mixed tile heights under the alignment rule, k-grouped
# int32 row counts, GroupedLinear, launch, torch ops), the repro of the odd-row miscompile (now off that path).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 420 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py tests/test_k_grouped.py \
  tests/test_grouped_linear.py tests/test_launch.py tests/test_torch_ops.py 2>&1 | tee "$OUT/gpu-pytest.log" | tail -4
timeout 100 python scripts/repro_mixed_m.py 2>&1 | grep -v 'bad=0' | tail -5
echo done
