"""Partitioning rules of moegemm.jax.sharding and collective_gemm on 8 fake CPU devices.

The planner tests run in-process. The sharded cases need 8 devices, which XLA_FLAGS must ask for
before jax initializes its backend, and other test files in this pytest process may already have
initialized it. So one subprocess (this file run as a script) executes every case once: it
compares forward and gradients with the unsharded reference, reads the collectives out of the
compiled HLO, records each case's stderr (for XLA's 'Involuntary full rematerialization'
warning) and every partition callback whose declared output sharding differs from the one
propagation asked for (the cause of that warning). The tests below assert on its JSON report, one
test per case. Sharding on >= 2 real GPUs with the Triton kernels: test_jax_sharding_gpu.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from functools import partial

import pytest

from moegemm.jax.collective_gemm import _n_axes_to_move_to_m, plan_dense
from moegemm.jax.sharding import ShardingRuleError, plan_k_grouped, plan_m_grouped
from moegemm.jax.sharding._per_shard import shard_group_sizes
from moegemm.testing.hlo import collectives_in_hlo, replica_groups

P = __import__("jax").sharding.PartitionSpec
MESH_DP_EP = ((2, 4), ("dp", "ep"))
MESH_FSDP_TP = ((2, 4), ("fsdp", "tp"))
M, K, N, G, B = 64, 16, 24, 8, 4
GROUP_SIZES = [10, 0, 7, 13, 2, 9, 11, 5]  # sum 57 < M: rows 57.. belong to no group; group 1 empty

# name: (mesh, op, lhs spec, rhs spec, rhs layout). Specs are tuples for JSON; None = replicated.
CASES = {
    # grouped GEMM, mesh (dp=2, ep=4)
    "gmm/tokens_dp": (MESH_DP_EP, "gmm", ("dp", None), (None, None, None), None),
    "gmm/tokens_dp/experts_ep": (MESH_DP_EP, "gmm", ("dp", None), ("ep", None, None), None),
    "gmm/tokens_replicated/experts_ep": (MESH_DP_EP, "gmm", (None, None), ("ep", None, None), None),
    "gmm/tokens_dp_ep/experts_ep": (MESH_DP_EP, "gmm", (("dp", "ep"), None), ("ep", None, None), None),
    # grouped GEMM, mesh (fsdp=2, tp=4)
    "gmm/fsdp/tp_n": (MESH_FSDP_TP, "gmm", ("fsdp", None), (None, "fsdp", "tp"), None),
    "gmm/tp_k": (MESH_FSDP_TP, "gmm", (None, "tp"), (None, "tp", None), None),
    "gmm/fsdp_rows/tp_k": (MESH_FSDP_TP, "gmm", ("fsdp", "tp"), (None, "tp", None), None),
    "gmm/error_k_and_n": (MESH_FSDP_TP, "gmm", (None, None), (None, "tp", "fsdp"), None),
    # dense collective GEMM, lhs [B, M, K], mesh (fsdp=2, tp=4)
    "dense/fsdp/tp_n": (MESH_FSDP_TP, "dense", ("fsdp", None, None), ("fsdp", "tp"), "kn"),
    "dense/tp_k": (MESH_FSDP_TP, "dense", (None, None, "tp"), ("tp", None), "kn"),
    "dense/sp_m/tp_k": (MESH_FSDP_TP, "dense", ("fsdp", "tp", None), ("tp", None), "kn"),
    "dense/sp_m/tp_n_stored_nk": (MESH_FSDP_TP, "dense", (None, "tp", None), ("tp", None), "nk"),
    "dense/error_k_and_n": (MESH_FSDP_TP, "dense", (None, None, None), ("tp", "fsdp"), "kn"),
    # moegemm.jax's ops as the local computation (backend="reference": the Triton interpreter's
    # host callbacks cannot run on 8 fake devices, whose threads all call back into Python at once)
    "gmm/tokens_dp_ep/experts_ep/moegemm": (
        MESH_DP_EP,
        "gmm",
        (("dp", "ep"), None),
        ("ep", None, None),
        None,
    ),
    "gmm/fsdp/tp_n/moegemm": (MESH_FSDP_TP, "gmm", ("fsdp", None), (None, "fsdp", "tp"), None),
    # the same grouped rules inside shard_map
    "shard_map/tokens_dp/experts_ep": (MESH_DP_EP, "shard_map", ("dp", None), ("ep", None, None), None),
    "shard_map/tokens_dp_ep/experts_ep": (
        MESH_DP_EP,
        "shard_map",
        (("dp", "ep"), None),
        ("ep", None, None),
        None,
    ),
    "shard_map/dense/tp_k": (MESH_FSDP_TP, "shard_map_dense", (None, None, "tp"), ("tp", None), "kn"),
    # tokens routed per dp shard: the op sees its block as all the rows (lhs_spec P()), and dp is an
    # independent replica axis; the weight gradient must still be summed over dp
    "shard_map_routed/tokens_dp/experts_ep": (
        MESH_DP_EP,
        "shard_map",
        ("dp", None),
        ("ep", None, None),
        None,
    ),
}


# Cases also run under GSPMD (infer_sharding_from_operands instead of the Shardy sharding_rule).
GSPMD_CASES = ("gmm/tokens_dp_ep/experts_ep", "gmm/fsdp/tp_n", "dense/sp_m/tp_k")

# Cases whose output rows are asked to be sharded over more axes than the tokens (psum_scatter).
OUT_ROWS = {"gmm/fsdp_rows/tp_k": ("fsdp", "tp")}


# ----------------------------------------------------------------------------------------------
# Planner: pure functions of the specs, no devices


def test_plan_tokens_sharded_is_local():
    plan = plan_m_grouped(P("dp", None), P(None, None, None))
    assert (plan.psum, plan.scatter, plan.rhs_gather, plan.row_gather) == ((), (), ((), ()), ())
    assert plan.out == (("dp",), ())


def test_plan_experts_sharded_psums_over_ep():
    plan = plan_m_grouped(P("dp", None), P("ep", None, None))
    assert plan.experts == ("ep",) and plan.psum == ("ep",) and plan.scatter == ()


def test_plan_tokens_on_expert_axis_gathers_and_scatters():
    plan = plan_m_grouped(P(("dp", "ep"), None), P("ep", None, None))
    assert plan.row_gather == ("ep",) and plan.rows == ("dp",) and plan.scatter == ("ep",)
    assert plan.out == (("dp", "ep"), ())


def test_plan_expert_axis_must_be_minor_in_tokens():
    with pytest.raises(ShardingRuleError, match=r"'ep', 'dp'"):
        plan_m_grouped(P(("ep", "dp"), None), P("ep", None, None))


def test_plan_fsdp_gathers_weight_and_reduce_scatters_its_gradient():
    plan = plan_m_grouped(P("fsdp", None), P(None, "fsdp", "tp"))
    assert plan.rhs_gather == (("fsdp",), ()) and plan.out == (("fsdp",), ("tp",)) and not plan.reduces
    grad = plan_k_grouped(P("fsdp", None), P("fsdp", "tp"), P(None, "fsdp", "tp"))
    assert grad.scatter == ((), ("fsdp",), ()) and grad.psum == () and grad.b == (("fsdp",), ("tp",))


def test_plan_contracting_dim_psum_or_psum_scatter():
    assert plan_m_grouped(P(None, "tp"), P(None, "tp", None)).psum == ("tp",)
    assert plan_m_grouped(P("fsdp", "tp"), P(None, "tp", None), out_rows=("fsdp",)).psum == ("tp",)
    plan = plan_m_grouped(P("fsdp", "tp"), P(None, "tp", None), out_rows=("fsdp", "tp"))
    assert plan.psum == () and plan.scatter == ("tp",) and plan.out == (("fsdp", "tp"), ())


def test_plan_lhs_k_follows_rhs_k():
    assert plan_m_grouped(P(None, "a"), P(None, "b", None)).lhs == ((), ("b",))
    assert plan_m_grouped(P(None, "a"), P(None, None, None)).rhs == ((), ("a",), ())  # rhs sliced, no comm


@pytest.mark.parametrize("plan", [plan_m_grouped, lambda lhs, rhs: plan_dense(lhs, rhs, 2, 2)])
def test_plan_rhs_sharded_on_k_and_n_names_the_axes(plan):
    rhs = P(None, "tp", "sp") if plan is plan_m_grouped else P("tp", "sp")
    with pytest.raises(ShardingRuleError, match=r"\('tp',\).*\('sp',\)"):
        plan(P(None, None), rhs)


def test_plan_dense_te_rules():
    # sequence parallel column-parallel: all-gather lhs along M, out sharded on N
    plan = plan_dense(P(None, "tp", None), P(None, "tp"), 3, 2)
    assert plan.lhs == ((), (), ()) and plan.out == ((), (), ("tp",)) and not plan.psum
    # row-parallel: psum if M is not partitioned, psum_scatter along M if it is
    assert plan_dense(P(None, None, "tp"), P("tp", None), 3, 2).psum == ("tp",)
    plan = plan_dense(P(None, "tp", None), P("tp", None), 3, 2)
    assert plan.lhs == ((), (), ("tp",)) and plan.scatter == ("tp",) and plan.out == ((), ("tp",), ())
    # batch kept, FSDP weight gathered, rhs stored [N, K]
    plan = plan_dense(P("fsdp", None, None), P("tp", "fsdp"), 3, 2, "nk")
    assert (
        plan.rhs == (("fsdp",), ("tp",)) and plan.rhs_gather == (("fsdp",), ()) and plan.out[0] == ("fsdp",)
    )


def test_dense_output_axes_moved_from_n_to_m():
    """Sequence parallelism shards out on N over the weight's axis; when propagation asks for that axis
    on M instead, the partition callback moves it (one all-to-all) rather than leaving XLA a reshard."""
    tp, fsdp = ("tp",), ("fsdp",)
    assert _n_axes_to_move_to_m(((), (), tp), ((), tp, ())) == tp
    assert _n_axes_to_move_to_m((fsdp, (), tp), (fsdp, tp, ())) == tp
    assert _n_axes_to_move_to_m((fsdp, fsdp, ("x", "tp")), (fsdp, ("fsdp", "tp"), ("x",))) == tp
    assert _n_axes_to_move_to_m(((), (), tp), ((), (), tp)) == ()  # nothing to move
    assert _n_axes_to_move_to_m(((), (), tp), (fsdp, tp, ())) == ()  # B differs too
    assert _n_axes_to_move_to_m(((), (), ("tp", "x")), ((), tp, ("x",))) == ()  # tp is not N's minor axis
    assert _n_axes_to_move_to_m(((), (), tp), ((), ("x",), ())) == ()  # an axis out of nowhere
    # read backwards for an operand: dout sharded on M where the dgrad's plan wants it on K
    plan = plan_dense(P(None, "tp", None), P("tp", None), 3, 2)
    assert _n_axes_to_move_to_m(plan.lhs, ((), tp, ())) == tp


def test_shard_group_sizes():
    import jax.numpy as jnp

    sizes = jnp.array([3, 0, 4], jnp.int32)
    assert shard_group_sizes(sizes, 4, 4).tolist() == [0, 0, 3]
    assert shard_group_sizes(sizes, 0, 4).tolist() == [3, 0, 1]
    assert shard_group_sizes(jnp.array([8, -2, 5], jnp.int32), 8, 4).tolist() == [0, 0, 4]


def test_explicit_mesh_axes_raise():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from moegemm.jax.sharding import ragged_dot

    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    w = jax.device_put(jnp.ones((2, 4, 3)), NamedSharding(mesh, P("ep")))
    with pytest.raises(ShardingRuleError, match=r"Explicit mesh axes \['ep'\]"):
        jax.jit(lambda x, w: ragged_dot(x, w, jnp.array([1, 1])))(jnp.ones((2, 4)), w)


def test_default_local_ops_are_moegemms(monkeypatch):
    """Without ops=, the sharded op runs moegemm.jax's ops (backend "auto"), not the jnp reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from moegemm.jax import api, reference, sharding

    backends, real = [], api.ragged_dot
    monkeypatch.setattr(api, "ragged_dot", lambda *a, **kw: backends.append(kw["backend"]) or real(*a, **kw))
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.arange(24.0).reshape(6, 4)
    w = jax.device_put(jnp.arange(24.0).reshape(2, 4, 3), NamedSharding(mesh, P("ep")))
    gs = jnp.array([2, 3], jnp.int32)
    out = jax.jit(lambda x, w: sharding.ragged_dot(x, w, gs))(x, w)
    assert backends and set(backends) == {"auto"}
    np.testing.assert_allclose(out, reference.ragged_dot_reference(x, w, gs), rtol=1e-6)


