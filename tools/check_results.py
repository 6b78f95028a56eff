"""Check that every committed result describes today's code: full meta, a clean commit, none stale.

Usage:
    python tools/check_results.py                  # exit 1 listing every problem
    python tools/check_results.py --allow-no-git   # exit 0 with a message where git history is unavailable

For each canonical file ``benchmarks/results/<device-slug>/<benchmark>.json`` (``results_table.load_results``:
every meta key, ``performance`` true, a known benchmark), ``meta.dirty`` must be false, ``meta.reps`` at least ``MIN_REPS``, and ``meta.commit`` a
40-hex commit of this repository's history that has the last commit touching the code the benchmark times
(``TIMED``) as an ancestor: a file measured before the last change to its kernels is stale and must be re-run or
leave main. A PNG must sit beside a JSON of the same stem; nothing else may sit in a device folder.

Without git (not a checkout, or a shallow clone lacking the commits) the freshness check cannot run: that is an
error unless ``--allow-no-git`` is given, which reports it and checks the rest.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_table import RESULTS, ROOT, load_results  # noqa: E402

# The code each benchmark times, as git pathspecs relative to the repository root: the kernels and everything
# that decides or issues their launches, and the bench modules whose clocks and problems produce the numbers.
# A commit touching any of these makes an older result of that benchmark stale.
KERNELS = (
    "src/moegemm/_src/kernels",
    "src/moegemm/_src/plan.py",
    "src/moegemm/_src/configs.py",
    "src/moegemm/_src/cost_model.py",
    "src/moegemm/_src/tuned_configs",
    "src/moegemm/_src/layout.py",
    "src/moegemm/_src/fp8.py",
    "src/moegemm/shapes.py",
    "src/moegemm/bench/timing.py",
)
TORCH = ("src/moegemm/_src/torch", "src/moegemm/torch/api.py")
JAX = ("src/moegemm/_src/jax", "src/moegemm/jax/api.py")
HARNESS = (
    "src/moegemm/bench/harness.py",
    "src/moegemm/bench/problem.py",
    "src/moegemm/bench/registry.py",
    "src/moegemm/bench/impls_torch.py",
)
FP8 = ("src/moegemm/bench/fp8.py",)
# The FP8 weight cache (Fp8WeightCache), which the BF16 expert block never runs.
FP8_WEIGHTS = ("src/moegemm/torch/grouped_linear.py",)
MOE = (
    "src/moegemm/_src/moe.py",
    "src/moegemm/torch/moe.py",
    "src/moegemm/bench/moe.py",
    "src/moegemm/bench/moe_peers.py",
    "src/moegemm/bench/harness.py",
    "src/moegemm/bench/problem.py",
)
TIMED = {
    "bf16": KERNELS + TORCH + HARNESS,
    "bf16-balanced": KERNELS + TORCH + HARNESS,
    "jax": KERNELS + TORCH + JAX + HARNESS + ("src/moegemm/bench/impls_jax.py",),
    "fuzz": KERNELS + TORCH + HARNESS + ("src/moegemm/bench/fuzz.py",),
    "fuzz-fp8": KERNELS + TORCH + HARNESS + FP8 + ("src/moegemm/bench/fuzz.py",),
    "fp8": KERNELS + TORCH + FP8 + FP8_WEIGHTS,  # its GroupedLinear step (--fp8-step-cases) too
    "fp8-step": KERNELS + TORCH + FP8 + FP8_WEIGHTS,
    "fp8-jax": KERNELS + TORCH + JAX + ("src/moegemm/bench/fp8_jax.py",),
    "moe": KERNELS + TORCH + MOE,
    "moe-fp8": KERNELS + TORCH + MOE + FP8_WEIGHTS,
    "moe-jax": KERNELS + TORCH + JAX + MOE + ("src/moegemm/jax/moe.py",),
    "ep": KERNELS + TORCH + MOE + ("src/moegemm/bench/ep.py",),
}
MIN_REPS = {"warmup": 10, "reps": 100}  # the least warm-up and timed calls a canonical result may have had
SHA = re.compile(r"^[0-9a-f]{40}$")


class NoGit(Exception):
    """Git history is not available here."""


def git(root: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    except OSError as e:  # no git binary
        raise NoGit(f"git not runnable: {e}") from e


def last_change(root: Path, paths: tuple[str, ...]) -> str | None:
    """The newest commit of HEAD's history touching any of ``paths``; None if none ever did."""
    out = git(root, "log", "-1", "--format=%H", "--", *paths)
    if out.returncode != 0:
        raise NoGit(out.stderr.strip())
    return out.stdout.strip() or None


