"""The config cost model (moegemm/cost_model.py) and its use in configs.pick_config; no GPU."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from moegemm import shapes
from moegemm._src import configs, cost_model
from moegemm.bench import fit_model

# The cost model's calibration records: the tune runs it was fitted to (its "sources").
RESULTS = Path(__file__).parent.parent / "benchmarks" / "calibration"
# The records the committed model was fitted to (its "sources").
SOURCES = [RESULTS / name for name in json.loads(cost_model.model_path("sm90").read_text())["sources"]]
H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("mean, block", [(128, 128), (384, 64), (4096, 128), (20, 128), (1000, 32)])
def test_expected_blocks_matches_sampled_exponential_rows(mean, block):
    rows = np.random.default_rng(0).exponential(mean, size=400_000)
    sampled = np.ceil(rows / block).mean()
    assert cost_model.expected_blocks(mean, block) == pytest.approx(sampled, rel=0.01)


def test_expected_blocks_limits():
    assert cost_model.expected_blocks(0, 128) == 0.0
    # Many rows per expert: mean / B plus half a tile of waste.
    assert cost_model.expected_blocks(128 * 1000, 128) == pytest.approx(1000.5, abs=0.01)
    # Few rows: one tile per expert.
    assert cost_model.expected_blocks(1, 128) == pytest.approx(1.0, abs=1e-12)


def test_work_counts_by_hand():
    m = configs.MGroupedConfig(128, 256, 64)
    w = cost_model.work("m_grouped", m, G=2, M=1024, N=1000, K=130)
    assert w.steps == 3  # ceil(130 / 64)
    assert w.tiles == pytest.approx(2 * cost_model.expected_blocks(512, 128) * 4)  # 4 column tiles
    assert w.bytes_once == 2 * (1024 * 130 + 2 * 1000 * 130 + 1024 * 1000)
    k = configs.KGroupedConfig(128, 128, 32)
    w = cost_model.work("k_grouped", k, G=4, M=512, N=300, K=256)
    assert w.tiles == 4 * 2 * 3 and w.steps == pytest.approx(cost_model.expected_blocks(128, 32))
    with pytest.raises(ValueError, match="op must be one of"):
        cost_model.work("dense", m, G=1, M=1, N=1, K=1)


def test_committed_model_scores_every_sm90_candidate():
    """A candidate added to the table without refitting would be invisible to the model."""
    model = cost_model.load("sm90")
    assert model is not None and model.sms == 132
    for op in cost_model.OP_KINDS:
        missing = [
            c
            for c in configs.candidates(op, "sm90")
            if cost_model.config_fields(c) not in model.ops[op].per_config
        ]
        assert not missing, f"{op}: refit the model (--fit-model) for {missing}"


def test_model_json_round_trip(tmp_path):
    model = cost_model.load("sm90")
    again = cost_model.Model.from_json(json.loads(json.dumps(model.to_json())))
    assert again == model


def test_model_prediction_is_monotone_in_work():
    model = cost_model.load("sm90")
    cfg = configs.candidates("m_grouped", "sm90")[0]
    small = model.ops["m_grouped"].predict(cfg, G=8, M=8192, N=4096, K=2048, sms=132)
    big = model.ops["m_grouped"].predict(cfg, G=8, M=8192, N=4096, K=8192, sms=132)
    more_sms = model.ops["m_grouped"].predict(cfg, G=8, M=8192, N=4096, K=8192, sms=264)
    assert 0 < small < big and more_sms < big
    uncalibrated = dataclasses.replace(cfg, block_k=32)
    assert model.ops["m_grouped"].predict(uncalibrated, G=8, M=8192, N=4096, K=2048, sms=132) is None


def test_committed_model_picks_near_the_best_on_its_tune_records():
    """The model against the measured candidates it was fitted to (the 24 suite and 33 held-out
    launches, and the wgrad probe's 2 x 19 of 2026-11-25, 81 launches in all): within 5% of the fastest
    on >= 72 of 81 (at fit time: 72, geomean 0.985 of best; the table default: 62, 0.972), and better
    than the default in aggregate."""
    rows = fit_model.evaluate(cost_model.load("sm90"), fit_model.samples(fit_model.load_records(SOURCES)))
    summary = fit_model.summarize(rows)
    assert summary["launches"] == 81
    assert summary["model_within_5pct"] >= 72
    assert summary["model_vs_best_geomean"] > summary["default_vs_best_geomean"]


def test_fit_recovers_the_k_grouped_ranking():
    """Refit the k-grouped half from its tune records (a few seconds): the same picks as the committed
    model's on all 43 wgrad launches (19 tuned, 24 probe sessions), so the committed file is what
    --fit-model makes of its sources."""
    data = [s for s in fit_model.samples(fit_model.load_records(SOURCES)) if s.op == "k_grouped"]
    model = fit_model.fit(data, sms=132)
    residual = [
        math.log(model.ops["k_grouped"].predict(s.config, G=s.G, M=s.M, N=s.N, K=s.K, sms=132) / s.seconds)
        for s in data
    ]
    assert math.sqrt(sum(r * r for r in residual) / len(residual)) < 0.2
    refit = {r["launch"]: r["model_config"] for r in fit_model.evaluate(model, data)}
    committed = {r["launch"]: r["model_config"] for r in fit_model.evaluate(cost_model.load("sm90"), data)}
    assert len(refit) == 43 and refit == committed


def test_pick_config_cache_then_model_then_default(monkeypatch):
    held_out = shapes.get("kimi-k2-ep8-fc1")
    kw = dict(device_name=H100, dtype="bfloat16", G=held_out.G, N=held_out.N, K=held_out.K, M=held_out.M)
    key = configs.cache_key("m_grouped", "bfloat16", held_out.G, held_out.N, held_out.K, held_out.M)
    assert key not in configs.load_cache(H100), "the held-out shapes must stay out of the tuned cache"
    ranked = cost_model.load("sm90").rank(
        "m_grouped",
        configs.candidates("m_grouped", "sm90"),
        G=held_out.G,
        M=held_out.M,
        N=held_out.N,
        K=held_out.K,
    )
    assert configs.pick_config("m_grouped", "sm90", **kw, sms=132) == ranked[0][1]
    # A tuned entry wins over the model.
    forced = configs.candidates("m_grouped", "sm90")[-1]
    monkeypatch.setattr(configs, "load_cache", lambda _name: {key: dataclasses.asdict(forced)})
    assert configs.pick_config("m_grouped", "sm90", **kw, sms=132) == forced
    # No model for the interpreter or the FP8 kernels: the table default.
    assert (
        configs.pick_config("m_grouped", "interpret", **kw) == configs.candidates("m_grouped", "interpret")[0]
    )
    fp8_default = configs.candidates("m_grouped_fp8", "sm90")[0]
    assert configs.pick_config("m_grouped_fp8", "sm90", **{**kw, "dtype": "rowwise-bfloat16"}) == fp8_default


def test_model_changes_picks_where_the_default_was_slow():
    """On the 128-expert wgrad launches (128 rows per expert) the table default (128 x 256, loop per
    tile) measured 12-16% slower than the best; the model, with no cache, picks a two-CTA tile with
    the flat loop, which was the fastest measured there (qwen3-30b-fc1, gptoss-120b-fc1)."""
    for name in ("qwen3-30b-fc1", "gptoss-120b-fc1"):
        case = shapes.get(name)
        pick = configs._model_pick("k_grouped", "sm90", G=case.G, M=case.M, N=case.K, K=case.N, sms=132)
        assert pick.flat and pick.ctas_per_sm == 2 and pick.block_n == 128, (name, pick)
    # Long reductions (1024 rows per expert) take the wide tile in the flat loop with TMA loads, which
    # the wgrad probe measured 1-5% ahead of the loop nest there (docs/design.md, 'TMA loads').
    case = shapes.get("dsv3-ep8-fc1")
    pick = configs._model_pick("k_grouped", "sm90", G=case.G, M=case.M, N=case.K, K=case.N, sms=132)
    assert pick.block_n == 256 and pick.flat and pick.tma_load, pick


def test_heldout_set_is_disjoint_from_the_suite():
    suite = {(c.G, c.K, c.N) for c in shapes.SUITE}
    assert len(shapes.HELDOUT) >= 8
    assert not [c.name for c in shapes.HELDOUT if (c.G, c.K, c.N) in suite]
    assert {shapes.case_set(c.name) for c in shapes.HELDOUT} == {"heldout"}
    assert len({c.G for c in shapes.HELDOUT}) >= 5


def test_cli_eval_model_writes_the_scores(tmp_path, capsys):
    from moegemm.bench import __main__ as cli

    heldout = RESULTS / "tune-heldout-nvidia-h100-2026-11-23.json"
    out = tmp_path / "eval.json"
    assert cli.main(["--eval-model", str(heldout), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["launches"] == 33 and len(result["rows"]) == 33
    assert {r["launch"].split("/")[0] for r in result["rows"]} == {c.name for c in shapes.HELDOUT}
    assert "model_vs_best_geomean" in capsys.readouterr().out


def test_tma_only_configs_stay_with_front_ends_that_have_tma():
    """pick_config(tma=False) (a launch without TMA: the interpreter's JAX executor, no scratch) never picks a
    config measured only through the TMA store or loads, from the cache (dsv3-ep8-fc1's wgrad entry is one)
    or from the model; with tma=True (PyTorch on sm90) they are picked where measured fastest."""
    picked = {True: set(), False: set()}
    for case in shapes.select(["suite", "heldout"]):
        for tma in (True, False):
            kw = dict(device_name=H100, dtype="bfloat16", G=case.G, N=case.K, K=case.N, M=case.M, sms=132)
            picked[tma].add(configs.pick_config("k_grouped", "sm90", tma=tma, **kw))
    assert not picked[False] & configs.TMA_ONLY
    assert picked[True] >= {c for c in configs.TMA_ONLY if isinstance(c, configs.KGroupedConfig)}
    assert set(configs.candidates("k_grouped", "sm90", tma=False)).isdisjoint(configs.TMA_ONLY)


def test_four_stage_forward_tile_only_where_measured(monkeypatch):
    """The 4-stage m-grouped 128 x 256 was measured on forwards with TMA loads (docs/design.md, 'TMA loads'):
    the launcher offers it to a forward launch that loads through TMA (glm45air fwd, where it won 3%, gets
    it), not to the same launch with cp.async, nor to the same sizes with an N-contiguous weight (a dgrad's
    layout, where it lost), nor to JAX (tma=False)."""
    import torch

    from moegemm._src.torch import launch as _launch

    four = configs.MGroupedConfig(128, 256, 64, 8, 8, 4)
    assert four in configs.TMA_ONLY
    monkeypatch.setattr(_launch, "_target", lambda device: _launch.plan.Target("sm90", H100, 132))
    _launch.clear_launch_cache()
    case = shapes.get("glm45air-ep4-fc2")

    def stages(N, K, w_k_contiguous, tma_load):
        spec = (case.M, N, K, case.G, torch.bfloat16, torch.device("cpu"), max(N, K), w_k_contiguous, False)
        return _launch._m_launch(*spec, False, tma_load).meta["num_stages"]

    try:
        assert stages(case.N, case.K, True, True) == 4
        assert stages(case.N, case.K, True, False) == 3
        assert stages(case.N, case.K, False, True) == 3  # the same sizes, the dgrad's weight layout
    finally:
        _launch.clear_launch_cache()
    jax_pick = configs.pick_config(
        "m_grouped", "sm90", device_name=H100, dtype="bfloat16", G=case.G, N=case.N, K=case.K, M=case.M, sms=132,
        tma=False,
    )  # fmt: skip
    assert jax_pick != four


def test_extend_calibrates_only_the_new_config():
    """--extend-model (what added the 4-stage forward tile): the new config's (a, b) fitted on its own
    samples come out as committed, and every other coefficient (the other configs', bw, gamma, c0, p, the
    k-grouped half) is left as the full fit made it, so no other pick moves."""
    import dataclasses

    committed = cost_model.load("sm90")
    payload = json.loads(cost_model.model_path("sm90").read_text())
    (entry,) = payload["extended"]["configs"]
    key = tuple(entry["fields"])
    m = committed.ops["m_grouped"]
    without = dataclasses.replace(m, per_config={k: v for k, v in m.per_config.items() if k != key})
    base = dataclasses.replace(committed, ops={**committed.ops, "m_grouped": without})
    data = fit_model.samples(fit_model.load_records([RESULTS / n for n in payload["extended"]["sources"]]))
    model, added = fit_model.extend(base, data)
    assert added == [("m_grouped", key)]
    assert model.ops["k_grouped"] == committed.ops["k_grouped"]
    got = model.ops["m_grouped"]
    assert (got.bw, got.gamma, got.c0, got.p) == (m.bw, m.gamma, m.c0, m.p)
    assert {k: v for k, v in got.per_config.items() if k != key} == without.per_config
    assert got.per_config[key] == pytest.approx(m.per_config[key], rel=1e-4)
    assert fit_model.extend(committed, data)[1] == []  # nothing left to calibrate


def test_jax_front_end_picks_without_tma(monkeypatch):
    jnp = pytest.importorskip("jax.numpy")
    from moegemm._src.jax import launch as jax_launch

    seen = []
    inner = configs.pick_config
    monkeypatch.setattr(configs, "pick_config", lambda *a, **k: (seen.append(k["tma"]), inner(*a, **k))[1])
    target = jax_launch.Target(name="sm90", device_name=H100, programs=132)
    jax_launch._launch_options("k_grouped", 16384, 2880, 2880, 32, jnp.dtype(jnp.bfloat16), target)
    assert seen == [False]
