#!/usr/bin/env bash
# Device call (H100): the m-grouped kernel's TMA loads: GPU tests, the fwd/dgrad probe against cp.async
# and torch._grouped_mm, compute-sanitizer on the TMA-load tests, host cost per call.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py -k "TmaLoad or TmaStore" 2>&1 \
  | tee "$OUT/gpu-pytest-m-tma-load.log" | tail -3
OUT=$OUT timeout 300 python scripts/probe_m_tma_load.py 2>&1 | tail -45 | cut -c1-400
timeout 90 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_m_grouped.py -k "TmaLoad and (nan or views or layouts)" 2>&1 \
  | tee "$OUT/m-tma-load-sanitizer.log" | tail -3
OUT=$OUT timeout 45 python scripts/probe_m_tma_load.py --host 2>&1 | grep host
echo done