def test_fp8_recipe_and_ops_are_one_choice():
    """fp8_recipe and backend pick moegemm's local ops; with an explicit ops= they raise, naming both.
    Quantized operands raise: the sharded ops quantize on each shard."""
    import jax.numpy as jnp

    from moegemm.jax import quantize_fp8, sharding

    x, w, gs = jnp.ones((6, 4)), jnp.ones((2, 4, 3)), jnp.array([2, 3], jnp.int32)
    with pytest.raises(ValueError, match="either ops='reference' or backend/fp8_recipe"):
        sharding.ragged_dot(x, w, gs, fp8_recipe="rowwise", ops=sharding.REFERENCE_OPS)
    fp8_ops = sharding.moegemm_local_ops("reference", fp8_recipe="rowwise")
    assert fp8_ops.name == "moegemm-fp8-rowwise-reference"
    with pytest.raises(ValueError, match="recipe"):
        sharding.moegemm_local_ops("reference", fp8_recipe="mxfp8")
    x_q = quantize_fp8(x, "rowwise", group_sizes=gs, backend="reference")
    with pytest.raises(TypeError, match="lhs is an Fp8Array, rhs is high precision.*fp8_recipe="):
        sharding.ragged_dot(x_q, w, gs)


def test_collectives_in_hlo_parses_sync_and_async_forms():
    ag = "%a = f32[32,16]{1,0} all-gather(f32[8,16]{1,0} %x), replica_groups=[2,4]<=[8], dimensions={0}"
    rs = "%r = (bf16[8,16]{1,0}, bf16[2,16]{1,0}) reduce-scatter-start(bf16[8,16]{1,0} %y), replica_groups={{0,1,2,3}}"
    assert collectives_in_hlo(f"{ag}\n%n = f32[4]{{0}} negate(f32[4]{{0}} %z)\n{rs}") == [
        {"op": "all-gather", "shape": [32, 16], "group_size": 4, "groups": [[0, 1, 2, 3], [4, 5, 6, 7]]},
        {"op": "reduce-scatter", "shape": [2, 16], "group_size": 4, "groups": [[0, 1, 2, 3]]},
    ]


