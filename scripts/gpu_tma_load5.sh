#!/usr/bin/env bash
# Fifth device call (H100): the wgrad's TMA loads through autograd's backward thread and a CUDA graph
# (GroupedLinear), under compute-sanitizer too, and the host cost per call with TMA loads vs cp.async.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_grouped_linear.py -k "tma" 2>&1 \
  | tee "$OUT/gpu-pytest-gl-tma.log" | tail -3
timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_grouped_linear.py -k "tma_loads" 2>&1 | tee "$OUT/sanitizer-gl.log" | tail -3
OUT=$OUT timeout 90 python scripts/probe_wgrad_tma_load.py --host 2>&1 | grep host
echo done
