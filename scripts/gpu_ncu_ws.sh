#!/usr/bin/env bash
# Device call 13 (perf-notes 28, H100): Nsight Compute on the warp-specialized wgrad (gpt-oss-20b fc2, routed by the
# launcher): tensor-pipe share, warp stalls, SASS source page.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 240 $NCU --launch-skip 3 --launch-count 1 -k regex:k_grouped_mm_ws --set full --import-source no \
  -o "$OUT/ncu-ws" python scripts/ncu_grouped.py gptoss-20b-fc2 wgrad > "$OUT/ncu-ws-run.log" 2>&1
tail -2 "$OUT/ncu-ws-run.log"
$NCU -i "$OUT/ncu-ws.ncu-rep" --page details > "$OUT/ncu-ws-gptoss20b-details.txt" 2>&1
$NCU -i "$OUT/ncu-ws.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-ws-gptoss20b-sass.csv" 2>&1
gzip -f "$OUT/ncu-ws-gptoss20b-sass.csv"; rm -f "$OUT/ncu-ws.ncu-rep"
grep -E 'Duration|SM Active Cycles|Elapsed Cycles|Issue Slots Busy|Warp Cycles Per Issued' "$OUT/ncu-ws-gptoss20b-details.txt"
grep -B2 -A6 'highest-utilized pipeline' "$OUT/ncu-ws-gptoss20b-details.txt" | head -12
echo done
