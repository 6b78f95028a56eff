#!/usr/bin/env bash
# Device call 10 (perf-notes 28, H100): the warp-specialized TMA wgrad on every suite and held-out wgrad launch, paired
# against the pick and torch (the suite's rows-per-group rule, then the held-out check).
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
OUT=$OUT timeout 500 python scripts/probe_wgrad_ws_tma.py --cases suite,heldout --stages 3 2>&1 | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:400]); continue
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('case', 'relerr', 'nan', 'zeros_ok') or k.endswith('vs_torch') or k.endswith('error')})
"
echo done
