"""The performance fuzz (moegemm.bench.fuzz) on CPU: its distribution, twins and caps; the CLI's check-only
run under the interpreter (exit 0, the JSON's fields; exit 1 on a wrong impl); the record and summary logic
of a GPU run with the timing stood in for."""

import json
import math

import pytest
import torch

from moegemm import shapes
from moegemm.bench import __main__ as cli
from moegemm.bench import fuzz, harness, registry, report, timing

interpreter_suite = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")
CLASSES = [c[0] for c in fuzz.CLASSES]
SPLITS = [s[0] for s in fuzz.SPLITS]


# ---------------------------------------------------------------- the distribution


def test_draw_is_deterministic_and_covers_every_class_and_split():
    cases = fuzz.draw(200, 0)
    assert cases == fuzz.draw(200, 0)
    assert [fc.case for fc in cases] != [fc.case for fc in fuzz.draw(200, 1)]
    assert [fc.case.name for fc in cases] == [f"fuzz-0-{i}" for i in range(200)]
    assert {fc.k_class for fc in cases} == set(CLASSES) == {fc.n_class for fc in cases}
    assert {fc.split for fc in cases} == set(SPLITS)
    for fc in cases:
        c = fc.case
        assert fuzz.alignment_class(c.K) == fc.k_class and fuzz.alignment_class(c.N) == fc.n_class
        assert 1 <= c.G <= 256 and 1 <= c.M <= 65536 and 16 <= c.K <= 16384 and 16 <= c.N <= 16384
    # Shapes torch refuses (a BF16 row not 16-byte aligned) and shapes it accepts are both drawn.
    accepts = {fuzz.torch_accepts(fc.case, torch.device("cpu"), torch.bfloat16, False) for fc in cases}
    assert accepts == {True, False}
    # The ranges are spanned, both ends (log-uniform puts mass on the small end too).
    assert min(fc.case.M for fc in cases) < 16 and max(fc.case.M for fc in cases) > 8192
    assert min(fc.case.G for fc in cases) == 1 and max(fc.case.G for fc in cases) > 128


def test_alignment_classes_and_snap():
    assert [fuzz.alignment_class(v) for v in (256, 192, 1000, 1002, 1001)] == ["128", "64", "8", "2", "odd"]
    assert fuzz.snap(1000, "odd") == 999  # 999 and 1001 tie: down
    assert fuzz.snap(1000, "8") == 1000 and fuzz.snap(1000, "128") == 1024 and fuzz.snap(1000, "64") == 960
    assert fuzz.snap(16, "128") == 128 and fuzz.snap(16, "64") == 64  # inside [16, 16384]
    assert fuzz.snap(16384, "odd") == 16383 and fuzz.snap(16384, "2") == 16382


def test_twins_are_aligned_and_near():
    for fc in fuzz.draw(200, 3):
        c, t = fc.case, fc.twin
        assert (t.G, t.M) == (c.G, c.M) and t.name == f"{c.name}-twin"
        for drawn, aligned in ((c.K, t.K), (c.N, t.N)):
            assert aligned % 16 == 0 and aligned >= 16 and abs(aligned - drawn) <= 8
            # The nearest multiple of 16: none is closer.
            assert all(abs(m - drawn) >= abs(aligned - drawn) for m in range(16, 16385, 16))


def test_rejection_caps_hold():
    for fc in fuzz.draw(200, 0):
        assert fuzz.case_bytes(fc.case) <= fuzz.BYTES_CAP and fuzz.case_bytes(fc.twin) <= fuzz.BYTES_CAP
        assert 2 * fc.case.M * fc.case.N * fc.case.K <= fuzz.FLOPS_CAP
    # A tight cap redraws, deterministically, and every case fits it.
    cap = 32 * 2**20
    small = fuzz.draw(50, 0, bytes_cap=cap)
    assert small == fuzz.draw(50, 0, bytes_cap=cap) and sum(fc.redraws for fc in small) > 0
    assert all(fuzz.case_bytes(fc.case) <= cap for fc in small)
    case = shapes.Case("c", 4, 100, 24, 40)
    largest = 100 * 40  # M*N: above G*N*K = 3840 and M*K = 2400
    assert fuzz.case_bytes(case) == (100 * 24 + 4 * 40 * 24 + 100 * 40 + largest) * 2 + 4 * largest


