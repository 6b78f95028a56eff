#!/usr/bin/env bash
# Device call 12 (perf-notes 28, H100): the final code: GPU tests of the launch paths the session touched (PyTorch ops,
# GroupedLinear, launch, m-grouped), then the bench (paired clock) once more, recording the kernel each launch ran.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 330 python -m pytest -m gpu -q -p no:cacheprovider tests/test_torch_ops.py tests/test_grouped_linear.py \
  tests/test_launch.py tests/test_m_grouped.py tests/test_bench.py 2>&1 | tee "$OUT/gpu-pytest-final.log" | tail -3
timeout 200 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench-final.json" --no-plot 2>&1 | tail -3
echo done
