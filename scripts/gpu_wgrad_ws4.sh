#!/usr/bin/env bash
# Device call 14 (perf-notes 28, H100): the WS wgrad's ring in 32-row slots (6 and 5 of them: twice the slots in the same
# shared memory, so a consumer's release frees less and the loader refills sooner) against 3 slots of 64 rows.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
CASES=gptoss-20b-fc2,kimi-k2-ep8-fc1,dsv3-ep8-fc1,dsv3-ep8-fc2,phi35moe-fc2,dsv2lite-fc1,dsv2lite-fc2,glm45air-ep4-fc2,olmoe-fc1,qwen3-235b-ep8-fc1,mixtral-fc1,qwen3-30b-fc1,finegrain-e256-fc2
OUT=$OUT timeout 400 python scripts/probe_wgrad_ws_tma.py --cases $CASES --stages 3,6r32,5r32 2>&1 | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:400]); continue
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('case', 'variant', 'relerr', 'nan', 'zeros_ok') or k.endswith('vs_torch') or k.endswith('error')})
"
echo done
