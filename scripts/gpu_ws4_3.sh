#!/usr/bin/env bash
# Device call 3 (perf-notes 29, H100): the WS wgrad's narrow last column tile (TAIL_N) against the previous commit's
# kernel (scripts/k_grouped_ws_prev.py, carried), paired, with edge checks; its GPU tests and compute-sanitizer; then
# Nsight Compute on the output-bound gpt-oss-120b fc1 wgrad (the launcher's Triton pick).
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
CASES=glm45air-ep4-fc2,dsv2lite-fc2,gptoss-20b-fc2,olmoe-fc1,kimi-k2-ep8-fc1,gptoss-120b-fc1,qwen3-30b-fc1
OUT=$OUT timeout 200 python scripts/probe_wgrad_ws_tma.py --cases $CASES --stages 4,prev4 2>&1 | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:400]); continue
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('case', 'relerr', 'nan', 'variant', 'zeros_ok') or k.endswith('vs_torch') or k.endswith('error')})
"
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py -k "Ws or ws" 2>&1 \
  | tee "$OUT/gpu-pytest-k-ws.log" | tail -3
timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_k_grouped.py -k "TestKGroupedWs and (ws_problems or fp16)" 2>&1 \
  | tee "$OUT/sanitizer-k-ws.log" | tail -3
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 200 $NCU --launch-skip 3 --launch-count 1 -k regex:k_grouped --set full --import-source no \
  -o "$OUT/ncu-w" python scripts/ncu_grouped.py gptoss-120b-fc1 wgrad > "$OUT/ncu-run.log" 2>&1
tail -2 "$OUT/ncu-run.log"
$NCU -i "$OUT/ncu-w.ncu-rep" --page details > "$OUT/ncu-wgrad-gptoss120b-details.txt" 2>&1
rm -f "$OUT/ncu-w.ncu-rep"
grep -E 'Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|Memory Throughput|Issue Slots Busy' "$OUT/ncu-wgrad-gptoss120b-details.txt" | head -12
echo done