TP_GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]  # mesh (fsdp=2, tp=4), device = 4 * fsdp + tp: groups over tp
FSDP_GROUPS = [[0, 4], [1, 5], [2, 6], [3, 7]]  # groups over fsdp


@pytest.mark.parametrize(
    "attr, groups",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", TP_GROUPS),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", FSDP_GROUPS),
        # iota: [num_groups, group_size] over iota(8) reshaped to the dims after <= (and transposed)
        ("replica_groups=[2,4]<=[8]", TP_GROUPS),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", FSDP_GROUPS),
        ("replica_groups=[1,8]<=[8]", [list(range(8))]),
        ("replica_groups=[2,4]<=[2,2,2]T(1,0,2)", [[0, 1, 4, 5], [2, 3, 6, 7]]),
        # mesh axes, as jax 0.10 prints them (quoted names, iota device_ids), and as newer XLA does
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", TP_GROUPS),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", FSDP_GROUPS),
        (
            "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=1,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
            TP_GROUPS,
        ),
        ("replica_groups=mesh[fsdp=2,tp=4] {tp}", TP_GROUPS),
        ("replica_groups=mesh[tp=4,fsdp=2], device_ids=([2,4]T(1,0)) {fsdp}", FSDP_GROUPS),
        ("replica_groups=mesh[a=2,b=4] {a,b}", [list(range(8))]),
        ("replica_groups=mesh[a=2,b=4] {b,a}", [[0, 4, 1, 5, 2, 6, 3, 7]]),
        # sub-axis b:(pre)size: the size-long part of b after its major pre
        ("replica_groups=mesh[a=2,b=4] {b:(1)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=mesh[a=2,b=4] {b:(2)2}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("replica_groups=mesh[x=8] {x:(1)2,x:(4)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    ],
)
def test_replica_groups_every_form(attr, groups):
    line = f"%ar = f32[64,24]{{1,0}} all-reduce(f32[64,24]{{1,0}} %p), channel_id=1, {attr}, use_global_device_ids=true"
    assert replica_groups(line) == groups
    (found,) = collectives_in_hlo(line)
    assert found["group_size"] == len(groups[0]) and found["shape"] == [64, 24]


