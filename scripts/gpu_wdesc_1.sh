#!/usr/bin/env bash
# Device call 1 of perf-notes 33 (H100): both wgrad kernels make their TMA-store descriptor on the device. GPU tests
# (k-grouped), host time per call on each store path for the previous commit (96b11a3, host descriptor; src under
# .ab_old) and this one, twice; memcheck over the TMA-store and warp-specialized tests; the PyTorch ops,
# GroupedLinear and launch tests; JAX's k-grouped call (it lost a slot).
set -uo pipefail
export PYTHONUNBUFFERED=1
NEW=$PWD/src:$PWD/scripts
OLD=$PWD/.ab_old/src:$PWD/scripts
PYTHONPATH=$NEW timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py \
  2>&1 | tee "$OUT/gpu-pytest-k-grouped.log" | tail -2
for run in 1 2; do
  for side in old new; do
    if [ $side = old ]; then P=$OLD; else P=$NEW; fi
    mkdir -p "$OUT/host-$side"
    OUT=$OUT/host-$side PYTHONPATH=$P timeout 45 python scripts/probe_wgrad_tma_load.py --host-store 2>&1 | cut -c1-200
  done
done
PYTHONPATH=$NEW timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20 python -m pytest \
  -m gpu -q -p no:cacheprovider tests/test_k_grouped.py \
  -k "(TmaStore or KGroupedWs) and (edge_case or ws_problems or out_view or many_tiles)" \
  2>&1 | tee "$OUT/wgrad-desc-sanitizer.log" | tail -3
PYTHONPATH=$NEW timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_torch_ops.py \
  tests/test_grouped_linear.py tests/test_launch.py 2>&1 | tee "$OUT/gpu-pytest-torch.log" | tail -2
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
PYTHONPATH=/tmp/site:$PWD/src timeout 50 python -m pytest -m gpu -q -p no:cacheprovider tests/test_jax.py \
  -k "TestTriton and k_grouped" 2>&1 | tee "$OUT/gpu-pytest-jax-k-grouped.log" | tail -2
echo done
