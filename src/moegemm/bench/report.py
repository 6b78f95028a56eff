"""Everything a run shows or writes: the rich table, the summary line, the JSON file and the plot; on a
machine without a GPU, the correctness table and line instead (``CPU_NOTICE`` says why).

Where results go: ``default_out`` gives ``benchmarks/results/<device>/<benchmark>.json`` (PNG beside it),
one canonical file per benchmark per device, overwritten by the next run (git history keeps the rest).
CPU runs land in ``benchmarks/results/cpu-<machine>/``, which git ignores.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

from moegemm import shapes
from moegemm.bench import roofline
from moegemm.bench.harness import TORCH_PEER

RECORD_FIELDS = (
    "case",
    "op",
    "impl",
    "status",
    "reason",
    "backend",
    "G",
    "M",
    "K",
    "N",
    "dtype",
    "split",
    "seed",
    "ms",
    "ms_q25",
    "ms_q75",
    "device_ms",
    "host_us",
    "tflops",
    "floor_tflops",
    "floor_bound",
    "pct_floor",
    "relerr",
    "tol",
    "peak_mb",
    "speedup",
    "device_speedup",
    "vs_torch",
    "timing",
    "copies",
    "device",
    "date",
    "torch",
    "triton",
    "driver",
    "config",
    "cache_key",
)
SUBJECT = "moegemm"
GOAL_PCT_FLOOR = 85.0
RESULTS_DIR = Path("benchmarks/results")
JAX_IMPLS = ("moegemm-jax", "jax.lax.ragged_dot", "tokamax")  # --impls naming one: the "jax" benchmark
CPU_NOTICE = (
    "No GPU: correctness only. Interpreter timings are not performance, so this run times nothing.\n"
    "moegemm's kernels run under the Triton interpreter on CPU tensors, and every output is checked against "
    "the reference (relative error vs tolerance)."
)
# Memory size and type in a device name: the same chip and board either way (H100 SXM: "NVIDIA H100 80GB
# HBM3"), so one results folder. Form factors (PCIe, NVL) stay: they run at other clocks and bandwidths.
_MEMORY_WORD = re.compile(r"^(\d+gb|hbm\d*e?)$")


def run_meta(
    env,
    check_only: bool,
    argv,
    *,
    benchmark: str | None = None,
    tcfg=None,
    seeds=None,
    clock: dict | None = None,
) -> dict:
    """The fields every result JSON's meta opens with: what ran (``benchmark``, ``argv``; None: this process's),
    on which code (``commit``, ``dirty``: ``code_version``), machine and versions, when, and how it was timed
    (``clock``: default ``timing.clock_meta()``; ``reps``: ``tcfg.meta()``; ``seeds``)."""
    import sys
    import time

    from moegemm.bench import timing

    return {
        "benchmark": benchmark,
        "mode": "correctness" if check_only else "benchmark",
        "performance": not check_only,
        "notice": CPU_NOTICE if check_only else None,
        "device": env.device,
        "device_slug": env.device_slug,
        "date": env.date,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": env.torch,
        "triton": env.triton,
        "jax": _jax_version(),
        "driver": env.driver,
        "cuda": env.cuda,
        "python": sys.version.split()[0],
        "argv": list(sys.argv[1:] if argv is None else argv),
        **code_version(),
        "clock": None if check_only else (clock or timing.clock_meta()),
        "reps": None if check_only or tcfg is None else tcfg.meta(),
        "seeds": None if seeds is None else list(seeds),
    }


def _jax_version() -> str | None:
    import sys

    jax = sys.modules.get("jax")  # only where this process imported it: importing JAX here would grab a GPU
    return getattr(jax, "__version__", None)


def code_version() -> dict:
    """{commit, dirty} of the code that runs: ``MOEGEMM_COMMIT`` / ``MOEGEMM_DIRTY`` where set (the GPU machine
    gets a copy of the working tree without .git, so the caller passes them), else git in this checkout; None
    where neither says."""
    import os
    import subprocess

    commit, dirty = os.environ.get("MOEGEMM_COMMIT"), os.environ.get("MOEGEMM_DIRTY")
    root = Path(__file__).resolve().parents[3]
    if commit is None:
        try:
            git = ["git", "-C", str(root)]
            commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
            commit = commit.stdout.strip() or None if commit.returncode == 0 else None
            if commit is not None and dirty is None:
                status = subprocess.run(
                    [*git, "status", "--porcelain", "--", "src"], capture_output=True, text=True, timeout=10
                )
                dirty = "1" if status.stdout.strip() else "0"
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"commit": commit, "dirty": None if dirty is None else dirty not in ("0", "", "false")}


def results_slug(device_name: str) -> str:
    """The results folder of a device: "NVIDIA H100 80GB HBM3" -> "nvidia-h100", "NVIDIA H200" ->
    "nvidia-h200", "NVIDIA H100 PCIe" -> "nvidia-h100-pcie", "cpu-x86_64" -> "cpu-x86_64"."""
    words = re.findall(r"[a-z0-9_]+", device_name.lower())
    return "-".join(w for w in words if not _MEMORY_WORD.match(w)) or "unknown"


def default_out(device_name: str, benchmark: str) -> Path:
    """``benchmarks/results/<results_slug(device)>/<benchmark>.json`` (relative to the working directory)."""
    return RESULTS_DIR / results_slug(device_name) / f"{benchmark}.json"


def bf16_benchmark_name(dtype: str, split: str, impls: list[str] | None, *, jagged: bool, tune: bool) -> str:
    """The name a BF16-mode run files its results under: the dtype ("bf16", "fp16"), or "jax" when
    ``--impls`` names a JAX impl (the front-end comparison; ``impls`` None: every registered impl, the
    BF16 benchmark); "-<split>" unless the default Dirichlet split; "tune" for ``--tune``."""
    if tune:
        return "tune"
    name = "jax" if any(n in JAX_IMPLS for n in impls or ()) else dtype
    if jagged:
        return f"{name}-jagged"
    return name if split == "dirichlet" else f"{name}-{split}"


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(records: list[dict], title: str = ""):
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for col, justify in [
        ("case", "left"),
        ("op", "left"),
        ("impl", "left"),
        ("ms", "right"),
        ("device ms", "right"),
        ("host us", "right"),
        ("TF/s", "right"),
        ("floor TF/s", "right"),
        ("% floor", "right"),
        ("x vs torch", "right"),
        ("relerr", "right"),
        ("peak MB", "right"),
        ("note", "left"),
    ]:
        t.add_column(col, justify=justify, overflow="fold", no_wrap=col != "note")
    t.caption = (
        f"ms: the impl's clock (CUDA events; JAX: blocking wall clock); device ms: GPU time from a CUPTI trace, "
        f"one clock for every impl; host us: host time to issue one call. x vs torch: {TORCH_PEER} ms / this "
        f"ms (> 1 is faster); floor: roofline, (com)pute or (mem)ory"
    )
    previous = None
    for r in records:
        key = (r["case"], r["op"])
        first = key != previous
        if first and previous is not None:
            t.add_section()
        previous = key
        style = {"ok": None, "failed": "red", "skipped": "dim"}[r["status"]]
        impl = r["impl"] + (f" [{r['backend']}]" if r.get("backend") else "")
        if "best" in r:
            impl += " " + "x".join(str(v) for v in r["config"].values()) + (" *" if r.get("best") else "")
        t.add_row(
            r["case"] if first else "",
            r["op"] if first else "",
            impl,
            _fmt(r["ms"], ".4f"),
            _fmt(r.get("device_ms"), ".4f"),
            _fmt(r.get("host_us"), ".1f"),
            _fmt(r["tflops"], ".1f" if (r["tflops"] or 0) >= 10 else ".3g"),
            f"{r['floor_tflops']:.0f} ({r['floor_bound'][:3]})" if first else "",
            _fmt(r["pct_floor"], ".0f"),
            _fmt(r["vs_torch"], ".2f"),
            _fmt(r["relerr"], ".1e"),
            _fmt(r["peak_mb"], ".0f"),
            "" if r["status"] == "ok" else f"{r['status']}: {r['reason']}",
            style=style,
        )
    return t


def check_table(records: list[dict], title: str = ""):
    """The CPU table: each (case, op, impl)'s relative error against the fp64 oracle and its verdict."""
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for col, justify in [
        ("case", "left"),
        ("op", "left"),
        ("impl", "left"),
        ("relerr", "right"),
        ("tol", "right"),
        ("check", "left"),
        ("note", "left"),
    ]:
        t.add_column(col, justify=justify, overflow="fold", no_wrap=col != "note")
    t.caption = (
        "relerr: ||out - oracle|| / ||oracle|| (Frobenius, fp64 oracle); check: pass when relerr <= tol"
    )
    previous = None
    for r in records:
        key = (r["case"], r["op"])
        first = key != previous
        if first and previous is not None:
            t.add_section()
        previous = key
        verdict = {"ok": "pass", "failed": "FAIL", "skipped": "skipped"}[r["status"]]
        t.add_row(
            r["case"] if first else "",
            r["op"] if first else "",
            r["impl"] + (f" [{r['backend']}]" if r.get("backend") else ""),
            _fmt(r["relerr"], ".1e"),
            _fmt(r["tol"], ".0e"),
            verdict,
            "" if r["status"] == "ok" else r["reason"],
            style={"ok": None, "failed": "bold red", "skipped": "dim"}[r["status"]],
        )
    return t


