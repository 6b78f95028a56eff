"""The FP8 benchmark's checks (moegemm.bench.fp8): the GroupedLinear training step against the fp64 oracle, its
weight re-quantized once per optimizer step, and a peer whose output is wrong recorded failed and never timed."""

import json

import pytest
import torch

from moegemm import shapes
from moegemm._src.torch import ops as _ops
from moegemm.bench import __main__ as cli
from moegemm.bench import fp8, timing

CPU = torch.device("cpu")
interpreter_suite = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test")


def _trainer(recipe, mode, backend="reference", case="tiny-odd", seed=0):
    sizes, gs, batches, w0, b0 = fp8.step_inputs(shapes.get(case), CPU, seed)
    return fp8.StepTrainer(recipe, mode, w0, b0, batches, gs, backend), sizes, w0, b0


@pytest.fixture
def quantize_spy(monkeypatch):
    """Counts the weight quantizes of every GroupedLinear (the library call the FP8 weight cache makes)."""
    calls = []
    real = _ops.quantize_weight_views

    def spy(weight, recipe, backend):
        calls.append(recipe)
        return real(weight, recipe, backend)

    monkeypatch.setattr(_ops, "quantize_weight_views", spy)
    return calls


@pytest.mark.parametrize("mode", fp8.STEP_MODES)
@pytest.mark.parametrize("m", [1, 3])
def test_optimizer_step_requantizes_the_weight_once_per_step(quantize_spy, mode, m):
    """Two optimizer steps of m micro-batches quantize the weight twice: the optimizer's in-place update bumps
    weight._version. Without the optimizer (the old step bench) the count is 1 for any number of steps."""
    trainer, *_ = _trainer("rowwise", mode)
    w_before = trainer.module.weight.detach().clone()
    trainer.step(m)
    trainer.step(m)
    assert len(quantize_spy) == 2
    assert not torch.equal(trainer.module.weight.detach(), w_before)  # the optimizer did update it
    trainer.micro_batch(0)
    trainer.micro_batch(1)
    assert len(quantize_spy) == 3  # micro-batches between optimizer steps reuse the copy


def test_fwd_bwd_without_optimizer_quantizes_once(quantize_spy):
    """The regression the training step fixes: fwd + bwd alone never changes the weight, so it is quantized
    once however many steps run."""
    trainer, *_ = _trainer("tensorwise", "grad")
    for i in range(4):
        trainer.micro_batch(i)
    assert len(quantize_spy) == 1


@pytest.mark.parametrize("recipe", ["bf16", *fp8.RECIPES])
@pytest.mark.parametrize("mode", fp8.STEP_MODES)
def test_check_step_passes_each_recipe_within_its_measured_tolerance(recipe, mode):
    trainer, sizes, w0, b0 = _trainer(recipe, mode)
    c = fp8.check_step(trainer, sizes, w0, b0)
    assert c["status"] == "ok", c["reason"]
    tol = fp8.STEP_TOLERANCE[recipe]
    assert set(c["relerr_parts"]) == {"y", "dx", "dw", "dbias"}
    # Not trivially within: FP8 sits at e4m3's few percent, BF16 at its rounding.
    low = 1e-2 if recipe != "bf16" else 1e-4
    assert low < c["relerr"] <= tol
    assert c["weight_quantizes_per_step"] == (None if recipe == "bf16" else 1.0)


def test_check_step_fails_a_wrong_output_and_a_stale_weight(monkeypatch):
    """A step whose output is off by 10% fails the oracle; a cache that never re-quantizes fails the count."""
    trainer, sizes, w0, b0 = _trainer("rowwise", "grad")
    real_forward = trainer.module.forward
    monkeypatch.setattr(trainer.module, "forward", lambda *a, **k: real_forward(*a, **k) * 1.1)
    c = fp8.check_step(trainer, sizes, w0, b0)
    assert c["status"] == "failed" and "relerr" in c["reason"]  # y and, through it, dx, dW, dbias

    trainer, sizes, w0, b0 = _trainer("rowwise", "grad")
    real_get = fp8.CountingWeightCache.get
    monkeypatch.setattr(fp8.CountingWeightCache, "get", lambda self, *a, **k: real_get(self, *a, reuse=True))
    c = fp8.check_step(trainer, sizes, w0, b0)
    assert c["status"] == "failed" and "quantized 1 times in 2 optimizer steps" in c["reason"]


