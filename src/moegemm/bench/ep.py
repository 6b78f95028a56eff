"""``--ep`` (issue 14): expert parallelism through ``group_offset`` against the local-rows ideal (JAX).

Layout of one EP shard, megablox style: the token rows of all ``ep`` shards are present (M_total =
ep * M, sorted by expert, G_total = ep * G group sizes), the shard holds G experts starting at
``group_offset = shard * G`` (a middle shard, so local rows have rows of other experts before and
after them), and each case's (G, M, K, N) is that shard's local problem. Per op, device time of:

- ``group_offset``: what the EP path runs: fwd ``ragged_dot(x_total, w_local, sizes_total,
  group_offset)``, dgrad the same on dy with the weight read transposed, wgrad
  ``k_grouped_mm(dy_total, x_total, sizes_total, group_offset, num_groups=G)``. The m-grouped ops also
  zero-fill the (ep - 1) * M rows of other experts (the contract: those rows are 0, which the EP
  psum relies on);
- ``local rows (ideal)``: the same kernels on only the local rows (x_total[local rows], local sizes);
- ``roll (before)``: the former EP path, for the journal: roll the local rows to the top, run the
  kernel on the rolled copy, roll the output back (two extra passes over rows);
- ``zero-fill floor``: an XLA fill of the (ep - 1) * M non-local output rows alone, the bytes the
  contract adds to the ideal (m-grouped ops only).

Device time is the CUPTI sum of every kernel in ``calls`` back-to-back calls (bench/timing.py), the
clock the main benchmark uses. Outputs are checked before timing: the local rows against the ideal,
every other row exactly 0, wgrad against the ideal. Records: ``ms`` (device time), and on each
group_offset record ``vs_ideal``, ``vs_ideal_plus_zero_fill``, ``roll_vs_ideal``. Without a GPU the run
checks and times nothing (interpreter and XLA:CPU times are not performance): records hold the checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from moegemm import shapes
from moegemm._src import layout

OPS = ("fwd", "dgrad", "wgrad")


def _arrays(case: shapes.Case, ep: int, seed: int):
    import jax
    import jax.numpy as jnp

    local = shapes.group_sizes(case.M, case.G, seed=seed)
    sizes = local * ep  # every shard's experts get the same routing skew
    M_total = case.M * ep
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(keys[0], (M_total, case.K), jnp.bfloat16)
    dy = jax.random.normal(keys[1], (M_total, case.N), jnp.bfloat16)
    w = jax.random.normal(keys[2], (case.G, case.N, case.K), jnp.bfloat16) * (case.K**-0.5)
    return local, jnp.asarray(sizes, jnp.int32), x, dy, w


def _fns(case: shapes.Case, ep: int, shard: int, backend: str, arrays) -> dict[str, dict[str, tuple]]:
    """{op: {impl: (jitted fn, its arguments)}}; the ideal gets the local rows, sliced here (untimed)."""
    import jax
    import jax.numpy as jnp

    from moegemm.jax import api

    local, sizes, x, dy, w = arrays
    G, M = case.G, case.M
    offset = jnp.int32(shard * G)
    first_row = shard * M  # every shard's rows sum to M
    x_local, dy_local = x[first_row : first_row + M], dy[first_row : first_row + M]
    local_sizes = jnp.asarray(local, jnp.int32)

    def ep_path(op):
        def fn(x, dy, w, gs):
            if op == "fwd":  # what ragged_dot(x, w^T, gs, group_offset=...) runs, w read transposed
                return api.m_grouped_mm(x, w, gs, transpose_w=True, group_offset=offset, backend=backend)
            if op == "dgrad":
                return api.m_grouped_mm(dy, w, gs, group_offset=offset, backend=backend)
            return api.k_grouped_mm(
                dy, x, gs, group_offset=offset, num_groups=G, out_dtype=jnp.bfloat16, backend=backend
            )

        return fn

    def ideal(op):
        def fn(x, dy, w, gs):
            if op == "fwd":
                return api.m_grouped_mm(x, w, gs, transpose_w=True, backend=backend)
            if op == "dgrad":
                return api.m_grouped_mm(dy, w, gs, backend=backend)
            return api.k_grouped_mm(dy, x, gs, out_dtype=jnp.bfloat16, backend=backend)

        return fn

    def roll(op):
        def fn(x, dy, w, gs):
            start, local = layout.local_groups(gs, offset, G, x.shape[0], jnp)
            x, dy = jnp.roll(x, -start, axis=0), jnp.roll(dy, -start, axis=0)
            if op == "wgrad":
                return api.k_grouped_mm(dy, x, local, out_dtype=jnp.bfloat16, backend=backend)
            out = (
                api.m_grouped_mm(x, w, local, transpose_w=True, backend=backend)
                if op == "fwd"
                else api.m_grouped_mm(dy, w, local, backend=backend)
            )
            return jnp.roll(out, start, axis=0)

        return fn

    def zero_fill(op):
        cols = case.N if op == "fwd" else case.K

        def fn(x, dy, w, gs):
            # The non-local rows' bytes as one XLA fill; the scalar keeps XLA from folding it away.
            return jnp.full((x.shape[0] - M, cols), gs[0], jnp.bfloat16)

        return fn

    total, ideal_args = (x, dy, w, sizes), (x_local, dy_local, w, local_sizes)
    out = {}
    for op in OPS:
        out[op] = {
            "group_offset": (jax.jit(ep_path(op)), total),
            "local rows (ideal)": (jax.jit(ideal(op)), ideal_args),
            "roll (before)": (jax.jit(roll(op)), total),
        }
        if op != "wgrad":
            out[op]["zero-fill floor"] = (jax.jit(zero_fill(op)), total)
    return out


def _check(op: str, got, ideal, first_row: int, M: int) -> str:
    got, ideal = np.asarray(got, np.float32), np.asarray(ideal, np.float32)
    if op == "wgrad":
        local = got
    else:
        local = got[first_row : first_row + M]
        outside = np.concatenate([got[:first_row], got[first_row + M :]])
        if outside.any():
            return f"failed: {int((outside != 0).sum())} nonzero elements outside the local rows"
    denom = float(np.linalg.norm(ideal)) or 1.0
    err = float(np.linalg.norm(local - ideal)) / denom
    return "ok" if err <= 1e-2 else f"failed: relerr {err:.2e} against the local-rows run"


def run(cases, ep_sizes, device: torch.device, out: Path, *, calls: int = 20, seed: int = 0) -> list[dict]:
    """Times every case x ep x op; writes ``out`` (JSON) and prints a table. Returns the records."""
    import jax
    from rich.console import Console
    from rich.table import Table

    from moegemm.bench import harness, timing

    backend = "auto"
    records = []
    console = Console(width=160)
    for case in cases:
        for ep in ep_sizes:
            shard = ep // 2
            fns = _fns(case, ep, shard, backend, _arrays(case, ep, seed))
            first_row = shard * case.M
            for op in OPS:
                results = {name: fn(*args) for name, (fn, args) in fns[op].items()}
                ideal = results["local rows (ideal)"]
                for name, (fn, args) in fns[op].items():
                    if name == "zero-fill floor":
                        status = "ok"
                    elif name == "local rows (ideal)":
                        status = "ok (the reference for the others)"
                    else:
                        status = _check(op, results[name], ideal, first_row, case.M)
                    rec = dict(case=case.name, ep=ep, op=op, impl=name, status=status, G=case.G, M=case.M)
                    rec.update(K=case.K, N=case.N, M_total=case.M * ep, G_total=case.G * ep, calls=calls)
                    if status.startswith("ok") and device.type == "cuda":
                        rec["ms"] = timing.device_ms(lambda fn=fn, args=args: fn(*args), device, calls)
                    records.append(rec)
                del results, ideal
            del fns
    _ratios(records)
    env = harness.Environment.detect(device)
    meta = dict(
        what="moegemm-jax expert parallelism: group_offset vs the same kernels on the local rows",
        device=env.device,
        date=env.date,
        jax=jax.__version__,
        triton=env.triton,
        clock=f"CUPTI device time, {calls} back-to-back calls" if device.type == "cuda" else None,
        performance=device.type == "cuda",
        layout="M_total = ep * M rows sorted by expert, G_total = ep * G; shard ep // 2 holds G experts",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")

    if device.type != "cuda":
        _check_table(console, records)
        console.print(f"wrote {out}")
        return records
    table = Table(title=f"EP via group_offset vs local rows ({meta['clock']})")
    for col in (
        "case",
        "ep",
        "op",
        "group_offset ms",
        "ideal ms",
        "ratio",
        "ideal+zero-fill",
        "roll (before)",
    ):
        table.add_column(col)
    for rec in records:
        if rec["impl"] != "group_offset":
            continue
        table.add_row(
            rec["case"],
            str(rec["ep"]),
            rec["op"],
            _fmt(rec.get("ms")),
            _fmt(rec.get("ideal_ms")),
            _fmt(rec.get("vs_ideal"), "{:.3f}x"),
            _fmt(rec.get("vs_ideal_plus_zero_fill"), "{:.3f}x"),
            _fmt(rec.get("roll_vs_ideal"), "{:.3f}x"),
        )
    console.print(table)
    console.print(f"wrote {out}")
    return records


def _check_table(console, records: list[dict]) -> None:
    """Without a GPU: each output's check against the local-rows run, and no time."""
    from rich.table import Table

    table = Table(title="EP via group_offset: outputs checked against the local-rows run (nothing timed)")
    for col in ("case", "ep", "op", "impl", "check"):
        table.add_column(col)
    for rec in records:
        table.add_row(rec["case"], str(rec["ep"]), rec["op"], rec["impl"], rec["status"])
    console.print(table)
    failed = sum(rec["status"].startswith("failed") for rec in records)
    console.print(f"correctness {'FAIL' if failed else 'PASS'}: {len(records) - failed}/{len(records)} ok")


def _ratios(records: list[dict]) -> None:
    """Adds to each group_offset record: ideal_ms, vs_ideal (time / ideal), the same against ideal +
    zero-fill floor, and the former roll path's time / ideal."""
    by = {(r["case"], r["ep"], r["op"], r["impl"]): r.get("ms") for r in records}
    for r in records:
        if r["impl"] != "group_offset" or r.get("ms") is None:
            continue
        key = (r["case"], r["ep"], r["op"])
        ideal, fill, roll = (
            by.get((*key, name)) for name in ("local rows (ideal)", "zero-fill floor", "roll (before)")
        )
        if ideal:
            r["ideal_ms"] = ideal
            r["vs_ideal"] = r["ms"] / ideal
            r["vs_ideal_plus_zero_fill"] = r["ms"] / (ideal + (fill or 0.0))
            if roll:
                r["roll_vs_ideal"] = roll / ideal


def _fmt(value, fmt: str = "{:.4f}") -> str:
    return "-" if value is None else fmt.format(value)