def test_cpu_clamp_keeps_classes_and_shrinks():
    for fc in fuzz.draw(200, 0):
        small = fuzz.clamp_cpu(fc)
        c = small.case
        assert small.drawn == (fc.case.G, fc.case.M, fc.case.K, fc.case.N) and c.name == fc.case.name
        assert (fuzz.alignment_class(c.K), fuzz.alignment_class(c.N)) == (fc.k_class, fc.n_class)
        assert c.G <= min(fc.case.G, fuzz.CPU_G) and c.M <= fc.case.M
        assert max(c.M, c.G) * c.K * c.N <= fuzz.CPU_VOLUME


def test_twin_ops_follow_the_reference():
    ops = ["fwd", "dgrad", "wgrad"]
    assert fuzz.twin_ops(False, ops, fp8=False, twins="refused") == ops
    assert fuzz.twin_ops(True, ops, fp8=False, twins="refused") == []
    assert fuzz.twin_ops(True, ops, fp8=False, twins="all") == ops
    assert fuzz.twin_ops(True, ops, fp8=True, twins="refused") == ["wgrad"]  # no torch FP8 wgrad
    cpu = torch.device("cpu")
    assert fuzz.torch_accepts(shapes.Case("a", 2, 8, 24, 40), cpu, torch.bfloat16, fp8=False)
    assert not fuzz.torch_accepts(shapes.Case("a", 2, 8, 24, 42), cpu, torch.bfloat16, fp8=False)
    assert not fuzz.torch_accepts(shapes.Case("a", 2, 8, 24, 48), cpu, torch.bfloat16, fp8=True)


# ---------------------------------------------------------------- records and summary (timing stood in)


def _fc(K, N, index=0):
    return fuzz.FuzzCase(index, shapes.Case(f"fuzz-9-{index}", 2, 24, K, N), "dirichlet", 5, "x", "y")


@interpreter_suite
def test_records_ratios_against_torch_or_the_twin(monkeypatch):
    """The GPU path's records on the interpreter, with paired_ms stood in: vs_torch where torch accepts,
    vs_aligned (TF/s over the twin's) where it refuses."""
    monkeypatch.setattr(fuzz.Fuzz, "check_only", False)
    timed = []

    def fake_time(self, fns):
        timed.append(sorted(fns))
        return {name: {"moegemm": 2.0, harness.TORCH_PEER: 1.0}[name] for name in fns}

    monkeypatch.setattr(fuzz.Fuzz, "_time", fake_time)
    run = fuzz.Fuzz(
        harness.Environment.detect(torch.device("cpu")), torch.device("cpu"), torch.bfloat16, ["fwd"], None
    )
    (acc,) = run.measure_case(_fc(16, 24))
    assert acc["torch_accepts"] and acc["status"] == "ok" and acc["torch_status"] == "ok"
    assert acc["vs_torch"] == 0.5 and acc["vs_aligned"] is None and acc["twin_ms"] is None
    assert acc["reference"] == "torch" and acc["target"] == 0.95 and acc["meets_target"] is False
    assert timed == [["moegemm", harness.TORCH_PEER]]
    (ref,) = run.measure_case(_fc(16, 9, 1))
    assert not ref["torch_accepts"] and ref["torch_status"] == "skipped" and ref["twin"]["N"] == 16
    assert ref["twin"]["K"] == 16 and ref["twin_status"] == "ok" and ref["twin_ms"] == 2.0
    # Same ms, so the ratio of TF/s is the ratio of FLOPs: 16*9 over 16*16 (N = 9 -> 16, the nearest 16).
    assert ref["vs_aligned"] == pytest.approx(16 * 9 / (16 * 16))
    assert ref["reference"] == "aligned twin" and ref["target"] == 0.6 and ref["meets_target"] is False
    assert timed[1:] == [["moegemm"], ["moegemm"]]  # the case (torch refused), then its twin


