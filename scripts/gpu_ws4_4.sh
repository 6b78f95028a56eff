#!/usr/bin/env bash
# Device call 7 (perf-notes 29, H100): the WS wgrad's new multi-tile GPU tests (4 and 3 slots) under compute-sanitizer
# and plain; Nsight Compute on the 4-slot kernel as routed (gpt-oss-20b fc2; entry 28 profiled the 3-slot one).
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py -k "TestKGroupedWs" 2>&1 \
  | tee "$OUT/gpu-pytest-k-ws.log" | tail -2
timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_k_grouped.py -k "many_tiles" 2>&1 | tee "$OUT/sanitizer-k-ws.log" | tail -2
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 200 $NCU --launch-skip 3 --launch-count 1 -k regex:k_grouped_mm_ws --set full --import-source no \
  -o "$OUT/ncu-ws" python scripts/ncu_grouped.py gptoss-20b-fc2 wgrad > "$OUT/ncu-ws-run.log" 2>&1
tail -1 "$OUT/ncu-ws-run.log"
$NCU -i "$OUT/ncu-ws.ncu-rep" --page details > "$OUT/ncu-ws4-gptoss20b-details.txt" 2>&1
$NCU -i "$OUT/ncu-ws.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-ws4-gptoss20b-sass.csv" 2>&1
gzip -f "$OUT/ncu-ws4-gptoss20b-sass.csv"; rm -f "$OUT/ncu-ws.ncu-rep"
grep -E 'Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|Issue Slots Busy' "$OUT/ncu-ws4-gptoss20b-details.txt" | head -8
echo done
