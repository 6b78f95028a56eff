#!/usr/bin/env bash
# Device call 15 (perf-notes 28, H100): the WS wgrad with a 4-slot ring and split half-tile stores
# (scripts/probe_wgrad_ws_split.py) against the routed 3-slot kernel, on the nine launches the rule routes.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
CASES=gptoss-20b-fc2,kimi-k2-ep8-fc1,dsv3-ep8-fc1,dsv3-ep8-fc2,phi35moe-fc2,dsv2lite-fc1,dsv2lite-fc2,glm45air-ep4-fc2,olmoe-fc1
OUT=$OUT timeout 300 python scripts/probe_wgrad_ws_split.py --cases $CASES 2>&1 | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:400]); continue
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('case', 'relerr', 'nan') or k.endswith('vs_torch') or k.endswith('relerr')})
"
echo done
