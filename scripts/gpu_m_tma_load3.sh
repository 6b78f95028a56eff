#!/usr/bin/env bash
# Device call 3 (H100): GPU tests with the m-grouped TMA loads on by default, then the bench (every op,
# suite + held-out, with torch._grouped_mm), then fwd/dgrad again with MOEGEMM_TMA_LOAD=0 in the same session.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py tests/test_grouped_linear.py \
  -k "TmaLoad or tma or graph or Triton" 2>&1 | tee "$OUT/gpu-pytest-m-tma-load-default.log" | tail -4
timeout 200 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench-tma1.json" --no-plot 2>&1 | tail -2
MOEGEMM_TMA_LOAD=0 timeout 150 python -m moegemm.bench --cases suite,heldout --ops fwd,dgrad \
  --impls moegemm,torch._grouped_mm --out "$OUT/bench-tma0-fwd-dgrad.json" --no-plot 2>&1 | tail -2
echo done
