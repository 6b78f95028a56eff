"""``python -m moegemm.bench --ep`` without a GPU: gloo ranks spawned on the CPU check every peer against the oracle
and time nothing (moegemm.bench.ep)."""

import json

import pytest
import torch
import torch.distributed as dist

from moegemm.bench import __main__ as cli
from moegemm.bench import ep, harness


def _off_on_rank_1(group, backend):
    """A wrong peer: moegemm's block with rank 1's routing weights 10% high (rank 0 is right), so only the
    gather of every rank's verdict can flag it."""
    block = ep.PEERS["moegemm-c1"].build(group, backend)
    scale = 1.1 if dist.get_rank(group) == 1 else 1.0
    return lambda x, ids, weights, w13, w2: block(x, ids, weights * scale, w13, w2)


def test_cpu_run_checks_every_peer_and_flags_a_wrong_one(tmp_path, capsys):
    from rich.console import Console

    peers = tuple(ep.PEERS[name] for name in ("torchtitan-a2a", "moegemm-c1", "moegemm-c2"))
    peers += (ep.EPPeer("wrong-on-rank-1", "moegemm-c1, rank 1's weights x1.1", _off_on_rank_1),)
    spec = ep.Spec(
        shapes=(ep.SHAPES["tiny-El2-k3"],),
        routings=("skewed",),
        peers=peers,
        backend="reference",
        timeout_s=120,
    )
    out = tmp_path / "ep.json"
    env = harness.Environment.detect(torch.device("cpu"))
    rc = ep.report_run(spec, [2], False, out, env, ["--ep"], Console(width=200))
    text = capsys.readouterr().out
    assert rc == 1 and "wrong-on-rank-1" in text and "FAIL" in text

    data = json.loads(out.read_text())
    assert data["meta"]["performance"] is False and data["meta"]["ep_sizes"] == [2]
    assert data["meta"]["partial"] is False and [p.name for p in tmp_path.iterdir()] == ["ep.json"]
    blocks = {r["impl"]: r for r in data["records"] if r["kind"] == "block"}
    assert set(blocks) == {p.name for p in peers}
    for name in ("torchtitan-a2a", "moegemm-c1", "moegemm-c2"):
        r = blocks[name]
        assert r["status"] == "ok", r
        assert set(r["relerr"]) == {"out", "dx", "dw13", "dw2", "dweights"}
        assert 0 < r["max_relerr"] <= r["tol"] == 2e-2  # checked, against a tolerance that asserts something
    bad = blocks["wrong-on-rank-1"]
    assert bad["status"] == "failed" and "on rank 1" in bad["reason"] and bad["relerr"]["out"] > 2e-2
    assert data["meta"]["failed"] and "wrong-on-rank-1" in data["meta"]["failed"][0]
    # Skewed routing: the ranks' experts receive different row counts, summing to all P*T*k rows.
    r = blocks["moegemm-c1"]
    assert sum(r["rows_per_rank"]) == 2 * r["T"] * r["k"] and len(set(r["rows_per_rank"])) == 2
    # Nothing is timed off CUDA: no time, TF/s, ratio or GB/s anywhere; the collectives ran once.
    for rec in data["records"]:
        assert not {k for k, v in rec.items() if v is not None} & {
            "fwd_ms",
            "step_ms",
            "fwd_tflops",
            "ms",
            "gbps",
        }
    comm = {(r["impl"], r["op"]) for r in data["records"] if r["kind"] == "comm"}
    assert comm == {(i, o) for i in ("moegemm", "torchtitan-a2a") for o in ("dispatch", "combine")}
    assert [r["status"] for r in data["records"] if r["kind"] == "nvlink"] == ["ran (not timed)"]


def test_merge_checks_takes_the_worst_rank():
    ok = {
        "status": "ok",
        "reason": None,
        "relerr": dict.fromkeys(("out", "dx", "dw13", "dw2", "dweights"), 1e-3),
    }
    worse = {**ok, "relerr": {**ok["relerr"], "dw2": 3e-2}}
    assert ep._merge_checks([ok, ok], 2e-2)["status"] == "ok"
    merged = ep._merge_checks([ok, worse], 2e-2)
    assert merged["status"] == "failed" and "dw2" in merged["reason"] and "rank 1" in merged["reason"]
    nan = {**ok, "relerr": {**ok["relerr"], "out": float("nan")}}
    assert ep._merge_checks([nan, ok], 2e-2)["status"] == "failed"
    died = {"status": "failed", "reason": "RuntimeError: boom"}
    assert ep._merge_checks([ok, died], 2e-2) == {"status": "failed", "reason": "rank 1: RuntimeError: boom"}
    gone = {"status": "skipped", "reason": "no API"}
    assert ep._merge_checks([gone, gone], 2e-2)["status"] == "skipped"


def test_flops_and_ratios():
    rec = dict(
        kind="block", shape="s", routing="skewed", ep=4, T=8192, d=2048, n=768, k=8, fwd_ms=2.0, step_ms=6.0
    )
    ep.add_flops(rec)
    fwd = 6 * 8192 * 8 * 2048 * 768
    assert rec["bwd_ms"] == 4.0 and rec["fwd_tflops"] == pytest.approx(fwd / 2e-3 / 1e12)
    assert rec["bwd_tflops"] == pytest.approx(2 * fwd / 4e-3 / 1e12)
    titan = {**rec, "impl": "torchtitan-a2a", "fwd_ms": 3.0, "step_ms": 9.0}
    records = [titan, {**rec, "impl": "moegemm-c1"}]
    ep.add_vs_torchtitan(records)
    assert records[1]["vs_torchtitan"] == 1.5 and records[1]["fwd_vs_torchtitan"] == 1.5
    assert ep._gbps(2e9, 10.0) == pytest.approx(200.0)


def test_cli_wiring():
    args = cli.parse_args(["--ep", "--ep-sizes", "2", "--ep-shapes", "tiny"])
    assert args.ep is True and args.ep_sizes == "2"
    assert [s.name for s in ep.select_shapes(args.ep_shapes, cuda=False)] == ["tiny-E8-k2", "tiny-El2-k3"]
    assert [s.name for s in ep.select_shapes(None, cuda=True)] == ["qwen3-30b-a3b", "deepseek-v3-like"]
    assert ep.SHAPES["deepseek-v3-like"].experts(4) == 32 and ep.SHAPES["qwen3-30b-a3b"].experts(4) == 128
    with pytest.raises(ValueError, match="E=8 experts do not split over an EP group of 3"):
        ep.SHAPES["tiny-E8-k2"].experts(3)
