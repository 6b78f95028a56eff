"""A/B of two benchmark JSON files: did a change make an implementation faster or slower?

Usage:
    python tools/compare_results.py BEFORE.json AFTER.json [--impl moegemm] [--noise 0.03] [--fail-below 0.98]

Takes the files ``python -m moegemm.bench`` writes: the BF16 mode's ``{"meta", "records"}`` and the FP8
mode's ``{"meta", "rows"}``. Rows are matched by (case, op, impl, recipe, split); per match it prints
``after / before`` of the implementation's speed on each clock both files have (``ms``: the impl's own
clock, ``paired_ms``: the implementations taking turns, ``device_ms``: CUPTI device time), so > 1 is
faster after. Where both files timed torch._grouped_mm beside it, it also prints the ratio of the
``vs torch`` speedups: a drift of the GPU's clock between the two runs moves both impls alike and
cancels there. Rows that moved by more than ``--noise`` are marked. The last lines give the geometric
mean per clock. Exit status 1 when ``--fail-below`` is given and the geomean on the first clock both
files share (paired_ms, else ms) is below it; otherwise 0.

Compare runs made on the same device in one sitting: the H100's clock drifted by up to 10% between
sittings, larger than most changes this is meant to judge.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

CLOCKS = ("paired_ms", "ms", "device_ms")
PEER = "torch._grouped_mm"


def load(path: Path) -> dict[tuple, dict]:
    """Timed rows of a benchmark file by (case, op, impl, recipe, split)."""
    data = json.loads(Path(path).read_text())
    rows = data.get("records") or data.get("rows") or []
    return {
        (r.get("case"), r.get("op"), r.get("impl"), r.get("recipe"), r.get("split")): r
        for r in rows
        if r.get("ms") is not None
    }


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def compare(before: dict[tuple, dict], after: dict[tuple, dict], impl: str | None) -> list[dict]:
    """One row per key both files timed (only ``impl``'s rows when given): after/before speed per clock,
    and ``vs_peer``: the change of the speedup over torch._grouped_mm measured within each file."""
    rows = []
    for key in sorted(set(before) & set(after), key=str):
        if impl is not None and key[2] != impl:
            continue
        b, a = before[key], after[key]
        row = {"key": key}
        for clock in CLOCKS:
            if b.get(clock) and a.get(clock):
                row[clock] = b[clock] / a[clock]
        peer = (key[0], key[1], PEER, key[3], key[4])
        if key[2] != PEER and peer in before and peer in after:
            clock = "paired_ms" if row.get("paired_ms") and before[peer].get("paired_ms") else "ms"
            if after[peer].get(clock) and before[peer].get(clock):
                row["vs_peer"] = row[clock] * after[peer][clock] / before[peer][clock]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--impl", default="moegemm", help="the implementation to compare ('' for all)")
    p.add_argument("--noise", type=float, default=0.03, help="mark rows that moved by more than this")
    p.add_argument("--fail-below", type=float, help="exit 1 when the geomean is below this")
    args = p.parse_args(argv)

    rows = compare(load(args.before), load(args.after), args.impl or None)
    if not rows:
        print(f"no timed rows in common (impl {args.impl!r})")
        return 1 if args.fail_below is not None else 0
    columns = [c for c in (*CLOCKS, "vs_peer") if any(c in r for r in rows)]
    print(f"after / before speed (> 1: faster after); * moved by more than {args.noise:.0%}")
    print(f"{'case':24} {'op':6} {'impl':24} {'recipe':10} " + " ".join(f"{c:>10}" for c in columns))
    for r in rows:
        case, op, impl, recipe, _ = r["key"]
        cells = []
        for c in columns:
            v = r.get(c)
            cells.append(f"{'-':>10}" if v is None else f"{v:9.3f}{'*' if abs(v - 1) > args.noise else ' '}")
        print(f"{case:24} {op:6} {impl:24} {recipe or '':10} " + " ".join(cells))
    means = {c: geomean([r[c] for r in rows if c in r]) for c in columns}
    for c, g in means.items():
        print(f"geomean {c}: {g:.3f}x over {sum(c in r for r in rows)} rows")
    if args.fail_below is not None:
        judged = next((c for c in CLOCKS if means.get(c) is not None), None)
        if judged is None or means[judged] < args.fail_below:
            print(f"FAIL: geomean {judged} below {args.fail_below}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
