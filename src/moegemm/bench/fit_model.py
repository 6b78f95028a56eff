"""``--fit-model``: calibrate the config cost model (moegemm/cost_model.py) on ``--tune`` records, and
``evaluate`` how well a model picks on records it was not fitted to.

A tune record is one (case, op, config) with its measured time; its ``cache_key`` holds the launcher's
op kind and sizes (dgrad's and wgrad's N and K are the case's swapped), so the fit sees exactly what
``pick_config`` sees. The fit minimises the squared log error of predicted against measured time with
scipy's least_squares, per op kind, over a and b per config and the op's bw, gamma, c0 and p.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from moegemm._src import configs, cost_model

GLOBALS = ("bw", "gamma", "c0", "p")
# Initial values and the transform that keeps each parameter in its range (fitted in log space).
_INIT = {"a": 5e-6, "b": 1e-6, "bw": 2.5e12, "gamma": 0.1, "c0": 5e-6, "p": 3.0}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measured (launch, config): the launcher's sizes, the config and the median seconds."""

    key: str  # case/op, to group the candidates of one launch
    op: str  # op kind: m_grouped or k_grouped
    G: int
    M: int
    N: int
    K: int
    config: object
    seconds: float


def samples(records: list[dict]) -> list[Sample]:
    """Tune (or bench) records with a config and a cache key, BF16 m/k-grouped only."""
    out = []
    for r in records:
        if r.get("status") != "ok" or not r.get("cache_key") or not r.get("config"):
            continue
        op, dtype, g, n, k, _ = r["cache_key"].split("|")
        if op not in cost_model.OP_KINDS or dtype not in ("bfloat16", "float16"):
            continue
        cls = configs.MGroupedConfig if op == "m_grouped" else configs.KGroupedConfig
        out.append(
            Sample(
                key=f"{r['case']}/{r['op']}/{r.get('split', '')}",
                op=op,
                G=int(g[1:]),
                M=int(r["M"]),
                N=int(n[1:]),
                K=int(k[1:]),
                config=cls(**r["config"]),
                seconds=float(r["ms"]) * 1e-3,
            )
        )
    return out


def load_records(paths: list[Path]) -> list[dict]:
    records = []
    for path in paths:
        records.extend(json.loads(Path(path).read_text())["records"])
    return records


def fit(data: list[Sample], *, sms: int, calibrated_on: str = "") -> cost_model.Model:
    """Least-squares fit of every op kind present in ``data``."""
    ops = {}
    for op in cost_model.OP_KINDS:
        rows = [s for s in data if s.op == op]
        if rows:
            ops[op] = _fit_op(op, rows, sms)
    return cost_model.Model(sms=sms, ops=ops, calibrated_on=calibrated_on)


def _fit_op(op: str, rows: list[Sample], sms: int) -> cost_model.OpModel:
    from scipy.optimize import least_squares

    keys = sorted({cost_model.config_fields(s.config) for s in rows})
    works = [cost_model.work(op, s.config, G=s.G, M=s.M, N=s.N, K=s.K, sms=sms) for s in rows]
    measured = np.log([s.seconds for s in rows])
    # Every parameter is fitted as its log (all positive); p as log(p - 1) (p > 1).
    init = [_INIT["a"], _INIT["b"]] * len(keys) + [_INIT[g] - (g == "p") for g in GLOBALS]

    def unpack(x):
        e = np.exp(x)
        per = {k: (e[2 * i], e[2 * i + 1]) for i, k in enumerate(keys)}
        bw, gamma, c0, p_minus_1 = e[2 * len(keys) :]
        return per, (bw, gamma, c0, 1.0 + p_minus_1)

    def residuals(x):
        per, glob = unpack(x)
        pred = [
            cost_model.predict(per[cost_model.config_fields(s.config)], glob, w) for s, w in zip(rows, works)
        ]
        return np.log(pred) - measured

    result = least_squares(residuals, np.log(init), method="trf", max_nfev=20000)
    per, (bw, gamma, c0, p) = unpack(result.x)
    return cost_model.OpModel(per_config=per, bw=bw, gamma=gamma, c0=c0, p=p)


def extend(model: cost_model.Model, data: list[Sample]) -> tuple[cost_model.Model, list[tuple]]:
    """``model`` plus (a, b) for every config in ``data`` it has no coefficients for, each fitted on that
    config's own samples with everything else held (the other configs' a and b, the op's bw, gamma, c0, p):
    a candidate added later is calibrated without moving the model's choice among the others, which a
    refit does (one refit moved GROUP_M on 30 launches nobody re-measured; docs/design.md, 'Cost model').
    Returns the model and the configs added."""
    from scipy.optimize import least_squares

    ops, added = dict(model.ops), []
    for op, om in model.ops.items():
        new = sorted({cost_model.config_fields(s.config) for s in data if s.op == op} - set(om.per_config))
        per = dict(om.per_config)
        glob = (om.bw, om.gamma, om.c0, om.p)
        for key in new:
            rows = [s for s in data if s.op == op and cost_model.config_fields(s.config) == key]
            works = [cost_model.work(op, s.config, G=s.G, M=s.M, N=s.N, K=s.K, sms=model.sms) for s in rows]
            measured = np.log([s.seconds for s in rows])

            def residuals(x, works=works, measured=measured, glob=glob):
                pred = [cost_model.predict(tuple(np.exp(x)), glob, w) for w in works]
                return np.log(pred) - measured

            result = least_squares(residuals, np.log([_INIT["a"], _INIT["b"]]), method="trf", max_nfev=20000)
            per[key] = tuple(float(v) for v in np.exp(result.x))
            added.append((op, key))
        ops[op] = dataclasses.replace(om, per_config=per)
    return dataclasses.replace(model, ops=ops), added


