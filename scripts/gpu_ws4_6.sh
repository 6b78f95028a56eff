#!/usr/bin/env bash
# Device call 9 (perf-notes 29, H100): the WS wgrad on 128 x 128 tiles (5 or 6 slots, a staging tile per consumer)
# against the 4-slot 128 x 256 kernel and the Triton pick (WS routing off), paired, on the output-bound 128-row wgrads
# and three 384-1024-row ones.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
CASES=qwen3-30b-fc1,qwen3-30b-fc2,gptoss-120b-fc1,qwen3next-ep2-fc2,finegrain-e256-fc2,dsv2lite-fc2,gptoss-20b-fc2,glm45air-ep4-fc2,dsv3-ep8-fc2
MOEGEMM_WS_WGRAD=0 OUT=$OUT timeout 300 python scripts/probe_wgrad_ws_tma.py --cases $CASES --stages 4,6n128,5n128 2>&1 | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:400]); continue
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('case', 'relerr', 'nan', 'variant', 'zeros_ok') or k.endswith('vs_torch') or k.endswith('error')})
"
echo done
