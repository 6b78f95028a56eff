#!/usr/bin/env bash
# Device call 8 (perf-notes 29, H100): the 4-slot WS wgrad handing the shared staging tile over at the start of the next
# tile (before its first data wait) against the kernel handing it over after that tile's first wgmma
# (scripts/k_grouped_ws_prev.py, carried: the file at commit 4f79d9e), paired, on the routed suite + held-out wgrads.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
CASES=dsv3-ep8-fc1,dsv3-ep8-fc2,mixtral-fc1,dsv2lite-fc1,dsv2lite-fc2,qwen3-235b-ep8-fc1,kimi-k2-ep8-fc1,mixtral-8x22b-fc2,gptoss-20b-fc2,olmoe-fc1,glm45air-ep4-fc2,phi35moe-fc2,dbrx-ep4-fc1
OUT=$OUT timeout 300 python scripts/probe_wgrad_ws_tma.py --cases $CASES --stages 4,prev4 2>&1 | python -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:400]); continue
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('case', 'relerr', 'nan', 'variant', 'zeros_ok') or k.endswith('vs_torch') or k.endswith('error')})
"
python - <<'PY'
import json, math, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/wgrad_ws_tma.jsonl") if l.strip()]
rows = [r for r in rows if "ws4_ms" in r and "wsprev4_ms" in r]
gm = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")
print("new/prev geomean", gm([r["wsprev4_ms"] / r["ws4_ms"] for r in rows]), "n", len(rows))
PY
echo done