def correctness(records: list[dict]) -> dict:
    """Counts of a check-only run, and every failure as "case op impl: reason"."""
    failed = [r for r in records if r["status"] == "failed"]
    return {
        "checked": sum(r["status"] != "skipped" for r in records),
        "passed": sum(r["status"] == "ok" for r in records),
        "failed": len(failed),
        "skipped": sum(r["status"] == "skipped" for r in records),
        "failures": [f"{r['case']} {r['op']} {r['impl']}: {r['reason']}" for r in failed],
    }


def correctness_line(c: dict) -> str:
    verdict = "PASS" if not c["failed"] else "FAIL"
    line = (
        f"correctness {verdict}: {c['passed']}/{c['checked']} (case, op, impl) within tolerance of the fp64 "
        f"oracle, {c['failed']} failed, {c['skipped']} skipped (impl cannot serve the case)"
    )
    return line + "".join(f"\n  failed: {f}" for f in c["failures"])


def summary(records: list[dict]) -> dict:
    """Geometric-mean speedup of moegemm over torch._grouped_mm and the goal counts, over (case, op);
    the same per shape set (``by_set``: suite, heldout, ...; moegemm.shapes.case_set)."""
    sets = {}
    for r in records:
        sets.setdefault(shapes.case_set(r["case"]), []).append(r)
    return {
        **_counts(records),
        "by_set": {name: _counts(rs) for name, rs in sorted(sets.items())},
        **frontends(records),
    }


