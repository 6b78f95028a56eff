#!/usr/bin/env bash
# Device call 3 of perf-notes 27 (H100): Nsight Compute on (1) gpt-oss-20b fc2 wgrad (the launcher's pick: flat
# 128 x 256, TMA store): full set, warp stall reasons and the SASS source page; (2) dsv3-ep8-fc1 fwd and mixtral
# fc1 dgrad with half-high tail tiles forced on at their long K against every tile full height: L2 hit rate, HBM
# bytes, tensor-pipe activity.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
$NCU --version | tail -1
timeout 200 $NCU --launch-skip 3 --launch-count 1 -k regex:k_grouped --set full --import-source no \
  -o "$OUT/ncu-wgrad-gptoss20b" python scripts/ncu_grouped.py gptoss-20b-fc2 wgrad > "$OUT/ncu-wgrad-run.log" 2>&1
tail -3 "$OUT/ncu-wgrad-run.log"
$NCU -i "$OUT/ncu-wgrad-gptoss20b.ncu-rep" --page details > "$OUT/ncu-wgrad-gptoss20b-details.txt" 2>&1
$NCU -i "$OUT/ncu-wgrad-gptoss20b.ncu-rep" --page source --csv --print-source sass \
  > "$OUT/ncu-wgrad-gptoss20b-sass.csv" 2>&1
gzip -f "$OUT/ncu-wgrad-gptoss20b-sass.csv"
rm -f "$OUT/ncu-wgrad-gptoss20b.ncu-rep"
grep -A30 'Warp State Statistics' "$OUT/ncu-wgrad-gptoss20b-details.txt" | head -40
M="gpu__time_duration.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sectors_srcunit_tex_op_read.sum"
for spec in "dsv3-ep8-fc1 fwd" "mixtral-fc1 dgrad" "olmoe-fc1 fwd"; do
  for mode in uniform mixed; do
    flag=""; env=MOEGEMM_MIXED_M=0
    if [ $mode = mixed ]; then flag=--mixed-any-k; env=MOEGEMM_MIXED_M=1; fi
    echo "== $spec $mode"
    env $env timeout 120 $NCU --launch-skip 3 --launch-count 1 -k regex:m_grouped --metrics $M \
      python scripts/ncu_grouped.py $spec $flag 2>&1 | grep -E 'duration|hit_rate|bytes_read|hmma|srcunit' \
      | tee -a "$OUT/ncu-mixed-m.txt"
  done
done
echo done
