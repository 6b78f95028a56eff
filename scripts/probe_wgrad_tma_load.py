"""GPU probe (H100): the k-grouped (wgrad) kernel's flat loop with TMA loads (MOEGEMM_TMA_LOAD) against
the launcher's pick and the flat loop with cp.async, per config, next to torch._grouped_mm.

    OUT=/tmp/probe python scripts/probe_wgrad_tma_load.py [--cases suite,heldout] [--variants pick,0f,0ft]
    [--split dirichlet]
    OUT=/tmp/probe python scripts/probe_wgrad_tma_load.py --host   # host cost per call, TMA loads vs cp.async
    OUT=/tmp/probe python scripts/probe_wgrad_tma_load.py --host-store   # host cost per call of each store path

A variant is "pick" (the launcher's own config), or a config index of ``configs.candidates("k_grouped",
"sm90")`` with "f" (forced flat loop) and/or "t" (config.tma_load; without it cp.async). "pick" is the
launcher's choice with TMA loads off (MOEGEMM_TMA_LOAD=0), "pickt" with them allowed. Timing: triton.testing.do_bench medians (CUDA events, L2 cleared before
each run); every variant's bf16 dW is checked against torch's first (NaN-poisoned output). Appends JSON lines
to $OUT/wgrad_tma_load.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import torch
import triton.testing

from moegemm import configs, shapes
from moegemm.torch import _launch

LOG = os.path.join(os.environ.get("OUT", "."), "wgrad_tma_load.jsonl")
PICK = configs.pick_config
# Configs outside the table, by name ("t" suffix: with TMA loads), tried for the mid-size-group wgrad
# (perf-notes 26): 32-row steps in 5-6 stages keep 128-192 rows of the next tile in flight across a tile's
# epilogue with room for the TMA store's staging tile; 4 stages of 64 rows have no room for it.
CUSTOM = {
    "r32s6": configs.KGroupedConfig(128, 256, 32, 8, 8, 6, flat=True),
    "r32s5": configs.KGroupedConfig(128, 256, 32, 8, 8, 5, flat=True),
    "s4": configs.KGroupedConfig(128, 256, 64, 8, 8, 4, flat=True),
}


def record(**kw) -> None:
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    print(json.dumps(kw), flush=True)
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


def force(variant: str) -> None:
    """Sets the launcher's config choice and TMA loads for one variant (see the module docstring)."""
    variant = variant.removesuffix("-aa")  # the same variant again: an A/A control of the paired clock
    variant, _, group_m = variant.partition("@gm")  # "pickt@gm1": the pick with GROUP_M = 1
    if group_m:
        force(variant)
        inner = configs.pick_config

        def pick(o, *a, **k):
            config = inner(o, *a, **k)
            return dataclasses.replace(config, group_m=int(group_m)) if o == "k_grouped" else config

        configs.pick_config = pick
        _launch.clear_launch_cache()
        return
    tma = variant.endswith("t")
    _launch.TMA_LOAD = tma
    spec = variant.removesuffix("t")
    if spec == "pick":
        configs.pick_config = PICK
    elif spec in CUSTOM:
        config = dataclasses.replace(CUSTOM[spec], tma_load=tma)
        configs.pick_config = lambda o, *a, **k: config if o == "k_grouped" else PICK(o, *a, **k)
    else:
        config = configs.candidates("k_grouped", "sm90")[int(spec.removesuffix("f"))]
        config = dataclasses.replace(config, flat=spec.endswith("f") or config.flat, tma_load=tma)
        configs.pick_config = lambda o, *a, **k: config if o == "k_grouped" else PICK(o, *a, **k)
    _launch.clear_launch_cache()


