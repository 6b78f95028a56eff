"""``--tune``: time every candidate tile config of moegemm per (case, op) and commit the fastest.

Candidates are ``configs.TABLE[(op_kind, target)]`` (op_kind "m_grouped" for fwd/dgrad, "k_grouped"
for wgrad). A config is forced by swapping ``moegemm._src.configs.pick_config`` (the launcher looks it up
through the module on every call) for one that returns the candidate; ``harness.config_spy`` records
the launcher's own arguments, and the cache key is built from those, so it matches what
``pick_config`` will look up later (dgrad's and wgrad's launcher N and K are the case's K and N
swapped). The winner is merged into
``<cache_dir>/<device-slug>.json`` and ``configs.load_cache`` is cleared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from pathlib import Path

from moegemm._src import configs
from moegemm.bench import harness
from moegemm.bench.registry import REGISTRY

OP_KIND = {"fwd": "m_grouped", "dgrad": "m_grouped", "wgrad": "k_grouped"}


@contextlib.contextmanager
def force_config(config):
    """Every ``configs.pick_config`` call returns ``config`` (the launchers look it up per call), and the
    warp-specialized wgrad routes nothing (``pick_k_ws_config``: None), so the candidate is what runs."""
    from moegemm._src.torch import launch as _launch
    from moegemm._src.torch import launch_fp8 as _launch_fp8

    original, original_ws = configs.pick_config, configs.pick_k_ws_config
    configs.pick_config = lambda op, target, **kwargs: config
    configs.pick_k_ws_config = lambda **kwargs: None
    _launch.clear_launch_cache()
    _launch_fp8.clear_launch_cache()
    try:
        yield
    finally:
        configs.pick_config, configs.pick_k_ws_config = original, original_ws
        _launch.clear_launch_cache()
        _launch_fp8.clear_launch_cache()


def tune(
    spec: harness.RunSpec,
    env: harness.Environment,
    *,
    target: str = "sm90",
    cache_dir: Path = configs.CACHE_DIR,
    progress=lambda _: None,
    on_case=lambda _: None,
) -> tuple[list[dict], Path]:
    """Returns (one record per candidate, with "config" and "best" added; the cache file written).

    The cache is merged after every case, so a run cut short keeps the cases it finished.
    """
    impl = REGISTRY["moegemm"]
    records, winners = [], {}
    path = Path(cache_dir) / f"{configs.device_slug(env.device)}.json"
    for case in spec.cases:
        problem = spec.problem(case)
        for op in spec.ops:
            reference = harness.lazy(functools.partial(problem.reference, op))
            trial = []
            for config in configs.candidates(OP_KIND[op], target):
                progress(f"tune {problem.case.name} {op} {config}")
                with force_config(config):
                    rec = harness.measure(problem, op, impl, env, tcfg=spec.timing, reference=reference)
                # harness.measure records the launcher's own pick_config arguments as cache_key.
                trial.append({**rec, "config": dataclasses.asdict(config), "best": False})
            ok = [r for r in trial if r["status"] == "ok" and r.get("cache_key")]
            if ok:
                best = min(ok, key=lambda r: r["ms"])
                best["best"] = True
                if best["cache_key"] in winners:
                    progress(
                        f"note: {best['cache_key']} tuned again by {problem.case.name} {op}; last one wins"
                    )
                winners[best["cache_key"]] = best["config"]
            records.extend(trial)
            del reference
        del problem
        path = write_cache(env.device, winners, cache_dir)
        on_case(records)
    return records, path


def write_cache(device_name: str, winners: dict[str, dict], cache_dir: Path = configs.CACHE_DIR) -> Path:
    """Merges ``winners`` into the device's committed cache file (sorted keys, stable diffs)."""
    path = Path(cache_dir) / f"{configs.device_slug(device_name)}.json"
    if not winners:
        return path
    # A new file elsewhere (--cache-dir $OUT on a GPU box) starts from the committed cache, so it can
    # be copied over src/moegemm/_src/tuned_configs/ as a whole.
    base = path if path.exists() else configs.CACHE_DIR / path.name
    cache = json.loads(base.read_text()) if base.exists() else {}
    cache.update(winners)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    configs.load_cache.cache_clear()
    return path
