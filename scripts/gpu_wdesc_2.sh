#!/usr/bin/env bash
# Device call 2 of perf-notes 33 (H100): the PyTorch ops, GroupedLinear and launch tests (call 1's time limit cut
# them), then device time of every wgrad launch, the previous commit (96b11a3; src under .ab_old) and this one,
# processes taking turns, each paired with torch (with an A/A variant), then the bench with Dirichlet sizes.
set -uo pipefail
export PYTHONUNBUFFERED=1
NEW=$PWD/src:$PWD/scripts
OLD=$PWD/.ab_old/src:$PWD/scripts
PYTHONPATH=$NEW timeout 170 python -m pytest -m gpu -q -p no:cacheprovider tests/test_torch_ops.py \
  tests/test_grouped_linear.py tests/test_launch.py 2>&1 | tee "$OUT/gpu-pytest-torch.log" | tail -2
for side in old new; do
  if [ $side = old ]; then P=$OLD; else P=$NEW; fi
  mkdir -p "$OUT/ab-$side"
  OUT=$OUT/ab-$side PYTHONPATH=$P timeout 100 python scripts/probe_wgrad_tma_load.py --paired \
    --variants pickt,pickt-aa > "$OUT/ab-$side/probe.log" 2>&1
  tail -c 200 "$OUT/ab-$side/probe.log"; echo
done
PYTHONPATH=$PWD/src timeout 160 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bf16-wgrad-desc.json" --no-plot > "$OUT/bench.log" 2>&1; tail -4 "$OUT/bench.log"
echo done