def _over_seeds(mine: list[dict], value) -> list[float]:
    """``value(record)`` of each (case, op): the median over the run's seeds of the records where it is not None
    (``value`` a field name, or a function of the record)."""
    get = value if callable(value) else (lambda r: r.get(value))
    by_key: dict = {}
    for r in mine:
        if get(r) is not None:
            by_key.setdefault((r["case"], r["op"]), []).append(get(r))
    return [statistics.median(v) for _, v in sorted(by_key.items())]


def _counts(records: list[dict]) -> dict:
    mine = [r for r in records if r["impl"] == SUBJECT and r["status"] == "ok"]
    ratios = _over_seeds(mine, "vs_torch")
    keys = {(r["case"], r["op"]) for r in records}
    both = [r for r in mine if r["vs_torch"] is not None]
    device_ratios = _over_seeds(mine, lambda r: (r.get("device_speedup") or {}).get(TORCH_PEER))
    return {
        "case_ops": len(keys),
        "moegemm_ok": len(mine),
        "moegemm_failed": sum(r["impl"] == SUBJECT and r["status"] == "failed" for r in records),
        "compared": len(ratios),
        "geomean_vs_torch": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
        "ge_1x_torch": sum(r >= 1.0 for r in ratios),
        "ge_85pct_floor": sum(r["pct_floor"] >= GOAL_PCT_FLOOR for r in mine),
        "both": sum(r["vs_torch"] >= 1.0 and r["pct_floor"] >= GOAL_PCT_FLOOR for r in both),
        "worst_vs_torch": min(ratios) if ratios else None,
        "device_geomean_vs_torch": math.exp(sum(map(math.log, device_ratios)) / len(device_ratios))
        if device_ratios
        else None,
        "seeds": sorted({r.get("seed") for r in mine if r.get("seed") is not None}),
        **_paired_counts(mine),
    }


def _paired_counts(mine: list[dict]) -> dict:
    """The same comparison on the paired clock, where the run has it (RunSpec.paired)."""
    ratios = _over_seeds(mine, "paired_vs_torch")
    if not ratios:
        return {}
    return {
        "paired_compared": len(ratios),
        "paired_geomean_vs_torch": math.exp(sum(map(math.log, ratios)) / len(ratios)),
        "paired_ge_1x_torch": sum(r >= 1.0 for r in ratios),
        "paired_worst_vs_torch": min(ratios),
    }


