#!/usr/bin/env bash
# Device call 12 (H100): the final code's bench (every op, suite + held-out, with torch._grouped_mm), twice, and the
# m-grouped TMA-load GPU tests once more (the 4-stage forward tile now in the candidates).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for run in 1 2; do
  timeout 200 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
    --out "$OUT/bench-final-run$run.json" --no-plot 2>&1 | tail -1
done
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py -k "TmaLoad" 2>&1 | tail -1
echo done
