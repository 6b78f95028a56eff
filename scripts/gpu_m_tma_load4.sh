#!/usr/bin/env bash
# Device call 4 (H100): GroupedLinear and launch GPU tests with the m-grouped TMA loads on (call 3's test run
# hit its timeout), the TMA-load GroupedLinear test under compute-sanitizer (eager part is what it can check),
# and a second bench run of every op.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_grouped_linear.py tests/test_launch.py \
  2>&1 | tee "$OUT/gpu-pytest-gl-launch.log" | tail -4
timeout 200 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench-run2.json" --no-plot 2>&1 | tail -2
timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_m_grouped.py -k "TmaLoad and (edge or hypothesis)" 2>&1 \
  | tee "$OUT/m-tma-load-edge-sanitizer.log" | tail -3
echo done
