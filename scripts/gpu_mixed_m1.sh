#!/usr/bin/env bash
# Device call 1 of perf-notes 27 (H100): mixed tile heights (half-high tail tiles) against every tile full height,
# paired timing over every fwd/dgrad launch (TMA loads where the launcher takes them), the m-grouped GPU tests,
# and the flat 128 x 128 wgrad tile (2 CTAs/SM) with TMA loads against the pick on the wgrad launches that trail.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
OUT=$OUT timeout 240 python scripts/probe_m_tma_load.py --cases suite,heldout --ops fwd,dgrad \
  --variants tma,tma-uniform 2>&1 | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:300]); continue
    print(r['case'], r['op'], r.get('tma_mixed_m'), 'over_uniform=%.4f' % r.get('tma_over_uniform', 0), 'vs_torch=%.3f' % r.get('tma_vs_torch', 0), r.get('tma_error', ''), r.get('tma-uniform_error', ''))
"
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -x tests/test_m_grouped.py -k "mixed or Uniform or TmaLoad" 2>&1 | tail -2
CASES=gptoss-20b-fc2,kimi-k2-ep8-fc1,dsv2lite-fc2,glm45air-ep4-fc2,dsv2lite-fc1,olmoe-fc1,qwen3-30b-fc1,dsv3-ep8-fc2
OUT=$OUT timeout 150 python scripts/probe_wgrad_tma_load.py --paired --cases $CASES \
  --variants pickt,9ft,10ft,9f 2>&1 | cut -c1-400 | tail -9
echo done