def relerr(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def host(rounds: int = 7, calls: int = 200) -> None:
    """Host time per wgrad call (G 8, M 4096, K = N = 512, bf16, the flat 128 x 256 config) with TMA loads
    and with cp.async, taking turns over rounds: median of the round medians."""
    from probe_m_tma_load import host_rounds

    G, M, K, N = 8, 4096, 512, 512
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    gs = torch.full((G,), M // G, dtype=torch.int32, device="cuda")
    out = torch.empty(G, N, K, device="cuda", dtype=torch.bfloat16)
    _launch.TMA_LOAD_MIN_FLOPS = 0  # (measured before the threshold existed; this shape is below it)
    call = functools.partial(_launch.launch_k_grouped, dy, x, gs, out, False)
    samples = {"11ft": [], "11f": []}
    for variant in samples:  # compile and bind both first
        force(variant)
        call()
    host_rounds(samples, force, call, rounds, calls)
    for variant, values in samples.items():
        record(kind="host", variant=variant, host_us=values[len(values) // 2], rounds=values)
    force("pick")


# --host-store: (TMA loads, TMA store, the warp-specialized kernel) per path of the launcher.
STORE_PATHS = {
    "cp-reg": (False, False, False),
    "cp-store": (False, True, False),
    "tma-store": (True, True, False),
    "ws": (True, True, True),
}


def host_store(rounds: int = 7, calls: int = 200) -> None:
    """Host time per wgrad call (G 8, M 4096, K = N = 512, bf16, both FLOP gates lifted: 512 rows a group, so the
    launcher routes it to the warp-specialized kernel where that is on) on each store path (``STORE_PATHS``),
    taking turns over rounds: median of the round medians. Records which kernel and store each path took."""
    from probe_m_tma_load import host_rounds

    G, M, K, N = 8, 4096, 512, 512
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    gs = torch.full((G,), M // G, dtype=torch.int32, device="cuda")
    out = torch.empty(G, N, K, device="cuda", dtype=torch.bfloat16)
    want = torch._grouped_mm(dy.T, x, offs=gs.cumsum(0).to(torch.int32), out_dtype=torch.bfloat16)
    _launch.TMA_LOAD_MIN_FLOPS = _launch.TMA_STORE_MIN_FLOPS = 0
    call = functools.partial(_launch.launch_k_grouped, dy, x, gs, out, False)
    launched = []
    for name in ("K_GROUPED", "K_GROUPED_TMA", "K_GROUPED_WS"):  # K_GROUPED_TMA: before perf-notes 33
        direct = getattr(_launch, name, None)
        if direct is not None:
            inner = direct.launch
            direct.launch = lambda spec, *a, inner=inner, name=name: (
                launched.append((name, spec)),
                inner(spec, *a),
            )

    def switch_path(path):
        _launch.TMA_LOAD, _launch.TMA_STORE, _launch.WS_WGRAD = STORE_PATHS[path]

    samples = {path: [] for path in STORE_PATHS}
    took = {}
    for path in samples:  # compile, bind and check each first
        switch_path(path)
        out.fill_(float("nan"))
        launched.clear()
        call()
        name, spec = launched[-1]
        meta = {} if name == "K_GROUPED_WS" else _launch._k_launch(*spec).meta
        took[path] = dict(kernel=name, tma_load=meta.get("TMA_LOAD"), tma_store=meta.get("TMA_STORE"),
                          relerr=relerr(out, want))  # fmt: skip
    host_rounds(samples, switch_path, call, rounds, calls)
    for path, values in samples.items():
        record(kind="host-store", path=path, **took[path], host_us=values[len(values) // 2], rounds=values)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", action="store_true")
    p.add_argument("--host-store", action="store_true")
    p.add_argument("--cases", default="suite,heldout")
    p.add_argument("--variants", default="pick,pickt,0f,0ft")
    p.add_argument("--split", default="dirichlet")
    p.add_argument("--paired", action="store_true", help="time torch and the variants in turns (paired_ms)")
    args = p.parse_args()
    if args.host:
        host()
        return 0
    if args.host_store:
        host_store()
        return 0
    for case in shapes.select(args.cases.split(",")):
        sizes = shapes.group_sizes(case.M, case.G, split=args.split)
        gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        offs = gs.cumsum(0).to(torch.int32)
        x = torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(case.M, case.N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(case.G, case.N, case.K, device="cuda", dtype=torch.bfloat16)
        peer = functools.partial(torch._grouped_mm, dy.T, x, offs=offs, out_dtype=torch.bfloat16)
        ours = functools.partial(_launch.launch_k_grouped, dy, x, gs, out, False)
        want = peer()
        row = dict(case=case.name, op="wgrad", G=case.G, M=case.M, K=case.K, N=case.N, split=args.split)
        row["torch_ms"] = triton.testing.do_bench(peer, warmup=10, rep=60, return_mode="median")
        row["pick"] = str(PICK("k_grouped", "sm90", device_name=torch.cuda.get_device_name(), dtype="bfloat16",
                               G=case.G, N=case.K, K=case.N, M=case.M, sms=132))  # fmt: skip
        fns = {"torch": (lambda: None, peer)}
        for variant in args.variants.split(","):
            force(variant)
            try:
                out.fill_(float("nan"))
                ours()
                err = relerr(out, want)
                if args.paired:
                    row[f"{variant}_relerr"] = err
                    if err < 1e-2:
                        fns[variant] = (functools.partial(force, variant), ours)
                    else:
                        row[f"{variant}_error"] = "relerr above 1e-2"
                    continue
                ms = triton.testing.do_bench(ours, warmup=10, rep=60, return_mode="median")
                row[f"{variant}_ms"] = ms
                row[f"{variant}_vs_torch"] = row["torch_ms"] / ms
                row[f"{variant}_relerr"] = err
                if not err < 1e-2:
                    row[f"{variant}_error"] = "relerr above 1e-2"
            except Exception as e:  # a config that does not compile for this shape
                row[f"{variant}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if args.paired:
            from probe_m_tma_load import paired_ms

            for name, ms in paired_ms(fns, 25).items():
                row[f"{name}_ms"] = ms
                if name != "torch":
                    row[f"{name}_vs_torch"] = row["torch_ms"] / ms
        record(**row)
    force("pick")
    return 0


if __name__ == "__main__":
    sys.exit(main())
