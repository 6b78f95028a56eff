#!/usr/bin/env bash
# Device call 2 of perf-notes 27 (H100): mixed tile heights against every tile full height once more, with an A/A
# control (the full-height launch twice) to size the paired clock's noise per launch.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
OUT=$OUT timeout 330 python scripts/probe_m_tma_load.py --cases suite,heldout --ops fwd,dgrad --reps 31 \
  --variants tma-uniform,tma,tma-uniform-aa 2>&1 | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:300]); continue
    u = r.get('tma-uniform_ms', 0)
    print(r['case'], r['op'], r.get('tma_mixed_m'), 'mixed/uni=%.4f' % (u / r.get('tma_ms', 1)), 'aa/uni=%.4f' % (u / r.get('tma-uniform-aa_ms', 1)), r.get('tma_error', ''))
"
echo done