def test_replica_groups_none_when_not_printed():
    assert (
        replica_groups("%ar = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups={}, to_apply=%add") is None
    )
    permute = "%cp = f32[8]{0} collective-permute(f32[8]{0} %p), source_target_pairs={{0,1},{1,0}}"
    assert collectives_in_hlo(permute) == [
        {"op": "collective-permute", "shape": [8], "group_size": None, "groups": None}
    ]


def test_hlo_checker_needs_no_framework():
    """moegemm.testing.hlo imports with neither torch nor jax, and moegemm.testing's torch helpers without jax."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = sys.modules['jax'] = None  # importing either raises from here on\n"
        "import moegemm.testing.hlo\n"
        "del sys.modules['torch']\n"
        "from moegemm.testing import assert_rel_close, linear_loop_reference, relerr, REL_TOL\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# Sharded execution on 8 fake devices (subprocess)


def _run_subprocess() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    return result


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The subprocess's report, computed once per pytest session.

    Under pytest-xdist each worker would start its own subprocess; the workers share the session's
    base temp directory, so the first one runs it and the others wait on a lock and read its JSON.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, shared by the workers
    path = root / "jax_sharding_report.json"
    with open(root / "jax_sharding_report.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            path.write_text(json.dumps(_run_subprocess()))
    return json.loads(path.read_text())


def _check_numerics(case):
    assert case["fwd_err"] <= 1e-4, case
    assert case["grad_err"] <= 1e-4, case


NUMERIC = [n for n in CASES if "error" not in n]


@pytest.mark.parametrize("name", NUMERIC)
def test_sharded_matches_reference(report, name):
    _check_numerics(report["cases"][name])


REMAT = "Involuntary full rematerialization"


def test_no_involuntary_rematerialization(report):
    """XLA's warning, per case: it prints only where a reshard cannot be done efficiently (jax >= 0.11)."""
    warned = {
        f"{group}/{name}": [line for line in case.get("stderr", "").splitlines() if REMAT in line]
        for group in ("cases", "gspmd")
        for name, case in report[group].items()
    }
    assert not {name: lines for name, lines in warned.items() if lines}
    assert REMAT not in report["stderr"], "outside any case"