def frontends(records: list[dict], jax_impl: str = "moegemm-jax") -> dict:
    """moegemm's two front ends on the one device clock: per (case, op) torch device ms / JAX device ms
    (>= 1: JAX as fast), its geomean and worst, and the median host time per call of each."""
    by_key = {(r["case"], r["op"], r["impl"]): r for r in records if r["status"] == "ok"}
    ratios = [
        by_key[(c, o, SUBJECT)]["device_ms"] / r["device_ms"]
        for (c, o, impl), r in by_key.items()
        if impl == jax_impl
        and (c, o, SUBJECT) in by_key
        and r.get("device_ms")
        and by_key[(c, o, SUBJECT)].get("device_ms")
    ]

    def median_host(impl):
        values = sorted(r["host_us"] for (_, _, i), r in by_key.items() if i == impl and r.get("host_us"))
        return values[len(values) // 2] if values else None

    return {
        "jax_vs_torch_device_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
        "jax_vs_torch_device_worst": min(ratios) if ratios else None,
        "jax_vs_torch_device_compared": len(ratios),
        "host_us_median": {SUBJECT: median_host(SUBJECT), jax_impl: median_host(jax_impl)},
    }


def summary_line(s: dict) -> str:
    line = _counts_line(s)
    by_set = s.get("by_set") or {}
    if len(by_set) > 1:
        line += "".join(f"\n  {name}: {_counts_line(c)}" for name, c in by_set.items())
    return line


def _counts_line(s: dict) -> str:
    geo = (
        "n/a (no torch._grouped_mm to compare)"
        if s["geomean_vs_torch"] is None
        else (f"{s['geomean_vs_torch']:.3f}x over {s['compared']} case-ops")
    )
    return (
        f"moegemm vs {TORCH_PEER}: geomean {geo}; {s['ge_1x_torch']}/{s['compared']} at >= 1.0x torch, "
        f"{s['ge_85pct_floor']}/{s['moegemm_ok']} at >= {GOAL_PCT_FLOOR:.0f}% of floor, {s['both']} both; "
        f"moegemm ok {s['moegemm_ok']}/{s['case_ops']}, failed {s['moegemm_failed']}"
        + (
            ""
            if s.get("paired_geomean_vs_torch") is None
            else f"; paired: {s['paired_geomean_vs_torch']:.3f}x, {s['paired_ge_1x_torch']}/{s['paired_compared']} "
            f"at >= 1.0x, worst {s['paired_worst_vs_torch']:.2f}x"
        )
        + (
            ""
            if s.get("jax_vs_torch_device_geomean") is None
            else f"; moegemm-jax on device time: {s['jax_vs_torch_device_geomean']:.3f}x of the torch front end "
            f"(worst {s['jax_vs_torch_device_worst']:.2f}x over {s['jax_vs_torch_device_compared']}); host us per "
            f"call, median: torch {s['host_us_median'][SUBJECT]:.1f}, jax {s['host_us_median']['moegemm-jax']:.1f}"
        )
    )


def write_json(path: Path, meta: dict, records: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {k: r.get(k) for k in RECORD_FIELDS} | {k: v for k, v in r.items() if k not in RECORD_FIELDS}
        for r in records
    ]
    path.write_text(json.dumps({"meta": meta, "records": rows}, indent=1, default=str) + "\n")
    return path


def plot(path: Path, records: list[dict], title: str = "") -> Path:
    """One panel per op: TF/s per case, one bar per impl, the roofline floor as a black tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in roofline.OPS if any(r["op"] == op for r in records)]
    cases = list(dict.fromkeys(r["case"] for r in records))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    fig, axes = plt.subplots(
        len(ops),
        1,
        figsize=(max(6, 1.6 * len(cases) * max(1, len(impls) / 4)), 3.2 * len(ops)),
        squeeze=False,
    )
    width = 0.8 / max(1, len(impls))
    for ax, op in zip(axes[:, 0], ops):
        by = {(r["case"], r["impl"]): r for r in records if r["op"] == op}
        for i, impl in enumerate(impls):
            xs = [c + (i - (len(impls) - 1) / 2) * width for c in range(len(cases))]
            ys = [(by.get((case, impl)) or {}).get("tflops") or 0.0 for case in cases]
            ax.bar(xs, ys, width, label=impl)
        for c, case in enumerate(cases):
            floor = next((r["floor_tflops"] for r in records if r["case"] == case and r["op"] == op), None)
            if floor is not None:
                ax.hlines(
                    floor,
                    c - 0.45,
                    c + 0.45,
                    colors="black",
                    linewidth=2,
                    label="roofline floor" if c == 0 else None,
                )
        ax.set_xticks(range(len(cases)), cases, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(f"{op} TF/s")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle(title, fontsize=9, y=0.995)
    fig.legend(
        handles,
        labels,
        fontsize=7,
        ncols=min(8, len(labels)),
        loc="upper center",
        bbox_to_anchor=(0.5, 0.975),
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
