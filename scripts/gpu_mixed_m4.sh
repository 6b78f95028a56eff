#!/usr/bin/env bash
# Device call 4 of perf-notes 27 (H100): GPU tests of the m-grouped (mixed tile heights, K rule) and k-grouped (int32
# row counts) kernels and GroupedLinear; then the wgrad launches that trail torch: the pick, the flat 128 x 256 with
# cp.async (11f) and with TMA loads (12ft), paired timing.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
timeout 330 python -m pytest -m gpu -q -p no:cacheprovider -x tests/test_m_grouped.py tests/test_k_grouped.py \
  tests/test_grouped_linear.py 2>&1 | tee "$OUT/gpu-pytest.log" | tail -3
CASES=gptoss-20b-fc2,kimi-k2-ep8-fc1,dsv2lite-fc2,glm45air-ep4-fc2,dsv2lite-fc1,olmoe-fc1,qwen3-30b-fc1,dsv3-ep8-fc2
OUT=$OUT timeout 200 python scripts/probe_wgrad_tma_load.py --paired --cases $CASES --variants pickt,11f,12ft 2>&1 \
  | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:200]); continue
    if 'case' in r: print(r['case'], {k: round(v, 3) for k, v in r.items() if k.endswith('_vs_torch')}, r['pick'][-40:])
"
echo done
