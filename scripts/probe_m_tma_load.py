"""GPU probe (H100): the m-grouped (fwd/dgrad) kernel reading x and w through TMA descriptors
(MOEGEMM_TMA_LOAD) against the same launch with cp.async, next to torch._grouped_mm.

    OUT=/tmp/probe python scripts/probe_m_tma_load.py [--cases suite,heldout] [--ops fwd,dgrad]
    OUT=/tmp/probe python scripts/probe_m_tma_load.py --host   # host cost per call, TMA loads vs cp.async

Variants (``VARIANTS``): the launcher's config with cp.async or TMA loads, and configs that TMA loads may
admit. Timing: medians of CUDA-event times with the variants and torch taking turns call by call
(``paired_ms``: the first run, which timed each variant in one block, moved up to 10% between two blocks of
the same variant as the clock drifted); each variant's output is checked against torch's first
(NaN-poisoned). Appends JSON lines to $OUT/m_tma_load.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import torch

from moegemm import configs, shapes
from moegemm.kernels import m_grouped
from moegemm.torch import _launch

LOG = os.path.join(os.environ.get("OUT", "."), "m_tma_load.jsonl")
PICK = configs.pick_config
FLAT_MAX_K = m_grouped.FLAT_MAX_K
MIN_FLOPS = _launch.TMA_LOAD_MIN_FLOPS
WHOLE_MAX_K = getattr(m_grouped, "FLAT_WHOLE_TILES_MAX_K", None)
SPECS = []  # the spec of every m-grouped launch, to read back which loads it took


def _record_specs() -> None:
    # M_GROUPED_TMA: the host-descriptor launch of the code before perf-notes 32 (the A/B runs it).
    for direct in filter(None, (_launch.M_GROUPED, getattr(_launch, "M_GROUPED_TMA", None))):
        inner = direct.launch
        direct.launch = lambda spec, *a, inner=inner: (SPECS.append(spec), inner(spec, *a))


def record(**kw) -> None:
    kw = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in kw.items()}
    print(json.dumps(kw), flush=True)
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


def relerr(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def host_rounds(samples: dict, switch, call, rounds: int, calls: int) -> None:
    """Appends to samples[variant] the median host time of ``calls`` calls, the variants taking turns (``switch``)
    over ``rounds`` rounds (a host that drifts moves them alike); sorts each list."""
    from moegemm.bench.overhead import median_host_us

    torch.cuda.synchronize()
    for _ in range(rounds):
        for variant, values in samples.items():
            switch(variant)
            call()
            values.append(median_host_us(call, calls))
            torch.cuda.synchronize()
    for values in samples.values():
        values.sort()


def host(rounds: int = 7, calls: int = 200) -> None:
    """Host time per fwd call (G 8, M 4096, K = N = 512, bf16, the table's default tile) with cp.async, with TMA loads,
    and with TMA loads and the TMA store (both FLOP gates lifted: this shape is below them), taking turns over
    rounds: median of the round medians."""
    G, M, K, N = 8, 4096, 512, 512
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    gs = torch.full((G,), M // G, dtype=torch.int32, device="cuda")
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    _launch.TMA_LOAD_MIN_FLOPS = 0
    _launch.TMA_STORE_MIN_FLOPS = 0
    # The table's default tile (128 x 256, one CTA an SM) has room for the staging tile; the pick here has not.
    config = configs.candidates("m_grouped", "sm90")[0]
    configs.pick_config = lambda o, *a, **k: config if o == "m_grouped" else PICK(o, *a, **k)
    _launch.clear_launch_cache()
    call = functools.partial(_launch.launch_m_grouped, x, w, gs, out, transpose_w=True)
    modes = {"cp": (False, False), "tma": (True, False), "tma-store": (True, True)}
    samples = {variant: [] for variant in modes}
    took = {}

    def switch_host(variant):
        _launch.TMA_LOAD, _launch.TMA_STORE = modes[variant]

    for variant in samples:  # compile and bind each first
        switch_host(variant)
        SPECS.clear()
        call()
        meta = _launch._m_launch(*SPECS[-1]).meta
        took[variant] = (meta["TMA_LOAD"], meta["TMA_STORE"])
    host_rounds(samples, switch_host, call, rounds, calls)
    for variant, values in samples.items():
        record(
            kind="host", variant=variant, took_tma_load=took[variant][0], took_tma_store=took[variant][1],
            host_us=values[len(values) // 2], rounds=values,
        )  # fmt: skip


# name: (TMA loads, config override: None for the launcher's pick, or (candidate, changes)[, mixed heights, split
# tail, flat loop, TMA store, flat at any K, both FLOP gates, FLAT_WHOLE_TILES_MAX_K]); a flag left out (or None)
# takes the launcher's default.
VARIANTS = {
    "cp": (False, None),
    "tma": (True, None),
    "tma-c0s4": (True, (0, {"num_stages": 4})),  # 192 KB ring, no room for the TMA store's staging tile
    # Mixed tile heights (configs.MIXED_M, perf-notes 27) off: every row tile BLOCK_M high.
    "cp-uniform": (False, None, False),
    "tma-uniform": (True, None, False),
    "tma-uniform-aa": (True, None, False),  # the same launch again: the A/A control of the paired clock
    # The last round's tiles split in half-high halves (configs.TAIL_SPLIT, perf-notes 30) off.
    "tma-whole": (True, None, True, False),
    "tma-whole-aa": (True, None, True, False),
    # One flat loop over every step of a program's tiles (configs.M_FLAT): uniform tiles, register store.
    "tma-flat": (True, None, True, True, True),
    "tma-aa": (True, None),  # the launcher's pick again: the A/A control
    # The flat loop at any K (FLAT_MAX_K lifted): every tile stored in one bulk copy through the clipped 3-D view
    # (the TMA store), and from registers (the TMA store off, as "tma-flat" at K <= FLAT_MAX_K).
    "tma-flat-clip": (True, None, True, True, True, True, True),
    "tma-flat-reg": (True, None, True, True, True, False, True),
    # The launcher's defaults (an A/B between two commits runs it), and with both FLOP gates at 0: every launch with
    # TMA loads and store where its inputs allow.
    "pick": (True, None, True, True, True, True),
    "pick-aa": (True, None, True, True, True, True),
    "pick-gate0": (True, None, True, True, True, True, False, 0),
    # The launcher's defaults without the flat loop for whole-tile group sizes beyond FLAT_MAX_K (FLAT_WHOLE_TILES).
    "pick-nowhole": (True, None, True, True, True, True, False, None, 0),
}
# Registry cases at fewer tokens (a smaller batch or more EP ranks), launches of 1.3e10-3.4e10 FLOPs, below the
# TMA gates (--cases small).
SMALL = [
    shapes.Case("qwen3-30b-fc1-m4k", 128, 4096, 2048, 1536),
    shapes.Case("qwen3-30b-fc2-m4k", 128, 4096, 768, 2048),
    shapes.Case("olmoe-fc1-m4k", 64, 4096, 2048, 2048),
    shapes.Case("dsv2lite-fc2-m4k", 64, 4096, 1408, 2048),
    shapes.Case("gptoss-20b-fc2-m2k", 32, 2048, 2880, 2880),
    shapes.Case("glm45air-ep4-fc2-m2k", 32, 2048, 1408, 4096),
    shapes.Case("qwen3next-ep2-fc2-m8k", 256, 8192, 512, 2048),
    shapes.Case("dsv3-ep8-fc2-m1k", 32, 1024, 2048, 7168),
]


def switch(variant: str) -> None:
    tma, override, *flags = VARIANTS[variant]
    configs.MIXED_M = flags[0] if flags else True
    configs.TAIL_SPLIT = flags[1] if len(flags) > 1 else True
    configs.M_FLAT = flags[2] if len(flags) > 2 else False
    _launch.TMA_STORE = flags[3] if len(flags) > 3 else True
    m_grouped.FLAT_MAX_K = 1 << 30 if len(flags) > 4 and flags[4] else FLAT_MAX_K
    _launch.TMA_LOAD_MIN_FLOPS = _launch.TMA_STORE_MIN_FLOPS = (
        flags[5] if len(flags) > 5 and flags[5] is not None else MIN_FLOPS
    )
    if hasattr(m_grouped, "FLAT_WHOLE_TILES_MAX_K"):
        m_grouped.FLAT_WHOLE_TILES_MAX_K = flags[6] if len(flags) > 6 else WHOLE_MAX_K
    _launch.TMA_LOAD = tma
    if override is None:
        configs.pick_config = PICK
    else:
        index, changes = override
        config = dataclasses.replace(configs.candidates("m_grouped", "sm90")[index], **changes)
        configs.pick_config = lambda o, *a, **k: config if o == "m_grouped" else PICK(o, *a, **k)
    _launch.clear_launch_cache()


@functools.cache
def _flush_buffer() -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.int8, device="cuda")


def paired_ms(fns: dict, reps: int) -> dict:
    """Medians of CUDA-event times, the variants taking turns rep by rep (a clock that drifts over the
    run moves all of them alike), L2 flushed before each timed call, each preceded by an untimed call
    that binds its launch."""
    flush = _flush_buffer()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, (prepare, fn) in fns.items():
            prepare()
            fn()
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", action="store_true")
    p.add_argument("--cases", default="suite,heldout")
    p.add_argument("--ops", default="fwd,dgrad")
    p.add_argument("--split", default="dirichlet")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args()
    _record_specs()
    if args.host:
        host()
        return 0
    names = args.cases.split(",")
    cases = shapes.select([n for n in names if n != "small"]) + (SMALL if "small" in names else [])
    for case in cases:
        sizes = shapes.group_sizes(case.M, case.G, split=args.split)
        gs = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        offs = gs.cumsum(0).to(torch.int32)
        x = torch.randn(case.M, case.K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(case.M, case.N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(case.G, case.N, case.K, device="cuda", dtype=torch.bfloat16)
        for op in args.ops.split(","):
            if op == "fwd":
                out = torch.empty(case.M, case.N, device="cuda", dtype=torch.bfloat16)
                peer = functools.partial(torch._grouped_mm, x, w.mT, offs=offs, out_dtype=torch.bfloat16)
                ours = functools.partial(_launch.launch_m_grouped, x, w, gs, out, transpose_w=True)
            else:
                out = torch.empty(case.M, case.K, device="cuda", dtype=torch.bfloat16)
                peer = functools.partial(torch._grouped_mm, dy, w, offs=offs, out_dtype=torch.bfloat16)
                ours = functools.partial(_launch.launch_m_grouped, dy, w, gs, out)
            want = peer()
            row = dict(case=case.name, op=op, G=case.G, M=case.M, K=case.K, N=case.N, split=args.split)
            fns = {"torch": (lambda: None, peer)}
            for variant in args.variants.split(","):
                switch(variant)
                try:
                    out.fill_(float("nan"))
                    ours()
                    meta = _launch._m_launch(*SPECS[-1]).meta
                    row[f"{variant}_took_tma"] = meta["TMA_LOAD"]
                    row[f"{variant}_mixed_m"] = meta["MIXED_M"]
                    row[f"{variant}_tail_split"] = meta["TAIL_SPLIT"]
                    row[f"{variant}_programs"] = meta["NUM_PROGRAMS"]
                    row[f"{variant}_block_m"] = meta["BLOCK_M"]
                    row[f"{variant}_flat"] = meta["FLAT"]
                    row[f"{variant}_flat_whole_tiles"] = meta.get("FLAT_WHOLE_TILES", False)
                    row[f"{variant}_tma_store"] = meta["TMA_STORE"]
                    row[f"{variant}_relerr"] = err = relerr(out, want)
                    if not err < 1e-2:
                        row[f"{variant}_error"] = "relerr above 1e-2"
                        continue
                    fns[variant] = (functools.partial(switch, variant), ours)
                except Exception as e:
                    row[f"{variant}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            for name, ms in paired_ms(fns, args.reps).items():
                row[f"{name}_ms"] = ms
                if name != "torch":
                    row[f"{name}_vs_torch"] = row["torch_ms"] / ms
            if "cp_ms" in row:
                for variant in fns:
                    if variant not in ("torch", "cp"):
                        row[f"{variant}_over_cp"] = row["cp_ms"] / row[f"{variant}_ms"]
            for variant in fns:  # mixed tile heights over every tile full height; split tail over whole
                if f"{variant}-uniform_ms" in row:
                    row[f"{variant}_over_uniform"] = row[f"{variant}-uniform_ms"] / row[f"{variant}_ms"]
                if f"{variant}-whole_ms" in row:
                    row[f"{variant}_over_whole"] = row[f"{variant}-whole_ms"] / row[f"{variant}_ms"]
            record(**row)
    switch("tma")
    return 0


if __name__ == "__main__":
    sys.exit(main())