def test_step_errors_sees_an_unwritten_tail_and_a_wrong_group():
    case = shapes.Case("t", 3, 10, 8, 6)
    sizes = [4, 0, 5]  # one row past sum(sizes)
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(10, 8, generator=g), torch.randn(10, 6, generator=g)
    w, b = torch.randn(3, 6, 8, generator=g), torch.randn(3, 6, generator=g)
    y = torch.zeros(10, 6)
    dx, dw, db = torch.zeros(10, 8), torch.zeros(3, 6, 8), torch.zeros(3, 6)
    s = 0
    for gi, n in enumerate(sizes):
        r = slice(s, s + n)
        y[r], dx[r] = x[r] @ w[gi].T + b[gi], dy[r] @ w[gi]
        dw[gi], db[gi] = dy[r].T @ x[r], dy[r].sum(0)
        s += n
    assert max(fp8.step_errors(y, dx, dw, db, x, w, b, dy, sizes).values()) < 1e-6
    y[9] = 1.0  # the row past sum(sizes) must stay 0
    assert fp8.step_errors(y, dx, dw, db, x, w, b, dy, sizes)["y"] > 1e-2
    dw[2] *= 2
    assert fp8.step_errors(y, dx, dw, db, x, w, b, dy, sizes)["dw"] > 0.5
    del case


def test_grouped_linear_step_times_only_what_passed_and_summarizes_over_seeds(monkeypatch):
    """Timed (paired clock on the CPU stand-in) per (mode, seed, recipe, m); a recipe whose output is wrong is
    recorded failed with no time, and the summary gives median/min/max over the seeds that passed."""
    timed = []
    real = timing.paired_stats

    def spy(fns, *a, **k):
        timed.append(sorted(fns))
        return real(fns, *a, **k)

    monkeypatch.setattr(timing, "paired_stats", spy)
    real_forward = fp8.GroupedLinear.forward

    def forward(self, *a, **k):
        y = real_forward(self, *a, **k)
        return y * 1.5 if self.fp8 is not None and self.fp8.recipe == "tensorwise" else y

    monkeypatch.setattr(fp8.GroupedLinear, "forward", forward)
    bench = fp8.Fp8Bench(CPU, timing.TimingConfig.quick(), check_only=False, backend="reference")
    recs = bench.grouped_linear_step(
        shapes.get("tiny-odd"),
        micro_batches=(1, 2),
        seeds=(0, 1),
        modes=("grad",),
        recipes=("bf16", "tensorwise", "rowwise"),
    )
    assert len(recs) == 2 * 2 * 3
    assert timed == [["bf16", "rowwise"]] * 4  # the wrong recipe is never timed
    for r in recs:
        for key in (
            "impl",
            "recipe",
            "case",
            "seed",
            "micro_batches",
            "ms",
            "device_ms",
            "host_us",
            "relerr",
        ):
            assert key in r
        assert r["tol"] == fp8.STEP_TOLERANCE[r["recipe"]]
        if r["recipe"] == "tensorwise":
            assert r["status"] == "failed" and r["ms"] is None and "relerr" in r["reason"]
        else:
            assert (
                r["status"] == "ok"
                and r["ms"] > 0
                and r["ms_per_micro_batch"] == r["ms"] / r["micro_batches"]
            )
    summary = {(s["recipe"], s["micro_batches"]): s for s in bench.extra["grouped_linear_step_summary"]}
    assert set(summary) == {("bf16", 1), ("bf16", 2), ("rowwise", 1), ("rowwise", 2)}
    s = summary[("rowwise", 2)]
    ms = [r["ms"] for r in recs if r["recipe"] == "rowwise" and r["micro_batches"] == 2]
    assert s["seeds"] == [0, 1] and s["ms"] == {"median": sum(ms) / 2, "min": min(ms), "max": max(ms)}


