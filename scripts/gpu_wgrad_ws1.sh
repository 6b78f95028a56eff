#!/usr/bin/env bash
# Device call 9 (perf-notes 28, H100): the warp-specialized Gluon wgrad with a TMA loader and TMA-store epilogue
# (scripts/probe_wgrad_ws_tma.py): edge-case correctness, then paired timing against the pick and torch.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
CASES=gptoss-20b-fc2,kimi-k2-ep8-fc1,dsv3-ep8-fc1,phi35moe-fc2,dsv2lite-fc2,glm45air-ep4-fc2,olmoe-fc1,qwen3-235b-ep8-fc1,mixtral-fc1,dsv3-ep8-fc2,qwen3-30b-fc1
OUT=$OUT timeout 420 python scripts/probe_wgrad_ws_tma.py --cases $CASES --stages 2,3 2>&1 | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:400]); continue
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('case', 'relerr', 'nan', 'zeros_ok') or k.endswith('vs_torch') or k.endswith('error') or k.endswith('relerr')})
"
echo done
