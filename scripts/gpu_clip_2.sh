#!/usr/bin/env bash
# Device call 2 of perf-notes 32 (H100): the m-grouped TMA store through the kernel's clipped 3-D view in both
# loops (the host descriptor gone): GPU tests and memcheck, then an A/B of the launcher's defaults against the
# previous commit (0c299f3, its src under .ab_old), processes taking turns, each paired with torch.
set -uo pipefail
export PYTHONUNBUFFERED=1
NEW=$PWD/src:$PWD/scripts
OLD=$PWD/.ab_old/src:$PWD/scripts
PYTHONPATH=$NEW timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_m_grouped.py \
  2>&1 | tee "$OUT/gpu-pytest-m-grouped.log" | tail -2
PYTHONPATH=$NEW timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_grouped_linear.py \
  tests/test_launch.py tests/test_torch_ops.py 2>&1 | tee "$OUT/gpu-pytest-torch.log" | tail -2
PYTHONPATH=$NEW timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20 python -m pytest \
  -m gpu -q -p no:cacheprovider tests/test_m_grouped.py -k "TmaStore and (edge_case or boundaries or tma_loads)" \
  2>&1 | tee "$OUT/tma-store-sanitizer.log" | tail -3
for split in dirichlet balanced; do
  for side in old new; do
    if [ $side = old ]; then P=$OLD; else P=$NEW; fi
    mkdir -p "$OUT/$side"
    OUT=$OUT/$side PYTHONPATH=$P timeout 75 python scripts/probe_m_tma_load.py --cases suite,heldout --ops fwd,dgrad \
      --split $split --variants pick --reps 21 > "$OUT/$side/probe-$split.log" 2>&1
    tail -c 150 "$OUT/$side/probe-$split.log"; echo
  done
done
echo done
