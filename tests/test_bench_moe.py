"""The expert-block benchmark (moegemm.bench.moe) on CPU: the --moe run end to end on a tiny shape, the FLOP
count, the routing generator and the correctness gate."""

from __future__ import annotations

import json

import pytest
import torch

from moegemm.bench import __main__ as cli
from moegemm.bench import moe, timing


def test_cpu_run_end_to_end(tmp_path):
    """--moe without CUDA: every local impl checked (out and four gradients) on a tiny shape, Liger skipped with
    its reason, nothing timed, the JSON written with the run's meta."""
    out = tmp_path / "moe.json"
    argv = ["--moe", "--moe-shapes", "tiny-E4-k2", "--moe-routing", "balanced,hot", "--out", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["mode"] == "correctness" and data["meta"]["benchmark"] == "moe"
    assert data["meta"]["failed"] == []
    records = data["records"]
    assert (
        data["meta"]["seeds"] == [0] and data["meta"]["commit"] is None or len(data["meta"]["commit"]) == 40
    )
    assert {(r["routing"], r["impl"]) for r in records} == {
        (routing, impl)
        for routing in ("balanced", "hot")
        for impl in ("moegemm", "moegemm-unfused", "torch-grouped-mm", "liger", "sonicmoe", "sonicmoe-concat")
    }
    for r in records:
        if r["impl"] in ("liger", "sonicmoe", "sonicmoe-concat"):
            assert r["status"] == "skipped" and r["reason"], r
            continue
        assert r["status"] == "ok", r
        assert set(r["relerr"]) == set(moe.GRADS) and r["max_relerr"] <= r["tol"]
        assert r.get("step_ms") is None and r.get("host_syncs") is None
        assert r["oracle"] == "float64"
    hot = next(r for r in records if r["routing"] == "hot")
    assert hot["load"]["max_rows"] > 1.5 * hot["load"]["mean_rows"]  # expert 0 in nearly every token


def test_paired_clock_fills_the_headline(monkeypatch):
    """run_cases times the ok in-process implementations of a (shape, routing, seed) taking turns: their fwd and
    step ms come from timing.paired_stats (here its CPU form), with quartiles and reps; a failed one gets none; each
    seed gets its own records."""
    calls = []

    def fake_measure(impl, shape, routing, inp, ref, *, tcfg, check_only, keep):
        rec = {**moe._base(shape, routing, impl.name), "status": "ok" if impl.name != "bad" else "failed"}
        if keep is not None and rec["status"] == "ok":
            keep[impl.name] = (
                lambda n=impl.name: calls.append(("fwd", n)),
                lambda n=impl.name: calls.append(("step", n)),
            )
        return rec

    monkeypatch.setattr(moe, "measure", fake_measure)
    impls = [moe.MoEImpl(name, None) for name in ("a", "b", "bad")]
    records = moe.run_cases(
        [moe.SHAPES["tiny-E4-k2"]],
        ["balanced"],
        impls,
        torch.device("cpu"),
        dtype=torch.float32,
        seeds=(0, 1),
        tcfg=timing.TimingConfig(cpu_reps=2),
        check_only=False,
        paired=True,
    )
    assert [(r["impl"], r["seed"]) for r in records] == [(n, s) for s in (0, 1) for n in ("a", "b", "bad")]
    for r in records:
        if r["impl"] == "bad":
            assert "fwd_ms" not in r and "step_ms" not in r
            continue
        assert r["fwd_ms"] > 0 and r["step_ms"] > 0 and r["fwd_reps"] == 2 and r["fwd_q25"] <= r["fwd_q75"]
        assert r["step_tflops"] == pytest.approx(3 * r["fwd_flops"] / r["step_ms"] / 1e9)
    # Taking turns: a, b, a, b for the forward (one round to size the reps, then 2 reps), then the step, per seed.
    assert calls[:12] == [("fwd", "a"), ("fwd", "b")] * 3 + [("step", "a"), ("step", "b")] * 3
    assert len(calls) == 24


def test_flops():
    """fc1 is [T*k, d] x [d, 2n] and fc2 [T*k, n] x [n, d], 2 FLOPs per multiply-add; the backward is two GEMMs
    per forward GEMM."""
    T, d, n, k = 32768, 4096, 1024, 4
    fc1, fc2 = 2 * T * k * d * (2 * n), 2 * T * k * n * d
    assert moe.fwd_flops(T, d, n, k) == fc1 + fc2 == 6 * T * k * d * n
    assert moe.step_flops(T, d, n, k) == 3 * (fc1 + fc2)
    assert moe.SHAPES["sonic-n1024-E64-k4"].fwd_flops == fc1 + fc2
    # The anchors: 12.19 ms fwd at this shape is 271 TF/s.
    assert moe.fwd_flops(T, d, n, k) / 12.19 / 1e9 == pytest.approx(271, abs=1)
    # SonicMoE's published fwd 550 / bwd 555 TF/s: a fwd+bwd of F + 2F FLOPs at those rates.
    rec = moe.published_record(moe.SHAPES["sonic-n1024-E64-k4"], "skewed")
    assert rec["status"] == "published"
    assert rec["step_tflops"] == pytest.approx(3 / (1 / 550 + 2 / 555))


@pytest.mark.parametrize(("T", "E", "k"), [(4096, 64, 4), (48, 4, 2), (40, 8, 3), (33, 3, 1), (37, 5, 5)])
def test_balanced_counts_exact(T, E, k):
    ids, weights = moe.route(T, E, k, "balanced", seed=3)
    counts = moe.expert_counts(ids, E)
    assert counts.sum() == T * k
    assert int(counts.max() - counts.min()) == (0 if T * k % E == 0 else 1)
    assert all(len(set(row)) == k for row in ids.tolist())  # a token's experts are distinct
    assert ids.dtype == torch.int32 and torch.allclose(weights.sum(1), torch.ones(T))


def test_skewed_counts_ordered():
    """The linear logit ramp: expert load rises with the expert index (quartile means strictly ordered), mildly."""
    E = 32
    ids, weights = moe.route(8192, E, 4, "skewed", seed=0)
    counts = moe.expert_counts(ids, E).double()
    quartiles = counts.view(4, E // 4).mean(1)
    assert (quartiles.diff() > 0).all(), quartiles
    assert 1.5 < quartiles[-1] / quartiles[0] < 10
    assert torch.allclose(weights.sum(1), torch.ones(8192))
    # The same seed draws the same routing; another seed another.
    assert torch.equal(moe.route(8192, E, 4, "skewed", seed=0)[0], ids)
    assert not torch.equal(moe.route(8192, E, 4, "skewed", seed=1)[0], ids)


def test_hot_expert():
    ids, _ = moe.route(4096, 64, 4, "hot", seed=0)
    assert (ids == 0).any(1).float().mean() > 0.9


def test_oracle_chunks_agree(monkeypatch):
    """The token-chunked oracle (weight gradients summed over chunks) equals one pass."""
    inp = moe.make_inputs(moe.SHAPES["tiny-E8-k3"], "skewed", 0, torch.device("cpu"), torch.bfloat16)
    whole = moe.oracle(inp, torch.float64)
    monkeypatch.setattr(moe, "ORACLE_ROWS", 16)
    chunked = moe.oracle(inp, torch.float64)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _wrong_router_grad(x, ids, weights, w13, w2):
    """Right output, but topk_weights gets a zero gradient (its value used, its graph cut)."""
    return moe._torch_grouped_mm()(x, ids, weights.detach() + 0 * weights, w13, w2)


def _wrong_activation(x, ids, weights, w13, w2):
    """GELU in place of SiLU on the gate: close in value, wrong in every output."""
    n = w2.shape[2]
    rows = x.float().repeat_interleave(ids.shape[1], 0)
    h = torch.einsum("rd,rnd->rn", rows, w13.float()[ids.reshape(-1).long()])
    a = torch.nn.functional.gelu(h[:, :n]) * h[:, n:]
    y = torch.einsum("rn,rdn->rd", a, w2.float()[ids.reshape(-1).long()]) * weights.float().reshape(-1, 1)
    return y.view(*ids.shape, -1).sum(1).to(x.dtype)


@pytest.mark.parametrize(("block", "caught"), [(_wrong_router_grad, "dweights"), (_wrong_activation, "out")])
def test_gate_catches_a_wrong_impl(block, caught):
    shape = moe.SHAPES["tiny-E4-k2"]
    inp = moe.make_inputs(shape, "balanced", 0, torch.device("cpu"), torch.bfloat16)
    ref = moe.oracle(inp, torch.float64)
    impl = moe.MoEImpl("wrong", lambda: block)
    rec = moe.measure(impl, shape, "balanced", inp, ref, tcfg=timing.TimingConfig(), check_only=False)
    assert rec["status"] == "failed" and caught in rec["reason"], rec
    assert rec.get("step_ms") is None  # failed: not timed
    good = moe.MoEImpl("right", moe._torch_grouped_mm)
    assert (
        moe.measure(good, shape, "balanced", inp, ref, tcfg=timing.TimingConfig(), check_only=True)["status"]
        == "ok"
    )


# ---------------------------------------------------------------- the JAX op (moegemm-jax)


def test_jax_default_run_skewed_only(tmp_path, monkeypatch):
    """The default CUDA peers include moegemm-jax, the CPU ones do not. Made a default peer here: it runs in its
    child process under the Triton interpreter ("interpret" backend), on the skewed routing only (balanced is a
    skipped record naming why), passes the same gate, and is not timed; jax_vs_torch is None without timings."""
    assert "moegemm-jax" in moe.default_peers(True) and "moegemm-jax" not in moe.default_peers(False)
    monkeypatch.setattr(moe, "default_peers", lambda cuda: ("moegemm", "moegemm-jax"))
    out = tmp_path / "moe.json"
    argv = ["--moe", "--moe-shapes", "tiny-E3-k1", "--moe-routing", "balanced,skewed", "--out", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["failed"] == [] and "peak_gib" in data["meta"]["jax"]
    jax_recs = {r["routing"]: r for r in data["records"] if r["impl"] == "moegemm-jax"}
    assert jax_recs["balanced"]["status"] == "skipped" and "skewed" in jax_recs["balanced"]["reason"]
    ok = jax_recs["skewed"]
    assert ok["status"] == "ok", ok
    assert ok["backend"] == "interpret" and set(ok["relerr"]) == set(moe.GRADS)
    assert ok["max_relerr"] <= ok["tol"]
    assert ok["host_syncs"] is None and "XLA" in ok["host_syncs_note"]
    assert ok.get("step_ms") is None and ok["jax_vs_torch"] is None
    # The same kernels as the torch op on the same inputs: the same errors.
    torch_rec = next(r for r in data["records"] if r["impl"] == "moegemm" and r["routing"] == "skewed")
    for g in moe.GRADS:
        assert ok["relerr"][g] == pytest.approx(torch_rec["relerr"][g], rel=0.05, abs=1e-4)


def test_jax_skipped_without_jax(tmp_path, monkeypatch):
    """No jax: every moegemm-jax record is skipped with the reason, and the run still passes."""
    import sys

    monkeypatch.setitem(sys.modules, "jax", None)
    out = tmp_path / "moe.json"
    argv = ["--moe", "--moe-shapes", "tiny-E4-k2", "--moe-routing", "skewed", "--moe-peers", "moegemm-jax"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["status"] == "skipped" and "jax does not import" in rec["reason"], rec


def test_jax_skipped_without_gpu_backend(monkeypatch):
    """CUDA for torch but no GPU for JAX: Unavailable, naming which."""
    import jax

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(moe.Unavailable, match="no GPU backend"):
        moe._moegemm_jax()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(moe.Unavailable, match="'triton' cannot run"):
        moe._moegemm_jax()


def test_jax_vs_torch():
    """The ratio of device times against the torch op's record of the same shape and routing."""

    def rec(impl, routing, fwd, step, status="ok"):
        return {"shape": "s", "routing": routing, "impl": impl, "status": status}, {
            "fwd_device_ms": fwd,
            "step_device_ms": step,
        }

    records = [
        {**a, **b}
        for a, b in (
            rec("moegemm", "skewed", 2.0, 8.0),
            rec("moegemm-jax", "skewed", 2.1, 7.6),
            rec("moegemm-jax", "balanced", 1.0, 3.0),  # no torch record: no ratio
            rec("moegemm-jax", "hot", 1.0, 3.0, status="failed"),
        )
    ]
    moe.add_jax_vs_torch(records)
    assert records[1]["jax_vs_torch"] == pytest.approx({"fwd": 1.05, "step": 0.95})
    assert records[2]["jax_vs_torch"] is None and "jax_vs_torch" not in records[3]
    assert "jax_vs_torch" not in records[0]


def test_jax_peak():
    """XLA's peak cannot be reset: a step that raises it is measured above the bytes in use before it; one that
    does not gives None and the reason, as does a backend without statistics."""
    GiB = 2**30
    before = {"bytes_in_use": 1 * GiB, "peak_bytes_in_use": 2 * GiB}
    assert moe._jax_peak(before, {"bytes_in_use": GiB, "peak_bytes_in_use": 5 * GiB})[0] == 4 * GiB
    peak, reason = moe._jax_peak(before, {"bytes_in_use": GiB, "peak_bytes_in_use": 2 * GiB})
    assert peak is None and "earlier" in reason
    assert moe._jax_peak(None, None)[0] is None
