#!/usr/bin/env bash
# Device call 15 (H100): deeper-pipelined flat 128 x 256 wgrad tiles (32-row steps in 5-6 stages, 64-row steps in
# 4) against the pick, paired timing, on the wgrad launches that trail or tie torch.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
CASES=gptoss-20b-fc2,kimi-k2-ep8-fc1,phi35moe-fc2,dsv2lite-fc1,dsv2lite-fc2,glm45air-ep4-fc2,qwen3-235b-ep8-fc1,gptoss-120b-fc1,olmoe-fc1,dsv3-ep8-fc1,mixtral-fc1,qwen3-30b-fc1
OUT=$OUT timeout 560 python scripts/probe_wgrad_tma_load.py --paired --cases $CASES \
  --variants pickt,r32s6t,r32s5t,s4t 2>&1 | cut -c1-300 | tail -14
echo done