def _record(i, op, vs_torch=None, vs_aligned=None, recipe=None):
    rec = {
        "case": f"fuzz-0-{i}",
        "op": op,
        "G": 2,
        "M": 10,
        "K": 16,
        "N": 17,
        "k_class": "8",
        "n_class": "odd",
        "split": "balanced",
        "status": "ok",
        "reason": None,
        "vs_torch": vs_torch,
        "vs_aligned": vs_aligned,
        "moegemm_ms": 1.0,
        "torch_ms": vs_torch,
        "twin_ms": 0.5,
    }
    return rec | ({"recipe": recipe} if recipe else {})


def test_summary_counts_targets_and_names_the_worst():
    records = [_record(i, "fwd", vs_torch=0.5 + 0.05 * i) for i in range(20)]
    records += [_record(20 + i, "wgrad", vs_aligned=0.4 + 0.1 * i) for i in range(5)]
    s = fuzz.summarize(records)
    t, a = s["vs_torch"], s["vs_aligned"]
    assert t["count"] == 20 and t["min"] == 0.5 and t["below_target"] == 9  # 0.50 .. 0.90
    assert t["median"] == pytest.approx(0.975) and t["p5"] == pytest.approx(0.5475)
    assert t["geomean"] == pytest.approx(math.exp(sum(math.log(r["vs_torch"]) for r in records[:20]) / 20))
    assert [w["case"] for w in t["worst"]] == [f"fuzz-0-{i}" for i in range(10)]
    assert (
        t["worst"][0]["shape"] == {"G": 2, "M": 10, "K": 16, "N": 17} and t["worst"][0]["reference_ms"] == 0.5
    )
    assert a["count"] == 5 and a["below_target"] == 2 and a["worst"][0]["reference_ms"] == 0.5
    assert s["passed"] == 25 and s["failed"] == []
    lines = fuzz._summary_lines(s)
    assert "9 below the 0.95x target" in lines[0] and "2 below the 0.6x target" in lines[1]
    fuzz._worst_table(s, "t")
    per_recipe = fuzz.summarize(
        [_record(0, "fwd", 1.0, recipe="rowwise"), _record(0, "fwd", 1.2, recipe="tensorwise")]
    )
    assert set(per_recipe) == {"rowwise", "tensorwise"} and per_recipe["tensorwise"]["vs_torch"]["min"] == 1.2
    assert fuzz._summary_lines(per_recipe)[0].startswith("rowwise: vs_torch: 1 case-ops")
    fuzz._worst_table(per_recipe, "t")


# ---------------------------------------------------------------- the CLI on CPU