def test_partition_outputs_are_the_propagated_shardings(report):
    """The cause of that warning, on every jax version: a partition callback that declares an output
    sharding other than the one propagation (Shardy, or GSPMD for report["gspmd"]) asked for leaves
    XLA to reshard its result."""
    assert report["partition_calls"] > 0, "the callbacks were not intercepted: the check checks nothing"
    mismatches = {
        f"{group}/{name}": case["out_mismatch"]
        for group in ("cases", "gspmd")
        for name, case in report[group].items()
        if case.get("out_mismatch")
    }
    assert not mismatches


def test_partition_operands_move_no_axis(report):
    """The same for operands: a callback that demands an operand with a mesh axis on another dimension
    than the incoming sharding leaves XLA an all-to-all reshard (dense/sp_m/tp_n_stored_nk's backward
    did, for dout and the weight gradient). The callbacks move such axes themselves (all_to_all)."""
    moves = {
        f"{group}/{name}": case["operand_moves"]
        for group in ("cases", "gspmd")
        for name, case in report[group].items()
        if case.get("operand_moves")
    }
    assert not moves


def test_moved_axes():
    tp, fsdp = ("tp",), ("fsdp",)
    assert moved_axes(((), tp, ()), ((), (), tp)) == ["tp"]  # M -> K: all-to-all
    assert moved_axes(((), tp, ()), ((), (), ())) == []  # all-gather
    assert moved_axes((fsdp, (), ()), (fsdp, (), tp)) == []  # local slice
    assert moved_axes(((), ("fsdp", "tp")), (fsdp, tp)) == ["fsdp"]


@pytest.mark.parametrize("name", [n for n in CASES if "error" in n])
def test_unservable_sharding_raises_naming_axes(report, name):
    err = report["cases"][name]["error"]
    assert "ShardingRuleError" in err and "'tp'" in err and "'fsdp'" in err, err


def _ops(report, name, which="fwd"):
    return report["cases"][name][which]


def test_hlo_tokens_sharded_is_local(report):
    assert _ops(report, "gmm/tokens_dp") == []
    # backward: the weight gradient is summed over the token shards
    bwd = _ops(report, "gmm/tokens_dp", "grad")
    assert [c["op"] for c in bwd] == ["all-reduce"] and bwd[0]["shape"] == [G, K, N]


