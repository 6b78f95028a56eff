#!/usr/bin/env bash
# Device call 4 of perf-notes 32 (H100): host time per call with the TMA store on a tile with room for it, the
# previous commit (0c299f3, host descriptor; src under .ab_old) and this one (the kernel's own descriptor), twice.
set -uo pipefail
export PYTHONUNBUFFERED=1
for run in 1 2; do
  for side in old new; do
    if [ $side = old ]; then P=$PWD/.ab_old/src:$PWD/scripts; else P=$PWD/src:$PWD/scripts; fi
    mkdir -p "$OUT/host-$side"
    OUT=$OUT/host-$side PYTHONPATH=$P timeout 60 python scripts/probe_m_tma_load.py --host 2>&1 | cut -c1-130
  done
done
echo done