def run_extend(paths: list[Path], out: Path | None, *, target: str = "sm90", console=print) -> dict:
    """Extends the committed model with the configs of ``paths`` it lacks (``extend``) and writes it
    (``out``, default the committed model): its sources and fit summary gain the new records."""
    base_path = cost_model.model_path(target)
    payload = json.loads(base_path.read_text())
    data = samples(load_records(paths))
    model, added = extend(cost_model.Model.from_json(payload), data)
    if not added:
        raise SystemExit(f"every config in {[str(p) for p in paths]} is calibrated already")
    rows = evaluate(model, data, target)
    payload.update(model.to_json())
    payload["extended"] = {
        "sources": [Path(p).name for p in paths],
        "configs": [{"op": op, "fields": list(key)} for op, key in added],
        "fit": summarize(rows),
    }
    out = out or base_path
    out.write_text(json.dumps(payload, indent=1) + "\n")
    cost_model.load.cache_clear()
    for r in rows:
        console(
            f"{r['launch']:<32} model {r['model_vs_best']:.3f} default {r['default_vs_best']:.3f} of best"
        )
    console(f"extended with {added} on {len(data)} samples -> {out}: {payload['extended']['fit']}")
    return payload


def evaluate(model: cost_model.Model, data: list[Sample], target: str = "sm90") -> list[dict]:
    """Per launch: the measured best, the model's pick and the table default, as times and ratios to
    the best (1.0 = the model picked the fastest measured candidate). Only launches whose candidates
    include both picks are scored."""
    groups: dict[str, list[Sample]] = {}
    for s in data:
        groups.setdefault(s.key, []).append(s)
    rows = []
    for key, group in groups.items():
        s0 = group[0]
        timed = {cost_model.config_fields(s.config): s.seconds for s in group}
        candidates = [c for c in configs.candidates(s0.op, target) if cost_model.config_fields(c) in timed]
        ranked = model.rank(s0.op, candidates, G=s0.G, M=s0.M, N=s0.N, K=s0.K)
        default = configs.candidates(s0.op, target)[0]
        if not ranked or cost_model.config_fields(default) not in timed:
            continue
        best = min(timed.values())
        pick = timed[cost_model.config_fields(ranked[0][1])]
        rows.append(
            {
                "launch": key,
                "op": s0.op,
                "G": s0.G,
                "M": s0.M,
                "N": s0.N,
                "K": s0.K,
                "best_ms": best * 1e3,
                "model_ms": pick * 1e3,
                "default_ms": timed[cost_model.config_fields(default)] * 1e3,
                "model_vs_best": best / pick,
                "default_vs_best": best / timed[cost_model.config_fields(default)],
                "predicted_ms": ranked[0][0] * 1e3,
                "model_config": dataclasses.asdict(ranked[0][1]),
            }
        )
    return rows


def cross_validate(data: list[Sample], *, sms: int, target: str = "sm90") -> list[dict]:
    """Leave one case out: fit on every other case's records, score the picks on the left-out case's
    launches. The generalization estimate for a shape nobody tuned."""
    cases = sorted({s.key.split("/")[0] for s in data})
    rows = []
    for case in cases:
        inside = [s for s in data if s.key.split("/")[0] == case]
        model = fit([s for s in data if s.key.split("/")[0] != case], sms=sms)
        rows.extend(evaluate(model, inside, target))
    return rows


def summarize(rows: list[dict]) -> dict:
    def geo(values):
        return math.exp(sum(map(math.log, values)) / len(values)) if values else None

    return {
        "launches": len(rows),
        "model_vs_best_geomean": geo([r["model_vs_best"] for r in rows]),
        "model_vs_best_worst": min((r["model_vs_best"] for r in rows), default=None),
        "default_vs_best_geomean": geo([r["default_vs_best"] for r in rows]),
        "default_vs_best_worst": min((r["default_vs_best"] for r in rows), default=None),
        "model_within_5pct": sum(r["model_vs_best"] >= 0.95 for r in rows),
        "default_within_5pct": sum(r["default_vs_best"] >= 0.95 for r in rows),
    }


def run(paths: list[Path], out: Path | None, *, sms: int, target: str = "sm90", console=print) -> dict:
    """Fit on the records of ``paths`` and write the model (``out``, default the committed model)."""
    records = load_records(paths)
    data = samples(records)
    if not data:
        raise SystemExit(f"no BF16 tune records with configs in {[str(p) for p in paths]}")
    devices = sorted({r.get("device", "") for r in records if r.get("device")})
    model = fit(data, sms=sms, calibrated_on=", ".join(devices))
    out = out or cost_model.model_path(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = evaluate(model, data, target)
    summary = summarize(rows)
    cv = summarize(cross_validate(data, sms=sms, target=target))
    payload = {
        **model.to_json(),
        "sources": [Path(p).name for p in paths],
        "fit": summary,
        "leave_one_case_out": cv,
    }
    out.write_text(json.dumps(payload, indent=1) + "\n")
    cost_model.load.cache_clear()
    for r in rows:
        console(
            f"{r['launch']:<32} model {r['model_vs_best']:.3f} default {r['default_vs_best']:.3f} of best "
            f"(predicted {r['predicted_ms']:.3f} ms, measured best {r['best_ms']:.3f})"
        )
    console(f"fit on {len(data)} samples -> {out}: {summary}")
    console(f"leave one case out: {cv}")
    return {"model": str(out), "summary": summary, "leave_one_case_out": cv, "rows": rows}