def is_ancestor(root: Path, older: str, newer: str) -> bool:
    return git(root, "merge-base", "--is-ancestor", older, newer).returncode == 0


def has_commit(root: Path, sha: str) -> bool:
    return git(root, "cat-file", "-e", f"{sha}^{{commit}}").returncode == 0


def check_files(results: Path) -> list[str]:
    """Problems with what sits in the device folders, apart from JSON content."""
    problems = []
    for path in sorted(results.glob("*/*")):
        if path.parent.name.startswith("cpu-") or path.is_dir():
            continue
        rel = path.relative_to(results).as_posix()
        if path.suffix == ".png":
            if not path.with_suffix(".json").exists():
                problems.append(f"{rel}: a plot without {path.stem}.json beside it")
        elif path.suffix != ".json":
            problems.append(f"{rel}: only <benchmark>.json and its .png belong in a device folder")
    return problems


def check(root: Path, results: Path, allow_no_git: bool) -> tuple[list[str], list[str]]:
    """(problems, notes): every reason a file fails; what could not be checked."""
    found, problems = load_results(results)
    problems += check_files(results)
    notes = []
    git_ok = git(root, "rev-parse", "--git-dir").returncode == 0
    shallow = git_ok and git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    if not git_ok:
        notes.append(f"{root} is not a git checkout: freshness not checked")
    for r in found:
        meta = r.meta
        commit = meta["commit"]
        if meta["dirty"] is not False:
            problems.append(f"{r.path}: meta.dirty is {meta['dirty']!r}: run on uncommitted changes")
        reps = meta["reps"] if isinstance(meta["reps"], dict) else {}
        for key, least in MIN_REPS.items():
            if not isinstance(reps.get(key), int) or reps[key] < least:
                problems.append(f"{r.path}: meta.reps.{key} is {reps.get(key)!r}, fewer than {least}")
        if not isinstance(commit, str) or not SHA.match(commit):
            problems.append(f"{r.path}: meta.commit {commit!r} is not a 40-hex commit")
            continue
        if not git_ok:
            continue
        try:
            if not has_commit(root, commit):
                if shallow:
                    notes.append(f"{r.path}: commit {commit[:10]} not in this shallow clone: not checked")
                else:
                    problems.append(f"{r.path}: commit {commit[:10]} is not in this repository's history")
                continue
            last = last_change(root, TIMED[meta["benchmark"]])
        except NoGit as e:
            notes.append(f"{r.path}: {e}: not checked")
            continue
        if last is not None and not is_ancestor(root, last, commit):
            problems.append(
                f"{r.path}: measured at {commit[:10]}, before {last[:10]} changed the code it times "
                f"(check_results.TIMED[{meta['benchmark']!r}]): re-run it or remove it"
            )
    if notes and not allow_no_git:
        problems += [f"git history unavailable: {n} (pass --allow-no-git to accept)" for n in notes]
        notes = []
    return problems, notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allow-no-git", action="store_true", help="skip freshness where git history is missing")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (its git history)")
    ap.add_argument("--results", type=Path, default=None, help=f"the results folder (default ROOT/{RESULTS})")
    args = ap.parse_args(argv)
    results = args.results or args.root / RESULTS
    problems, notes = check(args.root, results, args.allow_no_git)
    for n in notes:
        print(f"note: {n}")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s) in {results}", file=sys.stderr)
        return 1
    print(f"{results}: every result is canonical, clean and current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
