#!/usr/bin/env bash
# Device call 3 of perf-notes 30 (H100): the final code: GPU tests of every front end that launches the m-grouped
# kernel (PyTorch ops, GroupedLinear, launch, m/k-grouped, bench; JAX through jax-triton 0.3.1 carried as a
# wheel), then the bench (paired clock) with Dirichlet and with balanced group sizes.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/test_torch_ops.py tests/test_grouped_linear.py \
  tests/test_launch.py tests/test_k_grouped.py tests/test_bench.py 2>&1 | tee "$OUT/gpu-pytest-torch.log" | tail -3
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_jax.py tests/test_jax_flax.py 2>&1 \
  | tee "$OUT/gpu-pytest-jax.log" | tail -3
timeout 150 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench.json" --no-plot 2>&1 | tail -3
timeout 150 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm --split balanced \
  --out "$OUT/bench-balanced.json" --no-plot 2>&1 | tail -3
echo done