@interpreter_suite
def test_cli_cpu_fuzz_checks_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    assert cli.main(["--fuzz", "3", "--seed", "0", "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == report.CPU_NOTICE.splitlines()[0]
    assert "correctness PASS: 9/9" in text and "fuzz-0-2" in text
    data = json.loads(out.read_text())
    meta, records = data["meta"], data["records"]
    assert meta["performance"] is False and meta["partial"] is False and meta["seed"] == 0 and meta["n"] == 3
    assert meta["torch"] == torch.__version__ and meta["distribution"]["split"] == dict(fuzz.SPLITS)
    assert meta["correctness"] == {"checked": 9, "failed": []}
    drawn = [fuzz.clamp_cpu(fc) for fc in fuzz.draw(3, 0)]
    assert [(r["case"], r["op"]) for r in records] == [
        (fc.case.name, op) for fc in drawn for op in ("fwd", "dgrad", "wgrad")
    ]
    for r, fc in zip(records, (fc for fc in drawn for _ in range(3))):
        assert (r["G"], r["M"], r["K"], r["N"]) == (fc.case.G, fc.case.M, fc.case.K, fc.case.N)
        assert (r["split"], r["k_class"], r["n_class"]) == (fc.split, fc.k_class, fc.n_class)
        assert r["twin"] == {"G": fc.twin.G, "M": fc.twin.M, "K": fc.twin.K, "N": fc.twin.N}
        assert r["status"] == "ok" and 0 <= r["relerr"] <= r["tol"]
        assert r["torch_accepts"] == (fc.case.K % 8 == 0 and fc.case.N % 8 == 0)
        # A refused shape checks its twin too; nothing is timed.
        assert r["twin_status"] == (None if r["torch_accepts"] else "ok")
        for key in ("moegemm_ms", "torch_ms", "twin_ms", "vs_torch", "vs_aligned", "moegemm_tflops"):
            assert r[key] is None
    assert any(not r["torch_accepts"] for r in records)


@interpreter_suite
def test_cli_cpu_fuzz_fails_on_a_wrong_impl(tmp_path, capsys, monkeypatch):
    """moegemm replaced by an impl that doubles a right answer: the check fails and the run exits 1."""
    fuzz._impls()
    loop = registry.REGISTRY["loop-torch.mm"]

    def doubled(problem, op):
        fn = loop.prepare(problem, op)
        return lambda: fn().mul_(2)

    monkeypatch.setitem(registry.REGISTRY, "moegemm", registry.Impl("moegemm", loop.ops, doubled))
    out = tmp_path / "fuzz.json"
    assert cli.main(["--fuzz", "1", "--ops", "fwd", "--device", "cpu", "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "correctness FAIL: 0/1" in text and "failed: fuzz-0-0 fwd: relerr" in text
    data = json.loads(out.read_text())
    assert data["meta"]["correctness"]["failed"] == ["fuzz-0-0 fwd"]
    assert data["records"][0]["status"] == "failed" and data["records"][0]["twin_status"] == "failed"


@interpreter_suite
def test_warming_runs_in_a_spawned_process():
    """The compile-warming pass pickles its jobs into spawned workers (here on the interpreter)."""
    case = shapes.Case("fuzz-w", 2, 12, 16, 17)
    job = {
        "device": "cpu",
        "case": {"name": case.name, "G": 2, "M": 12, "K": 16, "N": 17, "tags": ()},
        "split": "balanced",
        "seed": 1,
        "ops": ["fwd"],
        "fp8": False,
        "recipes": [],
        "dtype": "bfloat16",
    }
    said = []
    result = fuzz.warm([job], 1, said.append)
    assert result["jobs"] == 1 and result["errors"] == [] and said


def test_default_quick_timing():
    args = cli.parse_args(["--fuzz", "5"])
    assert args.fuzz == 5 and args.fuzz_twins == "refused" and args.fuzz_timing == "quick"
    assert args.workers is None and args.fuzz_max_gib == 6.0
    assert timing.TimingConfig.quick().warmup_ms == 10.0


@interpreter_suite
def test_cli_cpu_fp8_fuzz_checks_both_recipes(tmp_path, capsys):
    """--fuzz --fp8 without a GPU: moegemm's rowwise and tensorwise FP8 GEMMs checked against the dequantized
    product under the interpreter, nothing timed."""
    out = tmp_path / "fuzz-fp8.json"
    argv = ["--fuzz", "1", "--fp8", "--ops", "fwd", "--seed", "2", "--device", "cpu", "--out", str(out)]
    assert cli.main(argv) == 0
    assert "correctness PASS: 2/2" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["meta"]["dtype"] == "fp8" and data["meta"]["recipes"] == list(fuzz.FP8_RECIPES)
    assert [(r["op"], r["recipe"]) for r in data["records"]] == [("fwd", "rowwise"), ("fwd", "tensorwise")]
    for r in data["records"]:
        assert r["status"] == "ok" and r["relerr"] <= r["tol"] and r["fast_accum"] and r["moegemm_ms"] is None
