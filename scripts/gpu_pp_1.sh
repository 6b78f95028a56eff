#!/usr/bin/env bash
# (Ran on commit f4a7dfd; the ping-pong kernel was removed in the next commit.)
# Device call 4 (perf-notes 29, H100): ping-pong consumers (each takes whole 128 x 128 tiles in turn, a 2-slot ring each)
# against the routed 4-slot kernel and the Triton pick (WS routing off), paired, on wgrads of 128-1024 rows a group.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
CASES=qwen3-30b-fc1,qwen3-30b-fc2,gptoss-120b-fc1,finegrain-e256-fc2,qwen3next-ep2-fc2,dsv2lite-fc2,gptoss-20b-fc2,glm45air-ep4-fc2,olmoe-fc1,dsv3-ep8-fc2
timeout 60 python scripts/debug_pingpong.py 2>&1 | tail -4
MOEGEMM_WS_WGRAD=0 OUT=$OUT timeout 300 python scripts/probe_wgrad_ws_tma.py --cases $CASES --stages 4,pp4 2>&1 | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:400]); continue
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('case', 'relerr', 'nan', 'variant', 'zeros_ok') or k.endswith('vs_torch') or k.endswith('error')})
"
echo done
