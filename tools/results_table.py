"""Render ``benchmarks/results/README.md`` from the canonical result JSONs, or check that it is current.

Usage:
    python tools/results_table.py            # write benchmarks/results/README.md
    python tools/results_table.py --check    # exit 1, with a diff, when the committed file differs

A canonical file is ``benchmarks/results/<device-slug>/<benchmark>.json`` written by ``python -m moegemm.bench``:
``{"meta": {...}, "records": [...]}`` with every key of ``REQUIRED_META`` and ``meta.performance`` true.
Every JSON in a device folder must be one (``cpu-*`` folders, git-ignored, are skipped); anything else, or a
benchmark name missing from ``BENCHMARKS``, is an error and the tool exits 1 listing them.

What each benchmark's summary reads from its records is declared once, in ``BENCHMARKS``. A ratio is a peer's
time over the subject's on the named clock (above 1.0x the subject is faster); a field a record lacks renders
as "-". The output depends on the files only: sorted, fixed number formats, no clock read.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks/results")
README = "README.md"
REQUIRED_META = (
    "benchmark",
    "device",
    "device_slug",
    "driver",
    "cuda",
    "torch",
    "triton",
    "jax",
    "python",
    "date",
    "started_utc",
    "argv",
    "commit",
    "dirty",
    "clock",
    "reps",
    "seeds",
    "performance",
    "mode",
)
MISSING = "-"

# ---------------------------------------------------------------------------------------------- records


def get(rec: dict, path):
    """``rec[path]``, or ``rec[a][b]`` for a tuple path; None where any step is missing."""
    for key in path if isinstance(path, tuple) else (path,):
        if not isinstance(rec, dict) or key not in rec:
            return None
        rec = rec[key]
    return rec


def matches(rec: dict, where: dict) -> bool:
    """Every ``field: value`` of ``where`` holds: a tuple lists allowed values; a str is an fnmatch pattern."""
    for key, want in where.items():
        have = rec.get(key)
        if isinstance(want, tuple):
            if have not in want:
                return False
        elif isinstance(want, str) and isinstance(have, str):
            if not fnmatch.fnmatchcase(have, want):
                return False
        elif have != want:
            return False
    return True


def live(rec: dict) -> bool:
    """A record that ran and passed (records without a status field count as ran)."""
    return rec.get("status", "ok") == "ok"


def number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    values = sorted(v for v in values if v is not None)
    return values[max(0, math.ceil(q / 100 * len(values)) - 1)] if values else None


def x(value, spec: str = ".2f") -> str:
    return MISSING if value is None else f"{value:{spec}}x"


def num(value, spec: str = ".0f") -> str:
    return MISSING if value is None else f"{value:{spec}}"


def span(values: list[float], fmt=x) -> str:
    """ "1.21-3.00x" over the values; one value alone; "-" for none."""
    values = [v for v in values if v is not None]
    if not values:
        return MISSING
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo.rstrip('x')}-{hi}"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class Clock:
    """How one ratio is read: ``ratio`` a field of the subject's record that already holds peer / subject
    time, or ``ms`` a time field of both records (the peer's matched on ``Ratios.match``)."""

    label: str
    ratio: str | tuple | None = None
    ms: str | None = None


@dataclass(frozen=True)
class Ratios:
    """The subject's speedup over one peer over every record the file times: geomean (per seed when the
    records carry ``seed``: the median of the seeds' geomeans and their range), the count at or above 1.0x,
    the worst, and as asked the 5th percentile, the count below ``low`` and the same over small problems."""

    peer: str  # the peer's name as the cell prints it
    subject: dict = field(default_factory=dict)  # which records are the subject's
    peer_where: dict | None = None  # the peer's records, for Clock.ms
    clocks: tuple = ()
    match: tuple = ("case", "op", "seed")
    group: str | None = None  # one summary per value of this field (e.g. "recipe")
    host: str | None = None  # median of this field per impl, subject and peer records
    p5: bool = False
    low: float | None = None
    small: tuple | None = None  # (time field of the subject's record, ms): the problems under it
    title: str = ""  # replaces "vs <peer>"
    seed: str | None = "seed"  # the field naming a record's routing seed; None: no per-seed geomeans

    def ratios(self, records: list[dict], clock: Clock, subjects: list[dict]) -> list[tuple]:
        """(seed, ratio, subject record) per subject record that has the clock's ratio."""
        peers = {}
        if clock.ms is not None and self.peer_where is not None:
            for r in records:
                if live(r) and matches(r, self.peer_where):
                    peers[tuple(r.get(k) for k in self.match)] = r
        out = []
        for r in subjects:
            if clock.ratio is not None:
                value = number(get(r, clock.ratio))
            else:
                p = peers.get(tuple(r.get(k) for k in self.match))
                a, b = number(get(p or {}, clock.ms)), number(get(r, clock.ms))
                value = a / b if a is not None and b else None
            if value is not None:
                out.append((r.get(self.seed) if self.seed else None, value, r))
        return out

    def stats(self, found: list[tuple], brief: bool = False) -> str:
        if not found:
            return MISSING
        values = [v for _, v, _ in found]
        seeds = sorted({s for s, _, _ in found if s is not None})
        if len(seeds) > 1:
            per_seed = [geomean([v for s, v, _ in found if s == seed]) for seed in seeds]
            head = f"geomean {x(median(per_seed), '.3f')} (median of {len(seeds)} seeds, {span(per_seed)})"
        else:
            head = f"geomean {x(geomean(values), '.3f')}"
        parts = [head, f"{sum(v >= 1.0 for v in values)}/{len(values)} >= 1.0x", f"worst {x(min(values))}"]
        if brief:
            return ", ".join(parts)
        if self.p5:
            parts.append(f"p5 {x(percentile(values, 5))}")
        if self.low is not None:
            parts.append(f"{sum(v < self.low for v in values)}/{len(values)} < {self.low:.2f}x")
        return ", ".join(parts)

    def summary(self, records: list[dict]) -> str:
        groups = [None]
        if self.group:
            groups = sorted({str(r.get(self.group)) for r in records if matches(r, self.subject)})
        lines = []
        for g in groups:
            subjects = [
                r
                for r in records
                if live(r) and matches(r, self.subject) and (g is None or str(r.get(self.group)) == g)
            ]
            parts = []
            for clock in self.clocks:
                found = self.ratios(records, clock, subjects)
                text = f"{clock.label}: {self.stats(found)}"
                if self.small and found:
                    key, limit = self.small
                    few = [f for f in found if (number(f[2].get(key)) or math.inf) < limit]
                    text += f"; under {limit * 1000:g} µs: {self.stats(few, brief=True)}"
                parts.append(text)
            if self.host:
                impls = sorted({str(r.get("impl")) for r in records if live(r) and number(r.get(self.host))})
                hosts = [
                    f"{i} {num(median([number(r.get(self.host)) for r in records if live(r) and str(r.get('impl')) == i]))}"
                    for i in impls
                ]
                parts.append(f"host µs median ({self.host}): " + (", ".join(hosts) or MISSING))
            label = self.title or f"vs {self.peer}"
            lines.append((f"{g}: " if g is not None else "") + f"{label}, " + "; ".join(parts))
        return "<br>".join(lines) or MISSING

    def detail(self, records: list[dict]) -> list[str]:
        return []


MOE_PASSES = (
    # (label, TF/s field, headline-clock ms, device ms)
    ("fwd", "fwd_tflops", "fwd_ms", "fwd_device_ms"),
    ("fwd+bwd", "step_tflops", "step_ms", "step_device_ms"),
)


@dataclass(frozen=True)
class MoeBlocks:
    """The expert block per shape x routing: the subjects' TF/s per pass, their ratio to every live peer
    (any other impl with a passing record) on the paired clock and on device time, the published figures
    apart, and the peers that failed or were skipped with their reason. Seeds: medians over seeds."""

    subjects: tuple = ("moegemm",)  # fnmatch patterns of impl
    peers: tuple = ("*",)
    passes: tuple = MOE_PASSES
    keys: tuple = ("shape", "routing")
    paired_label: str = "paired"
    device_label: str = "device time"
    tflops_label: str = "TF/s (paired clock)"
    published: str = "published"  # the status of figures read off a paper, not run
    peak: str = "peak_gib"

    def is_subject(self, impl) -> bool:
        return any(fnmatch.fnmatchcase(str(impl), p) for p in self.subjects)

    def impls(self, records: list[dict]) -> tuple[list[str], list[str]]:
        subjects = sorted({str(r.get("impl")) for r in records if self.is_subject(r.get("impl"))})
        peers = sorted(
            {
                str(r.get("impl"))
                for r in records
                if live(r)
                and not self.is_subject(r.get("impl"))
                and any(fnmatch.fnmatchcase(str(r.get("impl")), p) for p in self.peers)
            }
        )
        return subjects, peers

    def rows(self, records: list[dict]) -> dict:
        """{(shape, routing): {impl: [records, one per seed]}}"""
        out: dict = {}
        for r in records:
            key = tuple(str(r.get(k)) for k in self.keys)
            out.setdefault(key, {}).setdefault(str(r.get("impl")), []).append(r)
        return dict(sorted(out.items()))

    def ratio(self, mine: list[dict], theirs: list[dict], ms: str) -> float | None:
        """Median over seeds of peer / subject time on field ``ms``, seeds paired."""
        by_seed = {r.get("seed"): r for r in theirs if live(r)}
        values = []
        for r in mine:
            p = by_seed.get(r.get("seed"))
            a, b = number(get(p or {}, ms)), number(r.get(ms))
            if a is not None and b:
                values.append(a / b)
        return median(values)

    def value(self, recs: list[dict], key: str) -> float | None:
        return median([number(r.get(key)) for r in recs if live(r) or r.get("status") == self.published])

    def not_run(self, records: list[dict]) -> list[str]:
        """ "impl status on n: reason" per (impl, status, reason) of records that neither ran nor were published."""
        seen: dict = {}
        for r in records:
            status = r.get("status", "ok")
            if status in ("ok", self.published):
                continue
            reason = " ".join(str(r.get("reason") or "no reason given").split())
            reason = reason if len(reason) <= 140 else reason[:137] + "..."
            seen.setdefault((str(r.get("impl")), str(status), reason), []).append(r)
        return [f"{i} {s} on {len(v)}: {why}" for (i, s, why), v in sorted(seen.items())]

    def other_clocks(self, records: list[dict]) -> list[str]:
        """ "impl pass: timing" where a record's ``<pass>_timing`` differs from the subjects' (the ratio then
        mixes clocks, and the table says so)."""
        fields = [tf.replace("_tflops", "_timing") for _, tf, _, _ in self.passes]
        ours = {str(r.get(f)) for r in records if self.is_subject(r.get("impl")) and live(r) for f in fields}
        seen = set()
        for r in records:
            for (label, *_), f in zip(self.passes, fields):
                if live(r) and r.get(f) is not None and str(r.get(f)) not in ours:
                    seen.add(f"{r.get('impl')} {label}: {' '.join(str(r.get(f)).split())}")
        return sorted(seen)

    def summary(self, records: list[dict]) -> str:
        subjects, peers = self.impls(records)
        rows = self.rows(records)
        lines = []
        for s in subjects:
            mine = [r for r in records if str(r.get("impl")) == s and live(r)]
            tf = ", ".join(
                f"{label} {span([self.value(rows[k].get(s, []), tf) for k in rows], num)}"
                for label, tf, _, _ in self.passes
            )
            parts = [
                f"{s} {tf} {self.tflops_label} over {len({tuple(r.get(k) for k in self.keys) for r in mine})} blocks"
            ]
            for p in peers:
                vs = []
                for label, _, paired, device in self.passes:
                    pr = [self.ratio(rows[k].get(s, []), rows[k].get(p, []), paired) for k in rows]
                    dv = [self.ratio(rows[k].get(s, []), rows[k].get(p, []), device) for k in rows]
                    vs.append(f"{label} {span(pr)} {self.paired_label} ({self.device_label} {span(dv)})")
                parts.append(f"vs {p}: " + ", ".join(vs))
            lines.append("; ".join(parts))
        pub = sorted({str(r.get("impl")) for r in records if r.get("status") == self.published})
        if pub:
            lines.append("published, not run: " + ", ".join(pub) + " (table below)")
        skipped = self.not_run(records)
        if skipped:
            lines.append(f"not run: {len(skipped)} peer/reason pairs (listed below)")
        if self.other_clocks(records):
            lines.append("some peers timed on another clock (listed below)")
        return "<br>".join(lines) or MISSING

    def detail(self, records: list[dict]) -> list[str]:
        subjects, peers = self.impls(records)
        pub = sorted({str(r.get("impl")) for r in records if r.get("status") == self.published})
        passes = " / ".join(label for label, *_ in self.passes)
        head = [
            *self.keys,
            "impl",
            *(f"{label} {self.tflops_label}" for label, *_ in self.passes),
            "peak GiB",
        ]
        head += [f"vs {p}, {passes} ({self.paired_label}; {self.device_label})" for p in peers]
        head += [f"published, not run: {p}, {passes} TF/s (subject's TF/s over it)" for p in pub]
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for key, by_impl in self.rows(records).items():
            for s in subjects:
                mine = [r for r in by_impl.get(s, []) if live(r)]
                if not mine:
                    continue
                row = [*key, s]
                row += [num(self.value(mine, tf)) for _, tf, _, _ in self.passes]
                row.append(num(self.value(mine, self.peak), ".2f"))
                for p in peers:
                    theirs = by_impl.get(p, [])
                    if not any(live(r) for r in theirs):
                        row.append(", ".join(sorted({str(r.get("status")) for r in theirs})) or MISSING)
                        continue
                    pr = " / ".join(x(self.ratio(mine, theirs, paired)) for _, _, paired, _ in self.passes)
                    dv = " / ".join(x(self.ratio(mine, theirs, device)) for _, _, _, device in self.passes)
                    row.append(f"{pr} ({dv})")
                for p in pub:
                    theirs = by_impl.get(p, [])
                    figs = [self.value(theirs, tf) for _, tf, _, _ in self.passes]
                    mine_tf = [self.value(mine, tf) for _, tf, _, _ in self.passes]
                    rel = [a / b if a is not None and b else None for a, b in zip(mine_tf, figs)]
                    row.append(" / ".join(map(num, figs)) + " (" + " / ".join(map(x, rel)) + ")")
                out.append("| " + " | ".join(cell(c) for c in row) + " |")
        not_run = self.not_run(records)
        if not_run:
            out += ["", "Not run:", ""] + [f"- {cell(line)}" for line in not_run]
        other = self.other_clocks(records)
        if other:
            out += ["", "Timed on another clock than the subject's (their ratios mix clocks):", ""]
            out += [f"- {cell(line)}" for line in other]
        return out


@dataclass(frozen=True)
class StepRecipes:
    """A training step per recipe against the same step in BF16: baseline time / recipe time per row
    (case, impl, micro-batches), seeds paired, median over seeds; the summary gives each recipe's range."""

    column: str = "recipe"
    baseline: str = "bf16"  # the value of ``column`` on the BF16 rows
    rows: tuple = ("case", "impl", "micro_batches")
    clocks: tuple = (Clock("paired", ms="ms"), Clock("device time", ms="device_ms"))
    peak: str = "peak_mb"

    def table(self, records: list[dict]) -> tuple[dict, list[str]]:
        """({row: {recipe: [records]}}, recipes other than the baseline)."""
        out: dict = {}
        for r in records:
            if live(r):
                key = tuple(str(r.get(k)) for k in self.rows)
                out.setdefault(key, {}).setdefault(str(r.get(self.column)), []).append(r)
        recipes = sorted({str(r.get(self.column)) for r in records if live(r)} - {self.baseline})
        return dict(sorted(out.items())), recipes

    def ratio(self, base: list[dict], mine: list[dict], ms: str) -> float | None:
        by_seed = {r.get("seed"): r for r in base}
        values = []
        for r in mine:
            a, b = number(get(by_seed.get(r.get("seed")) or {}, ms)), number(r.get(ms))
            if a is not None and b:
                values.append(a / b)
        return median(values)

    def summary(self, records: list[dict]) -> str:
        table, recipes = self.table(records)
        parts = []
        for rec in recipes:
            clocks = [
                f"{span([self.ratio(row.get(self.baseline, []), row.get(rec, []), c.ms) for row in table.values()])} {c.label}"
                for c in self.clocks
            ]
            parts.append(f"{rec} {clocks[0]}" + (f" ({', '.join(clocks[1:])})" if clocks[1:] else ""))
        if not parts:
            return MISSING
        return f"{self.baseline} time / recipe time over {len(table)} steps: " + "; ".join(parts)

    def detail(self, records: list[dict]) -> list[str]:
        table, recipes = self.table(records)
        labels = ", ".join(c.label for c in self.clocks)
        head = [
            *self.rows,
            *(f"{r} ({labels})" for r in recipes),
            f"{self.peak} ({', '.join([self.baseline, *recipes])})",
        ]
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for key, row in table.items():
            base = row.get(self.baseline, [])
            cells = [*key]
            for rec in recipes:
                cells.append(" / ".join(x(self.ratio(base, row.get(rec, []), c.ms)) for c in self.clocks))
            peaks = [
                median([number(r.get(self.peak)) for r in row.get(n, [])]) for n in [self.baseline, *recipes]
            ]
            cells.append(" / ".join(num(p) for p in peaks))
            out.append("| " + " | ".join(cell(c) for c in cells) + " |")
        return out


@dataclass(frozen=True)
class Several:
    """Summaries side by side in one cell."""

    parts: tuple

    def summary(self, records: list[dict]) -> str:
        return "<br>".join(p.summary(records) for p in self.parts)

    def detail(self, records: list[dict]) -> list[str]:
        return [line for p in self.parts for line in p.detail(records)]


TORCH = "torch._grouped_mm"
SCALED = "torch._scaled_grouped_mm"
PAIRED_VS = lambda peer: Clock("paired", ratio=("paired_speedup", peer))  # noqa: E731
DEVICE_VS = lambda peer: Clock("device time", ratio=("device_speedup", peer))  # noqa: E731
BF16 = Ratios(
    peer=TORCH,
    subject={"impl": "moegemm"},
    clocks=(Clock("paired", ratio="paired_vs_torch"), DEVICE_VS(TORCH)),
    host="host_us",
)


def fuzz(peer: str, group: str | None = None) -> Several:
    """Random shapes: vs ``peer`` where it accepts the shape (paired events and device time, p5, the count
    below 0.95x, the shapes under 10 µs), and vs the nearest aligned shape where it refuses."""
    return Several(
        (
            Ratios(
                peer=peer,
                title=f"vs {peer} where it accepts the shape",
                clocks=(Clock("paired", ratio="vs_torch"), Clock("device time", ratio="vs_torch_device")),
                group=group,
                seed=None,  # a fuzz record's seed draws its shape: no two records share one
                p5=True,
                low=0.95,
                small=("moegemm_ms", 0.010),
            ),
            Ratios(
                peer="the nearest aligned shape",
                title=f"where {peer} refuses the shape, vs the nearest aligned shape",
                subject={"torch_accepts": False},
                clocks=(Clock("paired, by TF/s", ratio="vs_aligned"),),
                group=group,
                seed=None,
                p5=True,
            ),
        )
    )


FP8_GEMM = Several(
    tuple(
        Ratios(
            peer=f"{SCALED} rowwise",
            title=f"{impl} vs {SCALED} rowwise",
            subject={"impl": impl},
            peer_where={"impl": SCALED},
            match=("case", "op", "seed"),
            clocks=(Clock("paired", ms="paired_ms"), Clock("device time", ms="device_ms")),
            group="recipe",
        )
        for impl in ("moegemm-fp8-fast", "moegemm-fp8")
    )
)

# One entry per benchmark name (meta.benchmark): what its cell summarizes, from which record fields.
BENCHMARKS = {
    "bf16": BF16,
    "bf16-balanced": BF16,
    "jax": Several(
        tuple(
            Ratios(
                peer=peer,
                title=f"moegemm-jax vs {peer}",
                subject={"impl": "moegemm-jax"},
                clocks=(PAIRED_VS(peer), DEVICE_VS(peer)),
                host="host_us" if peer == "moegemm" else None,
            )
            for peer in ("moegemm", "jax.lax.ragged_dot")
        )
    ),
    "fuzz": fuzz(TORCH),
    "fuzz-fp8": fuzz(SCALED, group="recipe"),
    "fp8": FP8_GEMM,
    "fp8-step": StepRecipes(),
    "fp8-jax": Several(
        (
            Ratios(
                peer="the PyTorch front end",
                title="JAX FP8 GEMMs vs the PyTorch front end",
                subject={"op": ("fwd", "dgrad", "wgrad")},
                clocks=(Clock("device time", ratio="jax_vs_torch"),),
                group="recipe",
            ),
            Ratios(
                peer="the JAX BF16 step",
                title="ragged_dot fwd+bwd (weight's FP8 copy cached) vs the JAX BF16 step",
                subject={"op": "ragged_dot fwd+bwd"},
                clocks=(Clock("device time", ratio="cached_fp8_speedup"),),
                group="recipe",
            ),
        )
    ),
    "moe": MoeBlocks(),
    "moe-fp8": MoeBlocks(subjects=("moegemm-fp8-*",)),
    "moe-jax": MoeBlocks(subjects=("moegemm-jax",), peers=("moegemm",)),
    "ep": Ratios(
        peer="torchtitan-a2a",
        title="expert-parallel step vs a torchtitan-style all-to-all",
        subject={"kind": "block", "impl": "moegemm*"},
        clocks=(Clock("slowest rank, CUDA events", ratio="vs_torchtitan"),),
        group="impl",
    ),
}

# ---------------------------------------------------------------------------------------------- files


@dataclass
class Result:
    path: str  # relative to the results folder, e.g. "nvidia-h200/bf16.json"
    slug: str
    meta: dict
    records: list


def results_slug(device: str) -> str:
    """The results folder of a device, as ``moegemm.bench.report.results_slug`` names it (memory size and type
    dropped: "NVIDIA H100 80GB HBM3" -> "nvidia-h100"); kept in step by hand, the bench being private."""
    words = re.findall(r"[a-z0-9_]+", device.lower())
    return "-".join(w for w in words if not re.match(r"^(\d+gb|hbm\d*e?)$", w)) or "unknown"


def load_results(results: Path) -> tuple[list[Result], list[str]]:
    """Every canonical file under ``results`` and the errors of those that are not."""
    found, errors = [], []
    for path in sorted(results.glob("*/*.json")):
        rel = path.relative_to(results).as_posix()
        if path.parent.name.startswith("cpu-"):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            errors.append(f"{rel}: not JSON ({e})")
            continue
        meta = data.get("meta") if isinstance(data, dict) else None
        if not isinstance(meta, dict):
            errors.append(f"{rel}: no meta object (not written by python -m moegemm.bench?)")
            continue
        lacks = [k for k in REQUIRED_META if k not in meta]
        if lacks:
            errors.append(f"{rel}: meta lacks {', '.join(lacks)}")
            continue
        if meta["performance"] is not True:
            errors.append(f"{rel}: meta.performance is not true (a correctness-only run)")
            continue
        name = meta["benchmark"]
        if name not in BENCHMARKS:
            errors.append(f"{rel}: unknown benchmark {name!r} (known: {', '.join(sorted(BENCHMARKS))})")
            continue
        if path.stem != name:
            errors.append(f"{rel}: holds benchmark {name!r}; its file is {name}.json")
            continue
        folder = path.parent.name
        slugs = {str(meta["device_slug"]), results_slug(str(meta["device"]))}
        if not any(
            folder == s or (folder.startswith(s + "-x") and folder[len(s) + 2 :].isdigit()) for s in slugs
        ):
            errors.append(f"{rel}: device {meta['device']!r} but the folder is {folder!r}")
            continue
        clock = meta["clock"]
        if not isinstance(clock, dict) or not isinstance(clock.get("headline"), str):
            errors.append(f"{rel}: meta.clock has no headline sentence")
            continue
        records = data.get("records")
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            errors.append(f"{rel}: records is not a list of objects")
            continue
        found.append(Result(rel, folder, meta, records))
    return found, errors


def clock_text(meta: dict) -> str:
    reps = meta.get("reps") if isinstance(meta.get("reps"), dict) else {}
    seeds = meta.get("seeds") if isinstance(meta.get("seeds"), list) else []
    text = meta["clock"]["headline"]
    text += f"; >= {num(reps.get('reps'))} timed calls"
    if reps.get("reps_large") is not None:
        text += f" under {num(reps.get('small_ms'), 'g')} ms, >= {num(reps.get('reps_large'))} above"
    text += f", after >= {num(reps.get('warmup'))} warm-up"
    if seeds:
        text += "; seeds " + ", ".join(map(str, seeds))
    return text


def render(results: list[Result]) -> str:
    out = [
        "# Benchmark results",
        "",
        "Generated by `python tools/results_table.py` from the JSON files in the folders beside this one; do not",
        "edit it by hand (CI runs `python tools/results_table.py --check`). One folder per device, one file per",
        "benchmark, each written by `python -m moegemm.bench` with its commit, device, driver, versions, argv,",
        "clock and repetitions in `meta`.",
        "",
        "A ratio is a peer's time over moegemm's on the clock named beside it: above 1.0x moegemm is faster.",
        "",
        "## How these were measured",
        "",
    ]
    if not results:
        return "\n".join([*out, "No canonical results yet.", ""])
    headlines = sorted({r.meta["clock"]["headline"] for r in results})
    beside = sorted({str(s) for r in results for s in r.meta["clock"].get("beside") or []})
    out += [f"- Headline clock: {h}" for h in headlines]
    out += [f"- Beside it: {b}" for b in beside]
    out.append("")
    for slug in sorted({r.slug for r in results}):
        mine = [r for r in results if r.slug == slug]
        out += [f"## {slug}", ""]
        for key in ("device", "driver", "cuda", "torch", "triton", "jax", "python"):
            values = sorted({MISSING if r.meta.get(key) is None else str(r.meta.get(key)) for r in mine})
            out.append(f"- {key}: {', '.join(values)}")
        out += [
            "",
            "| benchmark | file | date | commit | clock | result summary |",
            "|---|---|---|---|---|---|",
        ]
        details = []
        for r in sorted(mine, key=lambda r: r.meta["benchmark"]):
            spec = BENCHMARKS[r.meta["benchmark"]]
            commit = str(r.meta.get("commit") or MISSING)[:10] + (" (dirty)" if r.meta.get("dirty") else "")
            name = Path(r.path).name
            row = [
                r.meta["benchmark"],
                f"[{name}]({r.path})",
                str(r.meta.get("date")),
                commit,
                clock_text(r.meta),
            ]
            summary = spec.summary(r.records)
            if r.meta.get("partial"):  # the bench checkpoints after each case; a time limit ended this one
                summary += f"<br>partial run: stopped before all of argv's cases ran ({cell(' '.join(r.meta['argv']))})"
            out.append("| " + " | ".join(cell(c) for c in row) + " | " + summary + " |")
            lines = spec.detail(r.records)
            if lines:
                details += ["", f"### {slug} / {r.meta['benchmark']}", "", *lines]
        out += details
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 with a diff when the README is not current")
    ap.add_argument("--results", type=Path, default=ROOT / RESULTS, help="the results folder")
    args = ap.parse_args(argv)
    results, errors = load_results(args.results)
    if errors:
        print(f"{len(errors)} file(s) in {args.results} are not canonical results:", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return 1
    text = render(results)
    target = args.results / README
    if args.check:
        old = target.read_text() if target.exists() else ""
        if old == text:
            return 0
        diff = difflib.unified_diff(old.splitlines(True), text.splitlines(True), str(target), "rendered")
        sys.stdout.writelines(diff)
        print(f"\n{target} is not current: run python tools/results_table.py", file=sys.stderr)
        return 1
    target.write_text(text)
    print(f"wrote {target} ({len(results)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
