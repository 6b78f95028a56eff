#!/usr/bin/env bash
# Device call 3 of perf-notes 32 (H100): host time per call with the TMA store, the previous commit (0c299f3, host
# descriptor; src under .ab_old) and this one (the kernel's own descriptor); then the bench on the final code with
# Dirichlet and balanced sizes; JAX's m-grouped launch (its argument list lost the descriptor slot) on the GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1
for side in old new; do
  if [ $side = old ]; then P=$PWD/.ab_old/src:$PWD/scripts; else P=$PWD/src:$PWD/scripts; fi
  mkdir -p "$OUT/host-$side"
  OUT=$OUT/host-$side PYTHONPATH=$P timeout 60 python scripts/probe_m_tma_load.py --host 2>&1 | cut -c1-160
done
export PYTHONPATH=$PWD/src
timeout 200 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bf16-tma-store-clipped.json" --no-plot > "$OUT/bench.log" 2>&1; tail -4 "$OUT/bench.log"
timeout 150 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm --split balanced \
  --out "$OUT/bf16-tma-store-clipped-balanced.json" --no-plot > "$OUT/bench-balanced.log" 2>&1
tail -4 "$OUT/bench-balanced.log"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
PYTHONPATH=/tmp/site:$PWD/src timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_jax.py \
  -k "TestTriton and (edge_case or transposed or gpu_sized or m_grouped_group_offset_grads or empty_pattern)" \
  2>&1 | tee "$OUT/gpu-pytest-jax-m-grouped.log" | tail -2
echo done