def test_a_wrong_peer_is_recorded_failed_and_not_timed(monkeypatch):
    """measure_group checks every candidate first: the wrong one is 'failed' with its relerr and is never
    called again; the skipped one is never called; the right ones are timed and ratioed recipe to recipe."""
    case = shapes.Case("t", 2, 16, 16, 16)
    calls = {"good": 0, "torch": 0, "skipped": 0}
    ref = torch.ones(4, 4)

    def counted(name, out):
        def fn():
            calls[name] += 1
            return out

        return fn

    bench = fp8.Fp8Bench(CPU, timing.TimingConfig.quick(), check_only=False)
    good = fp8.Row("t", "fwd", "moegemm-fp8-fast", "rowwise", fast_accum=True, tol=fp8.TOLERANCE)
    wrong = fp8.Row("t", "fwd", fp8.TORCH_PEER, "rowwise", fast_accum=True, tol=fp8.TOLERANCE)
    skipped = fp8.Row("t", "fwd", "other", "blockwise", status="skipped", reason="no such recipe")
    rows = bench.measure_group(
        case,
        {
            "moegemm-fp8-fast": (good, counted("good", ref.clone()), lambda: ref, None),
            fp8.TORCH_PEER: (wrong, counted("torch", ref * 1.1), lambda: ref, None),
            "other": (skipped, counted("skipped", ref), lambda: ref, None),
        },
    )
    assert [r.status for r in rows] == ["ok", "failed", "skipped"]
    assert calls["torch"] == 1 and calls["skipped"] == 0 and calls["good"] > 2  # checked once vs timed
    assert wrong.ms is None and wrong.relerr == pytest.approx(0.1, rel=1e-3) and "relerr" in wrong.reason
    assert good.ms is not None and good.vs_torch is None  # no ratio against a failed peer


def test_torch_peer_recipes_and_skips():
    """torch's peer runs the recipe asked for (rowwise natively, tensorwise with repeated scales) and skips
    blockwise with the reason; a row never has a ratio against another recipe."""
    sizes, gs, x, w, dy = fp8.inputs(shapes.Case("t", 3, 48, 32, 16), CPU)
    for recipe in fp8.RECIPES:
        x_q = fp8.quantize_fp8(x, recipe, group_sizes=gs, transpose=True, backend="reference")
        w_q = fp8.quantize_fp8(w, recipe, transpose=True, backend="reference")
        dy_q = fp8.quantize_fp8(dy, recipe, group_sizes=gs, transpose=True, backend="reference")
        for op in fp8.OPS:
            peer = fp8.scaled_grouped_mm_peer(op, recipe, x_q, w_q, dy_q, sizes)
            assert peer.fast_accum == (op != "wgrad")
            if recipe == "blockwise":
                assert peer.fn is None and "no blockwise" in peer.skip
            else:
                assert peer.skip is None and peer.kernel == fp8.TORCH_RECIPES[recipe]


@interpreter_suite
def test_cli_fp8_cpu_checks_the_training_step_of_every_recipe(tmp_path, capsys):
    """--fp8 --fp8-step-cases without a GPU: every recipe's training step checked under the interpreter
    against the fp64 oracle and its weight quantizes counted; nothing timed."""
    out = tmp_path / "fp8.json"
    argv = ["--fp8", "--cases", "tiny-odd", "--ops", "fwd", "--fp8-recipes", "tensorwise,rowwise,blockwise"]
    assert cli.main([*argv, "--fp8-step-cases", "tiny-odd", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["failed"] == 0 and data["meta"]["performance"] is False
    steps = data["grouped_linear_step"]
    assert {(s["mode"], s["recipe"]) for s in steps} == {
        (m, r) for m in fp8.STEP_MODES for r in ("bf16", *fp8.RECIPES)
    }
    for s in steps:
        assert s["status"] == "ok" and s["ms"] is None and s["seed"] == 0 and s["relerr"] <= s["tol"]
        assert s["weight_quantizes_per_step"] == (None if s["recipe"] == "bf16" else 1.0)
    checked = len(data["rows"]) + len(steps)
    assert f"correctness PASS: {checked}/{checked}" in text
