#!/usr/bin/env bash
# Device call 2 of perf-notes 30 (H100): what the event clock reads for an empty kernel; Nsight Compute on
# finegrain-e64 fwd/dgrad with the tail round split and whole (duration, SM activity, tensor pipe); the bench
# (paired clock) a second time.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
OUT=$OUT timeout 60 python scripts/event_overhead.py 2>&1 | tail -2
M="gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_elapsed.avg,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size"
for spec in "finegrain-e64-fc1 fwd" "finegrain-e64-fc1 dgrad" "finegrain-e256-fc2 fwd"; do
  for split in 1 0; do
    echo "== $spec split=$split" | tee -a "$OUT/ncu-tail-split.txt"
    MOEGEMM_TAIL_SPLIT=$split timeout 90 $NCU --launch-skip 3 --launch-count 1 -k regex:m_grouped --metrics $M \
      python scripts/ncu_grouped.py $spec 2>&1 | grep -E 'duration|cycles|hmma|warps_active|bytes|grid_size' \
      | tee -a "$OUT/ncu-tail-split.txt"
  done
done
timeout 170 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
  --out "$OUT/bench.json" --no-plot 2>&1 | tail -3
echo done
