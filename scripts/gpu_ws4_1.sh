#!/usr/bin/env bash
# Device call 1 (perf-notes 29, H100): the WS wgrad with a 4-slot ring and one staging tile the consumers take turns
# on, against the 3-slot kernel and the Triton pick (WS routing off) on every wgrad launch of suite + held-out;
# then its GPU tests and compute-sanitizer with the table at 4 slots; the bench if 4 slots won on geomean.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
MOEGEMM_WS_WGRAD=0 OUT=$OUT timeout 200 python scripts/probe_wgrad_ws_tma.py --cases suite,heldout --stages 3,4 \
  2>&1 | tee "$OUT/probe.log" | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:400]); continue
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('case', 'relerr', 'nan', 'variant', 'zeros_ok') or k.endswith('vs_torch') or k.endswith('error')})
"
python - <<'PY'
import json, math, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/wgrad_ws_tma.jsonl") if l.strip()]
rows = [r for r in rows if "ws4_ms" in r and "ws3_ms" in r]
gm = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")
print("ws4/ws3 geomean", gm([r["ws3_ms"] / r["ws4_ms"] for r in rows]), "n", len(rows))
print("ws4/pick geomean", gm([r["pick_ms"] / r["ws4_ms"] for r in rows]))
open(os.environ["OUT"] + "/go", "w").write("1" if gm([r["ws3_ms"] / r["ws4_ms"] for r in rows]) > 1.0 else "0")
PY
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_k_grouped.py -k "Ws or ws" 2>&1 \
  | tee "$OUT/gpu-pytest-k-ws.log" | tail -3
timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 1 python -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_k_grouped.py -k "TestKGroupedWs and (ws_problems or fp16)" 2>&1 \
  | tee "$OUT/sanitizer-k-ws.log" | tail -3
if [ "$(cat $OUT/go)" = 1 ]; then
  timeout 200 python -m moegemm.bench --cases suite,heldout --impls moegemm,torch._grouped_mm \
    --out "$OUT/bench-ws4.json" --no-plot 2>&1 | tail -3
fi
echo done
