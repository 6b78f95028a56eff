"""The benchmark harness on CPU: the CLI end to end on a TINY case (the CPU job checks correctness and
times nothing), the roofline, the splits, the results layout, tuning."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moegemm import shapes, testing
from moegemm._src import configs
from moegemm.bench import __main__ as cli
from moegemm.bench import harness, registry, report, roofline, timing, tune
from moegemm.bench.problem import make_problem

# These drive the CLI and the tuner on the CPU tiny suite (interpreter target); with a GPU the CLI picks
# CUDA and the suite is the benchmark itself (python -m moegemm.bench).
interpreter_suite = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tiny-suite test")

# Anchor floors (TF/s-equivalent) from the H100 baseline table, fwd, bf16.
ANCHOR_FLOORS = {
    "dsv3-ep8-fc1": (740, "compute"),
    "dsv3-ep8-fc2": (740, "compute"),
    "qwen3-30b-fc1": (335, "memory"),
    "qwen3-30b-fc2": (312, "memory"),
    "gptoss-120b-fc1": (360, "memory"),
    "mixtral-fc1": (740, "compute"),
    "finegrain-e64-fc1": (740, "compute"),
    "finegrain-e256-fc2": (473, "memory"),
}


def _env():
    return harness.Environment.detect(torch.device("cpu"))


# ---------------------------------------------------------------- roofline


@pytest.mark.parametrize("name", sorted(ANCHOR_FLOORS))
def test_roofline_matches_anchor(name):
    want, bound = ANCHOR_FLOORS[name]
    fl = roofline.floor(shapes.get(name), "fwd")
    assert fl.bound == bound
    assert abs(fl.tflops - want) < 1.5, fl


def test_roofline_qwen3_fc1_by_hand():
    case = shapes.get("qwen3-30b-fc1")
    weights = 128 * 1536 * 2048 * 2
    assert roofline.op_bytes(case, "fwd") == 2 * (16384 * 2048 + 16384 * 1536) + weights
    assert weights / 1e6 == pytest.approx(805.3, abs=0.1)  # "805 MB of weights"
    # All three ops touch x, dy-or-out and all weights once: the same bytes, the same floor.
    assert all(roofline.floor(case, op).tflops == pytest.approx(335.1, abs=0.1) for op in roofline.OPS)
    assert roofline.floor(shapes.get("dsv3-ep8-fc1"), "wgrad").tflops == pytest.approx(740)
    assert roofline.tflops(case, "fwd", ms=1.0) == pytest.approx(case.flops / 1e-3 / 1e12)
    with pytest.raises(ValueError, match="op must be"):
        roofline.floor(case, "bwd")


# ---------------------------------------------------------------- group splits


def test_splits_dirichlet_balanced_jagged():
    case = shapes.get("tiny-qwen3-fc2")  # G=16 -> one empty expert
    dev = torch.device("cpu")
    p = make_problem(case, device=dev, split="dirichlet", seed=3)
    assert sum(p.sizes) == case.M and len(p.sizes) == case.G and p.sizes.count(0) >= case.G // 16
    assert p.sizes == make_problem(case, device=dev, split="dirichlet", seed=3).sizes  # seeded
    assert p.sizes != make_problem(case, device=dev, split="dirichlet", seed=4).sizes
    assert p.group_sizes.tolist() == p.sizes and p.offsets[-1] == case.M
    b = make_problem(case, device=dev, split="balanced")
    assert b.sizes == [case.M // case.G] * case.G and b.split == "balanced"
    j = make_problem(case, device=dev, jagged=[100, 0, 28])
    assert (j.case.G, j.case.M, j.case.K, j.case.N) == (3, 128, case.K, case.N)
    assert (
        j.sizes == [100, 0, 28]
        and j.split == "jagged:100,0,28"
        and j.bounds == [(0, 100), (100, 100), (100, 128)]
    )
    x, w, dy = j.copies[0]
    assert x.shape == (128, case.K) and w.shape == (3, case.N, case.K) and dy.shape == (128, case.N)


def test_select_cases_te_style_and_names():
    args = cli.parse_args(
        [
            "--num-experts",
            "64",
            "--ep-size",
            "8",
            "--hidden-dim",
            "2048",
            "--expert-dim",
            "768",
            "--tokens",
            "4096",
        ]
    )
    fc1, fc2 = cli.select_cases(args, shapes, cuda=True)
    assert (fc1.G, fc1.M, fc1.K, fc1.N) == (8, 4096, 2048, 768) and (fc2.K, fc2.N) == (768, 2048)
    assert cli.select_cases(cli.parse_args([]), shapes, cuda=False) == list(shapes.TINY)
    assert cli.select_cases(cli.parse_args([]), shapes, cuda=True) == list(shapes.SUITE)
    assert [
        c.name for c in cli.select_cases(cli.parse_args(["--cases", "tiny-odd,mixtral-fc1"]), shapes, True)
    ] == ["tiny-odd", "mixtral-fc1"]
    with pytest.raises(SystemExit):
        cli.select_cases(cli.parse_args(["--num-experts", "64"]), shapes, cuda=True)


# ---------------------------------------------------------------- the check before the timing


def test_wrong_output_fails_and_is_not_timed():
    problem = make_problem(shapes.get("tiny-qwen3-fc2"), device=torch.device("cpu"))
    loop = registry.load_impls()["loop-torch.mm"]

    def drops_biggest_group(problem, op):
        fn = loop.prepare(problem, op)
        s, e = max(problem.bounds, key=lambda b: b[1] - b[0])
        return lambda: (lambda out: out.index_fill_(0, torch.arange(s, e), 0.0))(fn())

    bad = registry.Impl("bad", ("fwd",), drops_biggest_group)
    ref = harness.lazy(lambda: problem.reference("fwd"))
    rec = harness.measure(problem, "fwd", bad, _env(), tcfg=harness.timing.TimingConfig(), reference=ref)
    assert rec["status"] == "failed" and rec["ms"] is None and rec["relerr"] > rec["tol"]
    assert "relerr" in rec["reason"]
    rec = harness.measure(problem, "dgrad", bad, _env(), tcfg=harness.timing.TimingConfig(), reference=ref)
    assert rec["status"] == "skipped" and "does not implement dgrad" in rec["reason"]
    ok = harness.measure(problem, "fwd", loop, _env(), tcfg=harness.timing.TimingConfig(), reference=ref)
    assert ok["status"] == "ok" and ok["relerr"] <= testing.REL_TOL[torch.bfloat16] and ok["ms"] > 0


def test_chunked_relerr_matches_testing_relerr(monkeypatch):
    out, ref = torch.randn(3000, dtype=torch.bfloat16), torch.randn(3000, dtype=torch.float64)
    whole = testing.relerr(out, ref)
    monkeypatch.setattr(harness, "RELERR_CHUNK", 1000)
    assert harness.relerr(out, ref) == pytest.approx(whole, rel=1e-12)
    out[1234] = float("nan")
    assert harness.relerr(out, ref) == math.inf


# ---------------------------------------------------------------- the CLI end to end


# Text that only means something on a GPU: none of it may appear in the CPU job's output.
PERFORMANCE_WORDS = ("TF/s", "floor", "geomean", "vs torch", "speedup", " ms ", "paired")


@interpreter_suite
def test_cli_cpu_job_checks_correctness_and_times_nothing(tmp_path, capsys):
    """Without a GPU the main job says first that interpreter timings are not performance, checks every
    (case, op, impl) against the oracle, and prints and records no time, TF/s, ratio or roofline floor."""
    out = tmp_path / "r.json"
    impls = "moegemm,torch._grouped_mm,loop-torch.mm,dense-cublas"
    argv = ["--cases", "tiny-qwen3-fc2", "--ops", "fwd,wgrad", "--impls", impls, "--out", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == report.CPU_NOTICE.splitlines()[0]
    assert "not performance" in text.splitlines()[0]
    assert "correctness PASS: 8/8" in text and "relerr" in text
    printed = text.split("\n", 2)[2]  # after the notice, which names what is left out
    assert not [w for w in PERFORMANCE_WORDS if w in printed], printed
    data = json.loads(out.read_text())
    assert set(data) == {"meta", "records"}
    meta, records = data["meta"], data["records"]
    assert (
        meta["mode"] == "correctness" and meta["performance"] is False and meta["notice"] == report.CPU_NOTICE
    )
    assert meta["timing"] is None and meta["roofline"] is None and meta["summary"] is None
    assert meta["paired"] is False and meta["correctness"] == {
        "checked": 8,
        "passed": 8,
        "failed": 0,
        "skipped": 0,
        "failures": [],
    }
    assert (
        meta["device"].startswith("cpu")
        and meta["torch"] == torch.__version__
        and meta["ops"] == ["fwd", "wgrad"]
    )
    assert {(r["op"], r["impl"]) for r in records} == {
        (op, impl)
        for op in ("fwd", "wgrad")
        for impl in ("moegemm", "torch._grouped_mm", "loop-torch.mm", "dense-cublas")
    }
    for r in records:
        assert list(r)[: len(report.RECORD_FIELDS)] == list(report.RECORD_FIELDS)
        assert r["status"] == "ok", r
        assert 0 <= r["relerr"] <= r["tol"] == testing.REL_TOL[torch.bfloat16]
        assert r["ms"] is r["tflops"] is r["floor_tflops"] is r["pct_floor"] is r["vs_torch"] is None
        assert r["speedup"] == {} and "paired_ms" not in r
        assert (r["G"], r["M"], r["K"], r["N"], r["split"]) == (16, 128, 48, 64, "dirichlet")
    moe = next(r for r in records if r["impl"] == "moegemm" and r["op"] == "fwd")
    assert moe["backend"] == "interpret"
    # The tile config moegemm's launcher picked is recorded, with the cache key --tune would write.
    assert moe["config"] == dataclasses.asdict(configs.candidates("m_grouped", "interpret")[0])
    assert moe["cache_key"] == configs.cache_key("m_grouped", "bfloat16", 16, 64, 48, 128)
    assert not out.with_suffix(".png").exists()  # a TF/s plot: GPU runs only


@interpreter_suite
def test_cli_cpu_job_fails_on_a_wrong_impl(tmp_path, capsys, monkeypatch):
    """A deliberately wrong impl (its biggest group's rows zeroed) fails its check, the job says so and
    exits 1; the right impls beside it still pass."""
    registry.load_impls()
    loop = registry.REGISTRY["loop-torch.mm"]

    def drops_biggest_group(problem, op):
        fn = loop.prepare(problem, op)
        s, e = max(problem.bounds, key=lambda b: b[1] - b[0])
        return lambda: fn().index_fill_(0, torch.arange(s, e), 0.0)

    monkeypatch.setitem(registry.REGISTRY, "wrong", registry.Impl("wrong", ("fwd",), drops_biggest_group))
    out = tmp_path / "r.json"
    argv = ["--cases", "tiny-odd", "--ops", "fwd", "--impls", "loop-torch.mm,wrong", "--out", str(out)]
    assert cli.main(argv) == 1
    text = capsys.readouterr().out
    assert "correctness FAIL: 1/2" in text and "failed: tiny-odd fwd wrong: relerr" in text
    correctness = json.loads(out.read_text())["meta"]["correctness"]
    assert correctness["failed"] == 1 and correctness["passed"] == 1
    assert correctness["failures"][0].startswith("tiny-odd fwd wrong: relerr")


@interpreter_suite
def test_cli_fp8_cpu_job_checks_and_times_nothing(tmp_path, capsys):
    """--fp8 without a GPU: moegemm's FP8 GEMM checked under the interpreter, no peer, time or floor."""
    out = tmp_path / "fp8.json"
    argv = ["--fp8", "--cases", "tiny-qwen3-fc2", "--ops", "wgrad", "--fp8-recipes", "tensorwise"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == report.CPU_NOTICE.splitlines()[0] and "correctness PASS: 1/1" in text
    assert not [w for w in PERFORMANCE_WORDS if w in text.split("\n", 2)[2]]
    data = json.loads(out.read_text())
    assert data["meta"]["performance"] is False and data["failed"] == 0
    (row,) = data["rows"]
    assert row["impl"] == "moegemm-fp8" and row["ms"] is None and row["relerr"] < 1e-3


def test_results_layout_one_canonical_file_per_benchmark_and_device():
    """GPU runs overwrite benchmarks/results/<device>/<benchmark>.json; CPU runs land in cpu-*, which
    .gitignore covers."""
    assert report.results_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100"
    assert report.results_slug("NVIDIA H200") == "nvidia-h200"
    assert report.results_slug("NVIDIA H100 PCIe") == "nvidia-h100-pcie"
    assert report.results_slug(_env().device).startswith("cpu-")
    assert (
        report.default_out("NVIDIA H100 80GB HBM3", "bf16").as_posix()
        == "benchmarks/results/nvidia-h100/bf16.json"
    )
    name = report.bf16_benchmark_name
    assert name("bf16", "dirichlet", ["moegemm", "torch._grouped_mm"], jagged=False, tune=False) == "bf16"
    assert (
        name("bf16", "balanced", ["moegemm", "torch._grouped_mm"], jagged=False, tune=False)
        == "bf16-balanced"
    )
    assert name("bf16", "dirichlet", ["moegemm", "moegemm-jax"], jagged=False, tune=False) == "jax"
    assert name("bf16", "dirichlet", None, jagged=False, tune=False) == "bf16"  # every impl: the BF16 run
    assert name("fp16", "dirichlet", ["moegemm"], jagged=True, tune=False) == "fp16-jagged"
    assert name("bf16", "dirichlet", ["moegemm"], jagged=False, tune=True) == "tune"
    ignored = (Path(__file__).parents[1] / ".gitignore").read_text().splitlines()
    assert "benchmarks/results/cpu-*" in ignored


def test_cli_tune_refuses_without_hopper():
    with pytest.raises(SystemExit, match="sm90"):
        cli.main(["--tune", "--device", "cpu", "--cases", "tiny-odd", "--no-plot"])


def test_cli_jagged_splits_and_skip_reason(tmp_path):
    out = tmp_path / "j.json"
    argv = [
        "--cases",
        "tiny-odd",
        "--ops",
        "fwd",
        "--impls",
        "loop-torch.mm,torch._grouped_mm",
        "--jagged-splits",
        "100,0,28",
        "--split",
        "balanced",
        "--out",
        str(out),
        "--no-plot",
    ]
    assert cli.main(argv) == 0
    records = json.loads(out.read_text())["records"]
    by = {r["impl"]: r for r in records}
    assert by["loop-torch.mm"]["status"] == "ok" and by["loop-torch.mm"]["split"] == "jagged:100,0,28"
    assert (by["loop-torch.mm"]["G"], by["loop-torch.mm"]["M"]) == (3, 128)
    # tiny-odd has K=33, N=65: torch._grouped_mm's 16-byte stride rule cannot hold, and says so.
    assert by["torch._grouped_mm"]["status"] == "skipped" and "16 bytes" in by["torch._grouped_mm"]["reason"]
    assert not out.with_suffix(".png").exists()


# ---------------------------------------------------------------- --tune


@interpreter_suite
def test_tune_writes_cache_under_the_launchers_key(tmp_path, monkeypatch):
    monkeypatch.setattr(configs, "CACHE_DIR", tmp_path)
    env = _env()
    (tmp_path / f"{env.device_slug}.json").write_text(json.dumps({"other|key": {"block_k": 1}}))
    case = shapes.get("tiny-727-577-859")
    spec = harness.RunSpec(
        cases=[case],
        ops=["wgrad"],
        impls=[],
        device=torch.device("cpu"),
        timing=harness.timing.TimingConfig.quick(),
    )
    registry.load_impls()
    records, path = tune.tune(spec, env, target="interpret", cache_dir=tmp_path)
    (best,) = [r for r in records if r["best"]]
    # wgrad runs k_grouped_mm(dy, x): the launcher's K is the case's N and its N the case's K.
    key = configs.cache_key("k_grouped", "bfloat16", case.G, case.K, case.N, case.M)
    assert best["status"] == "ok" and best["cache_key"] == key
    cache = configs.load_cache(env.device)  # cleared by write_cache, so it reads the new file
    assert cache[key] == best["config"] and cache["other|key"] == {"block_k": 1}
    assert configs.KGroupedConfig(**cache[key]) in configs.candidates("k_grouped", "interpret")
    assert configs.pick_config is not tune.force_config  # restored
    configs.load_cache.cache_clear()


def test_frontends_compare_device_time_and_host_cost():
    """The JAX-vs-torch front-end summary uses device_ms on both sides (one clock) and medians host_us."""

    def rec(case, impl, device_ms, host_us):
        return dict(case=case, op="fwd", impl=impl, status="ok", device_ms=device_ms, host_us=host_us)

    records = [
        rec("a", "moegemm", 1.0, 20.0),
        rec("a", "moegemm-jax", 1.25, 40.0),  # torch/jax = 0.8: JAX slower on device
        rec("b", "moegemm", 2.0, 30.0),
        rec("b", "moegemm-jax", 1.6, 50.0),  # 1.25
        rec("b", "torch._grouped_mm", 9.0, 10.0),  # not part of the front-end comparison
        rec("c", "moegemm", 1.0, 25.0),  # no JAX record for c: not compared
    ]
    s = report.frontends(records)
    assert s["jax_vs_torch_device_compared"] == 2
    assert s["jax_vs_torch_device_geomean"] == pytest.approx(1.0)
    assert s["jax_vs_torch_device_worst"] == pytest.approx(0.8)
    assert s["host_us_median"] == {"moegemm": 25.0, "moegemm-jax": 50.0}


def test_device_and_host_clocks_are_none_off_cuda():
    """CPU runs report no device or host time (the interpreter runs kernels inside the call)."""
    from moegemm.bench import timing

    cpu = torch.device("cpu")
    assert timing.device_ms(lambda: None, cpu) is None and timing.host_us(lambda: None, cpu) is None


def test_jax_ep_bench_checks_and_times_nothing_on_cpu(tmp_path):
    """The JAX EP bench (bench/ep_jax.py, run by ``--ep`` in a child): on 2 XLA host devices it checks the EP
    block, its local step and the local-rows ideal against the single-device block and times nothing."""
    out = tmp_path / "ep-jax.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "moegemm.bench.ep_jax", "--ep-sizes", "2", "--ep-shapes", "tiny-E8-k2"]
    result = subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    impls = {(r["impl"], r["pass"]) for r in records}
    assert impls == {
        (i, p) for i in ("ep", "ep local step", "local rows (ideal)") for p in ("fwd", "fwd+bwd")
    }
    assert all(r["status"].startswith("ok") for r in records), [r["status"] for r in records]
    assert not [r for r in records if "ms" in r or "vs_ideal" in r]


def test_jax_ep_ratios():
    from moegemm.bench import ep_jax

    def rec(impl, ms):
        return dict(case="c", ep=2, impl=impl, ms=ms, **{"pass": "fwd"})

    records = [rec("ep", 3.0), rec("ep local step", 2.2), rec("local rows (ideal)", 2.0)]
    ep_jax._ratios(records)
    assert (records[0]["ideal_ms"], records[0]["vs_ideal"], records[1]["vs_ideal"]) == (2.0, 1.5, 1.1)
    assert "vs_ideal" not in records[2]


def test_summary_reports_each_shape_set_apart():
    """The suite and the held-out set (never tuned) get their own geomean and counts."""

    def rec(case, vs_torch, pct_floor):
        return dict(case=case, op="fwd", impl="moegemm", status="ok", vs_torch=vs_torch, pct_floor=pct_floor)

    records = [
        rec("dsv3-ep8-fc1", 1.21, 90.0),
        rec("qwen3-30b-fc1", 1.0, 80.0),
        rec("kimi-k2-ep8-fc1", 0.9, 70.0),
        rec("olmoe-fc1", 0.81, 86.0),
        dict(case="olmoe-fc1", op="fwd", impl="torch._grouped_mm", status="ok", vs_torch=None),
    ]
    s = report.summary(records)
    assert set(s["by_set"]) == {"suite", "heldout"}
    suite, held = s["by_set"]["suite"], s["by_set"]["heldout"]
    assert suite["geomean_vs_torch"] == pytest.approx(1.1) and suite["ge_1x_torch"] == 2
    assert held["geomean_vs_torch"] == pytest.approx(math.sqrt(0.9 * 0.81)) and held["ge_1x_torch"] == 0
    assert held["worst_vs_torch"] == pytest.approx(0.81) and held["ge_85pct_floor"] == 1
    assert s["compared"] == 4 and "heldout:" in report.summary_line(s)


def test_paired_timing_alternates_the_implementations():
    """timing.paired_ms calls the implementations in turns (a, b, a, b, ...), so a clock that drifts
    during the run moves both alike; a median per implementation comes back."""
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    got = timing.paired_ms(fns, torch.device("cpu"), timing.TimingConfig(cpu_reps=4), estimate_ms=1.0)
    assert set(got) == {"a", "b"} and all(v >= 0 for v in got.values())
    assert calls == ["a", "b"] * 4


def _paired_spec() -> harness.RunSpec:
    """A loop of torch.mm against torch._grouped_mm on one tiny case-op, on the paired clock (its CPU form)."""
    registry.load_impls()
    return harness.RunSpec(
        cases=[shapes.get("tiny-qwen3-fc2")],
        ops=["fwd"],
        impls=[registry.REGISTRY["loop-torch.mm"], registry.REGISTRY["torch._grouped_mm"]],
        device=torch.device("cpu"),
        timing=timing.TimingConfig.quick(),
        paired=True,
    )


def test_paired_records_and_summary():
    """A timed run with paired on (the GPU default): every ok implementation of a case-op gets paired_ms,
    moegemm's paired_vs_torch is its paired speedup over torch._grouped_mm, and the summary reports the
    paired geomean. Driven through the harness here: the CPU CLI times nothing."""
    spec = _paired_spec()
    records = {r["impl"]: r for r in harness.run(spec, _env())}
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["paired_ms"] > 0 for r in records.values())
    loop, peer = records["loop-torch.mm"], records["torch._grouped_mm"]
    assert loop["paired_vs_torch"] == pytest.approx(peer["paired_ms"] / loop["paired_ms"])
    assert loop["pct_floor"] == pytest.approx(100 * loop["tflops"] / loop["floor_tflops"])
    for r in records.values():
        r["impl"] = "moegemm" if r is loop else r["impl"]  # the summary is about the subject, moegemm
    summary = report.summary(list(records.values()))
    assert summary["paired_compared"] == 1
    assert summary["paired_geomean_vs_torch"] == pytest.approx(loop["paired_vs_torch"])
    records = harness.run(dataclasses.replace(spec, paired=False), _env())
    assert all("paired_ms" not in r for r in records)


def test_seeds_each_get_records_and_the_summary_takes_their_median():
    """RunSpec.seeds runs every case once per routing seed (each its own group sizes); the summary's ratio of a
    case-op is the median over the seeds."""
    spec = _paired_spec()
    impls = spec.impls
    records = harness.run(dataclasses.replace(spec, seeds=(0, 1, 2)), _env())
    assert sorted((r["impl"], r["seed"]) for r in records) == sorted(
        (i.name, s) for i in impls for s in (0, 1, 2)
    )
    mine = [r for r in records if r["impl"] == "loop-torch.mm"]
    for r, ratio in zip(mine, (0.5, 2.0, 1.5)):
        r.update(impl="moegemm", vs_torch=ratio, paired_vs_torch=ratio)
    summary = report.summary(records)
    assert summary["compared"] == 1 and summary["geomean_vs_torch"] == pytest.approx(1.5)
    assert summary["seeds"] == [0, 1, 2]


def test_timing_counts_and_meta():
    """At least 10 warm-ups always, and 100 timed calls of a small problem (20 of a large one); the result
    file's meta names the clock, the reps and the code's commit."""
    cfg = timing.TimingConfig()
    assert cfg.counts(2, 0.01) == (int(cfg.warmup_ms / 0.005), cfg.max_reps)
    assert cfg.counts(2, 1.0) == (50, 200)  # 0.5 ms a call: the budgets
    warmup, reps = cfg.counts(2, 2 * 0.9)  # 0.9 ms a call: small
    assert warmup >= 10 and reps >= 100
    warmup, reps = cfg.counts(3, 3 * 50.0)  # 50 ms a call: large
    assert warmup == 10 and reps == 20
    meta = report.run_meta(_env(), False, ["--x"], benchmark="bf16", tcfg=cfg, seeds=(0, 1, 2))
    assert meta["benchmark"] == "bf16" and meta["argv"] == ["--x"] and meta["seeds"] == [0, 1, 2]
    assert meta["clock"]["headline"] == timing.HEADLINE and meta["reps"]["warmup"] == 10
    assert meta["reps"]["reps"] == 100 and set(meta) >= {
        "commit",
        "dirty",
        "driver",
        "torch",
        "triton",
        "jax",
    }
    os.environ["MOEGEMM_COMMIT"], os.environ["MOEGEMM_DIRTY"] = "a" * 40, "0"
    try:
        assert report.code_version() == {"commit": "a" * 40, "dirty": False}
    finally:
        del os.environ["MOEGEMM_COMMIT"], os.environ["MOEGEMM_DIRTY"]


# ---------------------------------------------------------------- tools/


TOOLS = Path(__file__).parents[1] / "tools"


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tools_use_only_the_public_api_and_say_how_to_run():
    """A maintained tool imports moegemm's public modules only and opens with a usage docstring."""
    import ast

    tools = sorted(TOOLS.glob("*.py"))
    assert tools
    for path in tools:
        tree = ast.parse(path.read_text())
        assert "Usage" in (ast.get_docstring(tree) or ""), path.name
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        private = [n for n in names if n.startswith(("moegemm._src", "moegemm.bench", "moegemm.testing"))]
        assert not private, (path.name, private)


def test_compare_results_ratios_peer_correction_and_exit(tmp_path, capsys):
    """after/before speed per clock, the vs-torch correction that cancels a drift of the GPU's clock,
    and --fail-below judging the paired geomean."""
    compare = _tool("compare_results")
    TORCH = harness.TORCH_PEER

    def write(name, moe_ms, torch_ms):
        rec = lambda impl, ms: dict(case="c", op="fwd", impl=impl, split="dirichlet", ms=ms, paired_ms=ms)
        path = tmp_path / name
        path.write_text(json.dumps({"meta": {}, "records": [rec("moegemm", moe_ms), rec(TORCH, torch_ms)]}))
        return path

    # After: the whole GPU 10% slower (both impls), moegemm itself no faster or slower than torch.
    before, after = write("a.json", 1.0, 2.0), write("b.json", 1.1, 2.2)
    (row,) = compare.compare(compare.load(before), compare.load(after), "moegemm")
    assert row["ms"] == pytest.approx(1 / 1.1) and row["paired_ms"] == pytest.approx(1 / 1.1)
    assert row["vs_peer"] == pytest.approx(1.0)
    assert compare.main([str(before), str(after), "--fail-below", "0.95"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert compare.main([str(before), str(before), "--fail-below", "0.95"]) == 0
