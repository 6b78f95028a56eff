"""The committed results: benchmarks/results/README.md rendered from the canonical JSONs, every JSON's meta
complete and none measured before the last change to the code it times (tools/results_table.py,
tools/check_results.py), and the tools' own logic on synthetic files."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
TOOLS = ROOT / "tools"


def _tool(name: str):
    sys.path.insert(0, str(TOOLS))  # check_results imports results_table
    try:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOLS))
    return module


table = _tool("results_table")
check = _tool("check_results")


def _git_available(root: Path) -> bool:
    try:
        return (
            subprocess.run(["git", "-C", str(root), "rev-parse", "--git-dir"], capture_output=True).returncode
            == 0
        )
    except OSError:
        return False


def _meta(benchmark: str, commit: str | None = "0" * 40, **extra) -> dict:
    meta = dict(
        benchmark=benchmark,
        device="NVIDIA H200",
        device_slug="nvidia-h200",
        driver="580.0",
        cuda="13.0",
        torch="2.11.0",
        triton="3.6.0",
        jax=None,
        python="3.12.3",
        date="2026-12-01",
        started_utc="2026-12-01T00:00:00Z",
        argv=["--seeds", "0,1,2"],
        commit=commit,
        dirty=False,
        clock=dict(headline="paired CUDA-event median, L2 flushed", beside=["device_ms: CUPTI"]),
        reps=dict(warmup=10, reps=100),
        seeds=[0, 1, 2],
        performance=True,
        mode="benchmark",
    )
    meta.update(extra)
    return meta


def _write(results: Path, meta: dict, records=(), name: str | None = None, folder: str | None = None) -> Path:
    path = results / (folder or meta["device_slug"]) / f"{name or meta['benchmark']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "records": list(records)}))
    return path


# ---------------------------------------------------------------- the repository's committed results


def test_results_readme_is_rendered_from_the_committed_jsons(capsys):
    """benchmarks/results/README.md is exactly what tools/results_table.py renders from the JSONs beside it
    (after a bench run: python tools/results_table.py)."""
    rc = table.main(["--check"])
    err = capsys.readouterr()
    assert rc == 0, err.err + err.out[-4000:]


def test_committed_results_have_meta_and_are_current():
    """Every canonical JSON has the full meta, a clean commit, and postdates the last change to what it times."""
    # A shallow clone (or none) cannot say what predates what: check_results notes it and checks the rest.
    problems, notes = check.check(ROOT, ROOT / table.RESULTS, allow_no_git=True)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the tools on synthetic files


def test_meta_without_commit_is_rejected(tmp_path):
    meta = _meta("bf16")
    del meta["commit"]
    _write(tmp_path, meta)
    found, errors = table.load_results(tmp_path)
    assert not found and errors == ["nvidia-h200/bf16.json: meta lacks commit"]
    # Present but null: load_results accepts it (the table prints "-"), check_results does not.
    _write(tmp_path, _meta("bf16", commit=None, reps=dict(warmup=3, reps=100)))
    problems, _ = check.check(tmp_path, tmp_path, allow_no_git=True)
    assert any("meta.commit None is not a 40-hex commit" in p for p in problems), problems
    assert any("meta.reps.warmup is 3, fewer than 10" in p for p in problems), problems


def test_unknown_benchmark_and_stray_files_are_rejected(tmp_path, capsys):
    _write(tmp_path, _meta("bf16-nonsense"))
    _write(tmp_path, _meta("bf16", performance=False), name="bf16")
    (tmp_path / "nvidia-h200" / "lonely.png").write_bytes(b"")
    _, errors = table.load_results(tmp_path)
    assert any("unknown benchmark 'bf16-nonsense'" in e for e in errors), errors
    assert any("bf16.json: meta.performance is not true" in e for e in errors), errors
    assert table.main(["--results", str(tmp_path)]) == 1
    assert "bf16-nonsense" in capsys.readouterr().err
    problems, _ = check.check(tmp_path, tmp_path, allow_no_git=True)
    assert any("lonely.png: a plot without lonely.json" in p for p in problems), problems


def test_bf16_summary_geomean_per_seed_and_device_clock():
    """Seed 0 ratios 0.5 and 8 (geomean 2), seed 1 ratios 1 and 4 (geomean 2): median of the seeds' 2.000x,
    3 of 4 at or above 1.0x, worst 0.50x; device time read from device_speedup[torch._grouped_mm]."""
    rec = lambda seed, case, r, d: dict(  # noqa: E731
        case=case, op="fwd", impl="moegemm", status="ok", seed=seed, paired_vs_torch=r,
        device_speedup={"torch._grouped_mm": d}, host_us=50.0,
    )  # fmt: skip
    records = [rec(0, "a", 0.5, 1.0), rec(0, "b", 8.0, 1.0), rec(1, "a", 1.0, 1.0), rec(1, "b", 4.0, 1.0)]
    records.append(dict(case="a", op="fwd", impl="torch._grouped_mm", status="ok", seed=0, host_us=20.0))
    records.append(dict(case="c", op="fwd", impl="moegemm", status="failed", paired_vs_torch=100.0))
    text = table.BENCHMARKS["bf16"].summary(records)
    assert "paired: geomean 2.000x (median of 2 seeds, 2.00x), 3/4 >= 1.0x, worst 0.50x" in text, text
    assert "device time: geomean 1.000x" in text, text
    assert "moegemm 50, torch._grouped_mm 20" in text, text


def test_moe_table_labels_published_and_lists_failed_peers():
    rec = lambda impl, status="ok", **kw: dict(shape="s", routing="skewed", impl=impl, status=status, **kw)  # noqa: E731
    records = [
        rec("moegemm", fwd_tflops=600.0, step_tflops=500.0, fwd_ms=1.0, step_ms=3.0),
        rec("torch-grouped-mm", fwd_ms=2.0, step_ms=4.5),
        rec("liger", "failed", reason="out of memory"),
        rec("sonic-published", "published", fwd_tflops=400.0, step_tflops=1000.0),
        rec("slow", fwd_ms=4.0, step_ms=9.0, fwd_timing="device_ms over 2 calls", step_timing="paired"),
    ]
    records[0].update(fwd_timing="paired", step_timing="paired")
    spec = table.BENCHMARKS["moe"]
    detail = "\n".join(spec.detail(records))
    assert "published, not run: sonic-published" in detail
    assert "| 400 / 1000 (1.50x / 0.50x) |" in detail, detail
    assert "2.00x / 1.50x (- / -)" in detail, detail  # paired ratios; no device times: "-"
    assert "- liger failed on 1: out of memory" in detail
    assert "- slow fwd: device_ms over 2 calls" in detail and "slow fwd+bwd" not in detail
    assert "vs torch-grouped-mm: fwd 2.00x paired" in spec.summary(records)


def test_render_is_deterministic_and_check_sees_a_stale_readme(tmp_path, capsys):
    records = [dict(case="a", op="fwd", impl="moegemm", status="ok", paired_vs_torch=1.25)]
    _write(tmp_path, _meta("bf16"), records)
    # The H100's folder drops the memory words of its name, whichever slug meta carries.
    _write(tmp_path, _meta("bf16", device="NVIDIA H100 80GB HBM3", device_slug="nvidia-h100"), records)
    h100 = _meta("bf16-balanced", device="NVIDIA H100 80GB HBM3", device_slug="nvidia-h100-80gb-hbm3")
    _write(tmp_path, h100, records, folder="nvidia-h100")
    assert table.main(["--results", str(tmp_path)]) == 0
    first = (tmp_path / "README.md").read_text()
    assert first.index("## nvidia-h100") < first.index("## nvidia-h200")
    assert "[bf16.json](nvidia-h200/bf16.json)" in first and "geomean 1.250x" in first
    assert table.main(["--results", str(tmp_path), "--check"]) == 0
    (tmp_path / "README.md").write_text(first.replace("1.250x", "1.300x"))
    assert table.main(["--results", str(tmp_path), "--check"]) == 1
    assert "+" in capsys.readouterr().out


def _commit(repo: Path, path: str, text: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t")
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    run = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, env=env)  # noqa: E731
    run("add", path)
    run("commit", "-q", "-m", path)
    return run("rev-parse", "HEAD").stdout.decode().strip()


@pytest.mark.skipif(not _git_available(ROOT), reason="no git")
def test_result_older_than_a_later_kernel_change_is_stale(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    measured = _commit(repo, "src/moegemm/_src/kernels/m_grouped.py", "v1")
    _commit(repo, "docs/notes.md", "not timed")
    results = repo / "benchmarks" / "results"
    _write(results, _meta("bf16", commit=measured))
    problems, notes = check.check(repo, results, allow_no_git=False)
    assert problems == [] and notes == []

    later = _commit(repo, "src/moegemm/_src/kernels/m_grouped.py", "v2")
    problems, _ = check.check(repo, results, allow_no_git=False)
    assert len(problems) == 1 and f"before {later[:10]} changed the code it times" in problems[0]
    # moe does not time bench/fuzz.py: a change there leaves a moe result current.
    newer = _commit(repo, "src/moegemm/bench/fuzz.py", "x")
    _write(results, _meta("moe", commit=newer))
    problems, _ = check.check(repo, results, allow_no_git=False)
    assert [p.split(":")[0] for p in problems] == ["nvidia-h200/bf16.json"]
    # A commit this history lacks is an error, not a pass.
    _write(results, _meta("moe", commit="f" * 40))
    problems, _ = check.check(repo, results, allow_no_git=False)
    assert any("is not in this repository's history" in p for p in problems)


def test_no_git_is_an_error_unless_allowed(tmp_path):
    results = tmp_path / "results"
    _write(results, _meta("bf16", commit="a" * 40))
    problems, _ = check.check(tmp_path / "not-a-repo", results, allow_no_git=False)
    assert any("git history unavailable" in p for p in problems), problems
    problems, notes = check.check(tmp_path / "not-a-repo", results, allow_no_git=True)
    assert problems == [] and any("not a git checkout" in n for n in notes)