# Mesh (dp=2, ep=4) over the fake CPU devices 0..7 in order: device = 4 * dp + ep.
EP_GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_hlo_experts_sharded_psum_over_ep(report):
    for name, rows in (("gmm/tokens_dp/experts_ep", M // 2), ("gmm/tokens_replicated/experts_ep", M)):
        fwd = _ops(report, name)
        assert [c["op"] for c in fwd] == ["all-reduce"], fwd
        assert fwd[0]["shape"] == [rows, N] and fwd[0]["groups"] == EP_GROUPS  # over ep, not dp
    grad = _ops(report, "gmm/tokens_replicated/experts_ep", "grad")
    assert all(c["shape"] != [G, K, N] for c in grad)  # each EP shard owns its experts' gradient


def test_hlo_tokens_on_expert_axis_all_gather_reduce_scatter(report):
    fwd = _ops(report, "gmm/tokens_dp_ep/experts_ep")
    assert sorted(c["op"] for c in fwd) == ["all-gather", "reduce-scatter"], fwd
    assert all(c["groups"] == EP_GROUPS for c in fwd)  # over ep only: tokens are never gathered over dp
    gather = next(c for c in fwd if c["op"] == "all-gather")
    assert gather["shape"] == [M // 2, K]


def test_hlo_fsdp_all_gathers_weight_only(report):
    fwd = _ops(report, "gmm/fsdp/tp_n")
    assert [c["op"] for c in fwd] == ["all-gather"] and fwd[0]["shape"] == [G, K, N // 4], fwd
    grad = _ops(report, "gmm/fsdp/tp_n", "grad")
    scatters = [c for c in grad if c["op"] == "reduce-scatter"]
    assert any(c["shape"] == [G, K // 2, N // 4] for c in scatters), grad  # weight-gradient reduce-scatter
    gathers = [c["shape"] for c in grad if c["op"] == "all-gather"]
    assert not any(shape[0] in (M, M // 2) and shape != [M // 2, K] for shape in gathers)


def test_hlo_contracting_dim_psum_and_psum_scatter(report):
    fwd = _ops(report, "gmm/tp_k")
    assert [c["op"] for c in fwd] == ["all-reduce"] and fwd[0]["shape"] == [M, N]
    fwd = _ops(report, "gmm/fsdp_rows/tp_k")
    assert [c["op"] for c in fwd] == ["reduce-scatter"] and fwd[0]["shape"] == [M // 8, N]


def test_hlo_dense_rules(report):
    fwd = _ops(report, "dense/fsdp/tp_n")
    assert [c["op"] for c in fwd] == ["all-gather"] and fwd[0]["shape"] == [K, N // 4], fwd
    grad = _ops(report, "dense/fsdp/tp_n", "grad")
    assert any(c["op"] == "reduce-scatter" and c["shape"] == [1, K // 2, N // 4] for c in grad), grad
    assert [c["op"] for c in _ops(report, "dense/tp_k")] == ["all-reduce"]
    fwd = _ops(report, "dense/sp_m/tp_k")  # lhs M over tp moves to K (all-to-all), out reduce-scattered
    assert "reduce-scatter" in [c["op"] for c in fwd] and "all-reduce" not in [c["op"] for c in fwd], fwd
    fwd = _ops(report, "dense/sp_m/tp_n_stored_nk")  # all-gather lhs along M, out sharded on N
    assert [c["op"] for c in fwd] == ["all-gather"] and fwd[0]["shape"] == [B, M, K], fwd
    # backward: dout stays sharded on M over tp (as Shardy propagates out): the dgrad moves it to K
    # itself (all-to-all) and the weight gradient contracts the M shards and reduce-scatters N. Before,
    # XLA resharded dout to N for both (jax 0.11.2: "Involuntary full rematerialization").
    grad = _ops(report, "dense/sp_m/tp_n_stored_nk", "grad")
    assert sorted(c["op"] for c in grad) == ["all-gather"] + ["all-to-all"] * 2 + ["reduce-scatter"] * 2, grad
    assert any(c["op"] == "reduce-scatter" and c["shape"] == [1, K, N // 4] for c in grad), grad


def test_moegemm_ops_under_the_rules(report):
    for name in ("gmm/tokens_dp_ep/experts_ep", "gmm/fsdp/tp_n"):
        case = report["cases"][f"{name}/moegemm"]
        assert [c["op"] for c in case["fwd"]] == [c["op"] for c in _ops(report, name)]
        assert [c["op"] for c in case["grad"]] == [c["op"] for c in _ops(report, name, "grad")]


@pytest.mark.parametrize("name", GSPMD_CASES)
def test_gspmd_partitioner_same_rules(report, name):
    case = report["gspmd"][name]
    _check_numerics(case)
    assert sorted(c["op"] for c in case["fwd"]) == sorted(c["op"] for c in _ops(report, name))


def test_shard_map_same_collectives_as_jit(report):
    for name in ("gmm/tokens_dp/experts_ep", "gmm/tokens_dp_ep/experts_ep", "dense/tp_k"):
        ops = lambda n: sorted(c["op"] for c in _ops(report, n))
        assert ops(f"shard_map/{name.removeprefix('gmm/')}") == ops(name)


def test_sharding_bench_cpu_smoke(tmp_path):
    """benchmarks/sharding_bench.py still runs (4 fake CPU devices, tiny shapes) and its moegemm
    variants run the rules' collectives."""
    bench = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "sharding_bench.py")
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run(
        [sys.executable, bench, "--cpu-smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["moe"]}
    assert not [row for row in rows.values() if "error" in row], rows
    assert rows["moegemm, EP=4, tokens replicated"]["fwd_collectives"] == ["all-reduce"]
    assert rows["moegemm, EP=4, tokens sharded over ep"]["fwd_collectives"] == [
        "all-gather",
        "reduce-scatter",
    ]


# ----------------------------------------------------------------------------------------------
# The subprocess


def _case_fns(name, data):
    """(lhs, rhs, f, reference f, output spec) for one CASES entry; f(lhs, rhs) runs under jit."""
    import jax
    import jax.numpy as jnp

    from moegemm.jax import collective_gemm, sharding
    from moegemm.jax import reference as ref
    from moegemm.jax.sharding._plans import spec

    _, op, ls, rs, layout = CASES[name]
    ls, rs, gs = _spec(ls), _spec(rs), data["gs"]
    if op in ("dense", "shard_map_dense"):
        lhs, rhs = data["bx"], data[layout]
        out_spec = lambda: collective_gemm.plan_dense(ls, rs, 3, 2, layout).out
        f = lambda a, b: collective_gemm.dense(a, b, rhs_layout=layout)
        want = lambda a, b: jnp.matmul(a, b if layout == "kn" else b.T, precision=jax.lax.Precision.HIGHEST)
    else:
        lhs, rhs = data["x"], data["w"]
        out_spec = lambda: sharding.plan_m_grouped(ls, rs, OUT_ROWS.get(name, ())).out
        ops = sharding.moegemm_local_ops("reference") if name.endswith("/moegemm") else sharding.REFERENCE_OPS
        f = lambda a, b: sharding.ragged_dot(a, b, gs, ops=ops)
        want = lambda a, b: ref.ragged_dot_reference(a, b, gs)
    # The output sharding the rules produce (error cases: any, the partitioner raises first).
    out = P() if "error" in name else spec(*out_spec())
    if op == "shard_map":
        op_ls = P() if "routed" in name else ls
        inner = lambda a, b: sharding.shard_map_ragged_dot(a, b, gs, lhs_spec=op_ls, rhs_spec=rs)
        f = lambda a, b, mesh: jax.shard_map(inner, mesh=mesh, in_specs=(ls, rs), out_specs=out)(a, b)
    if op == "shard_map_dense":
        inner = lambda a, b: collective_gemm.shard_map_dense(
            a, b, lhs_spec=ls, rhs_spec=rs, rhs_layout=layout
        )
        f = lambda a, b, mesh: jax.shard_map(inner, mesh=mesh, in_specs=(ls, rs), out_specs=out)(a, b)
    if "routed" in name:  # each dp block has its own groups: group_sizes applies per block
        blocks = lambda a: a.reshape(2, -1, a.shape[-1])
        want = lambda a, b: jax.vmap(lambda x: ref.ragged_dot_reference(x, b, gs))(blocks(a)).reshape(
            a.shape[0], -1
        )
        out = ls
    return lhs, rhs, f, want, out


def _spec(s):
    return P(*(tuple(e) if isinstance(e, list) else e for e in s))


def _run_case(name, data) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding

    from moegemm.jax.sharding import ShardingRuleError

    (shape, axes), _, ls, rs, _ = CASES[name]
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))
    lhs, rhs, f, want_f, out_spec = _case_fns(name, data)
    if "shard_map" in name:
        f = partial(f, mesh=mesh)
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))
    a = jax.device_put(lhs, NamedSharding(mesh, _spec(ls)))
    b = jax.device_put(rhs, NamedSharding(mesh, _spec(rs)))
    try:
        # Ask for the output sharding the rules produce, so the HLO shows only the op's collectives.
        fwd = jax.jit(f, out_shardings=NamedSharding(mesh, out_spec))
        out = fwd(a, b)
        grad = jax.jit(jax.grad(loss(f), argnums=(0, 1)))
        grads = grad(a, b)
    except (ShardingRuleError, jax.errors.JaxRuntimeError) as e:
        # The partition callback runs inside XLA's compile, which re-raises its errors.
        return {"error": f"{type(e).__name__}: {e}"}
    want, want_grads = want_f(lhs, rhs), jax.grad(loss(want_f), argnums=(0, 1))(lhs, rhs)
    err = lambda got, ref: float(
        np.max(np.abs(np.asarray(got) - np.asarray(ref))) / (1 + np.max(np.abs(ref)))
    )
    return {
        "fwd_err": err(out, want),
        "grad_err": max(err(g, r) for g, r in zip(grads, want_grads)),
        "fwd": collectives_in_hlo(fwd.lower(a, b).compile().as_text()),
        "grad": collectives_in_hlo(grad.lower(a, b).compile().as_text()),
        "out_spec": str(out.sharding.spec),
    }


@contextlib.contextmanager
def _stderr_into(path):
    """Points fd 2 (where XLA logs) at `path` for the duration, then copies it to the real stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        with open(path, "rb") as f:
            sys.stderr.write(f.read().decode(errors="replace"))


_PARTITION_LOG: dict = {"calls": 0, "mismatch": [], "moved": []}


def moved_axes(have, want) -> list:
    """Mesh axes that shard a different dimension in `want` (one Axes per dimension) than in `have`.

    Dropping an axis is an all-gather and adding one a local slice, both efficient for XLA; an axis
    that changes dimension needs an all-to-all, which XLA may do as a full rematerialization.
    """
    where = lambda dim_axes: {a: i for i, axes in enumerate(dim_axes) for a in axes}
    h, w = where(have), where(want)
    return sorted(a for a in h.keys() & w.keys() if h[a] != w[a])


def _intercept_partitions():
    """Wraps each custom_partitioning op's partition callback (jax reads `.partition` when the op is
    called) to record where its declared output sharding differs from the propagated one, and each
    operand whose sharding it demands moves an axis to another dimension of the incoming one."""
    from jax.sharding import NamedSharding

    from moegemm.jax import collective_gemm
    from moegemm.jax.sharding import _partition as partition
    from moegemm.jax.sharding._plans import dims

    ops = {
        "m_grouped": partition._m_grouped_mm,
        "m_grouped_like": partition._m_grouped_mm_like,
        "k_grouped_like": partition.k_grouped_mm_like,
        "dense": collective_gemm._dense,
    }
    for label, op in ops.items():

        def wrapped(*args, _partition=op.partition, _label=label):
            *_, arg_shapes, result_shape = args
            mesh, lower, declared, arg_shardings = _partition(*args)
            _PARTITION_LOG["calls"] += 1
            wanted, ndim = result_shape.sharding, len(result_shape.shape)
            if isinstance(wanted, NamedSharding) and dims(wanted.spec, ndim) != dims(declared.spec, ndim):
                args_specs = [str(a.sharding.spec) for a in arg_shapes]
                _PARTITION_LOG["mismatch"].append(
                    f"{_label}({', '.join(args_specs)}): propagated {wanted.spec}, declared {declared.spec}"
                )
            for i, (arg, demanded) in enumerate(zip(arg_shapes, arg_shardings)):
                have = dims(arg.sharding.spec, len(arg.shape))
                if moved := moved_axes(have, dims(demanded.spec, len(arg.shape))):
                    _PARTITION_LOG["moved"].append(
                        f"{_label} operand {i}: incoming {arg.sharding.spec}, demanded {demanded.spec} moves {moved}"
                    )
            return mesh, lower, declared, arg_shardings

        op.partition = wrapped


def _run_logged(name, data, tmp) -> dict:
    """_run_case, with the case's stderr and its partition-output mismatches in the result."""
    _PARTITION_LOG["mismatch"], _PARTITION_LOG["moved"] = [], []
    path = os.path.join(tmp, "stderr.txt")
    with _stderr_into(path):
        result = _run_case(name, data)
    with open(path, "rb") as f:
        result["stderr"] = f.read().decode(errors="replace")
    result["out_mismatch"] = list(_PARTITION_LOG["mismatch"])
    result["operand_moves"] = list(_PARTITION_LOG["moved"])
    return result


def _run_cases() -> dict:
    import tempfile

    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 5)
    data = {
        "gs": jnp.array(GROUP_SIZES, jnp.int32),
        "x": jax.random.normal(keys[0], (M, K)),
        "w": jax.random.normal(keys[1], (G, K, N)),
        "bx": jax.random.normal(keys[2], (B, M, K)),
        "kn": jax.random.normal(keys[3], (K, N)),
        "nk": jax.random.normal(keys[4], (N, K)),
    }
    assert jax.config.jax_use_shardy_partitioner, "Shardy is JAX's default partitioner"
    _intercept_partitions()
    with tempfile.TemporaryDirectory() as tmp:
        cases = {name: _run_logged(name, data, tmp) for name in CASES}
        jax.config.update("jax_use_shardy_partitioner", False)  # read at lowering: GSPMD from here on
        gspmd = {name: _run_logged(name, data, tmp) for name in GSPMD_CASES}
    return {
        "devices": len(jax.devices()),
        "cases": cases,
        "gspmd": gspmd,
        "partition_calls": _PARTITION_LOG["calls"],
    }


if __name__ == "__main__":
    print(json.dumps(_run_cases()))
