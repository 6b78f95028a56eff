"""FP8 under the partitioning rules (moegemm.jax.sharding.ragged_dot(..., fp8_recipe=...)) on 8 fake CPU devices.

As in test_jax_sharding.py, one subprocess (this file as a script, XLA_FLAGS asking for 8 host
devices) runs every case once and reports: the sharded forward and gradients against the unsharded
FP8 op (moegemm.jax.ragged_dot(..., fp8_recipe=...), the jnp twin), the collectives of the compiled HLO, the
gradient shardings, and XLA's stderr. The local computation is the jnp twin (backend="reference"):
the interpreter's host callbacks cannot run on 8 fake devices at once. 2 GPUs with the Triton
kernels: benchmarks/sharding_bench.py --fp8 (docs/sharding.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

M, K, N, G = 64, 128, 32, 8
GROUP_SIZES = [10, 0, 7, 13, 2, 9, 11, 5]  # sum 57 < M; group 1 empty

# name: (mesh shape, axis names, lhs spec, rhs spec, recipe). Specs as tuples (None = replicated).
CASES = {
    "dp_ep/tensorwise": ((2, 4), ("dp", "ep"), ("dp", None), ("ep", None, None), "tensorwise"),
    "dp_ep/rowwise": ((2, 4), ("dp", "ep"), ("dp", None), ("ep", None, None), "rowwise"),
    "dp_ep/blockwise": ((2, 4), ("dp", "ep"), ("dp", None), ("ep", None, None), "blockwise"),
    "tokens_dp_ep/tensorwise": ((2, 4), ("dp", "ep"), (("dp", "ep"), None), ("ep", None, None), "tensorwise"),
    "fsdp_ep/tensorwise": ((2, 4), ("fsdp", "ep"), ("fsdp", None), ("ep", "fsdp", None), "tensorwise"),
    "fsdp_ep/blockwise": ((2, 4), ("fsdp", "ep"), ("fsdp", None), ("ep", "fsdp", None), "blockwise"),
    "dp_fsdp_ep/tensorwise": (
        (2, 2, 2),
        ("dp", "fsdp", "ep"),
        (("dp", "fsdp"), None),
        ("ep", "fsdp", None),
        "tensorwise",
    ),
    "dp_fsdp_ep/rowwise": (
        (2, 2, 2),
        ("dp", "fsdp", "ep"),
        (("dp", "fsdp"), None),
        ("ep", "fsdp", None),
        "rowwise",
    ),
    # a rowwise scale spans K: a sharded contraction cannot be served
    "error/rowwise_k_sharded": ((2, 4), ("dp", "tp"), (None, "tp"), (None, "tp", None), "rowwise"),
}


# The grouped quantize alone: name -> (mesh shape, axis names, x spec, recipe).
QUANTIZE_CASES = {
    "quantize/dp_fsdp_ep/tensorwise": (
        (2, 2, 2),
        ("dp", "fsdp", "ep"),
        (("dp", "fsdp", "ep"), None),
        "tensorwise",
    ),
    "quantize/dp_ep/rowwise": ((2, 4), ("dp", "ep"), (("dp", "ep"), None), "rowwise"),
    "quantize/dp_ep/blockwise": ((2, 4), ("dp", "ep"), (("dp", "ep"), None), "blockwise"),
    "quantize/error_blockwise_k": ((2, 4), ("dp", "tp"), ("dp", "tp"), "blockwise"),
}


def _run_subprocess() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / "jax_sharding_fp8_report.json"
    with open(root / "jax_sharding_fp8_report.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            path.write_text(json.dumps(_run_subprocess()))
    return json.loads(path.read_text())


NUMERIC = [n for n in CASES if not n.startswith("error")]


@pytest.mark.parametrize("name", NUMERIC)
def test_sharded_fp8_matches_unsharded(report, name):
    case = report[name]
    assert "error" not in case, case.get("error")
    # Tensorwise: the amax is pmax-ed, so every shard casts as the unsharded op does: the same FP8
    # products, summed in another order. Rowwise/blockwise: the wgrad's per-(group, column) and
    # 128-token scales are per token shard, so the weight gradient is another valid quantization.
    assert case["fwd_err"] <= 1e-5, case
    assert case["dlhs_err"] <= 1e-5, case
    assert case["drhs_err"] <= (1e-5 if name.endswith("tensorwise") else 0.05), case
    # and all of it is FP8: against BF16-free math, FP8's error (bounded, so garbage fails)
    assert case["fwd_err_vs_exact"] <= 0.1, case


@pytest.mark.parametrize("name", NUMERIC)
def test_gradient_keeps_the_operand_sharding(report, name):
    """The weight gradient comes back sharded like the weight: the EP axis is never overwritten by
    the FSDP handling (TE's review found that bug), and the input gradient like the input."""
    case = report[name]
    assert case["drhs_spec"] == case["rhs_spec"], case
    assert case["dlhs_spec"] == case["lhs_spec"], case


def _ops(case, which):
    return [c["op"] for c in case[which]]


def test_tensorwise_amax_is_all_reduced_and_others_are_not(report):
    for name in NUMERIC:
        amax = [c for c in report[name]["fwd"] if c["op"] == "all-reduce" and c["max"]]
        if name.endswith("tensorwise"):
            assert amax, f"{name}: no all-reduce max of the amax in {report[name]['fwd']}"
        else:
            assert not amax, f"{name}: {amax}"


def test_pure_ep_gathers_no_weight(report):
    fwd = report["dp_ep/tensorwise"]["fwd"]
    assert "all-gather" not in _ops(report["dp_ep/tensorwise"], "fwd"), fwd
    sums = [c for c in fwd if c["op"] == "all-reduce" and not c["max"]]
    assert [c["shape"] for c in sums] == [[M // 2, N]], fwd  # the output psum over ep, as BF16


def test_fsdp_gathers_the_weight_and_reduce_scatters_its_gradient(report):
    for name in ("fsdp_ep/tensorwise", "fsdp_ep/blockwise", "dp_fsdp_ep/tensorwise"):
        case = report[name]
        gathers = [c["shape"] for c in case["fwd"] if c["op"] == "all-gather"]
        # the all-gather of the weight (its result: K whole again, this shard's experts)
        assert [G // (4 if "dp_fsdp" not in name else 2), K, N] in gathers, (name, case["fwd"])
        assert "reduce-scatter" in _ops(case, "grad"), (name, case["grad"])


def test_unservable_fp8_sharding_names_the_axes(report):
    err = report["error/rowwise_k_sharded"]["error"]
    assert "ShardingRuleError" in err and "rowwise" in err and "'tp'" in err, err


@pytest.mark.parametrize("name", [n for n in QUANTIZE_CASES if "error" not in n])
def test_sharded_quantize_equals_unsharded_bit_for_bit(report, name):
    case = report[name]
    assert "error" not in case, case.get("error")
    assert case["same_data"] and case["same_scale"], case
    assert case["data_spec"] == case["x_spec"], case
    amax = [c for c in case["fwd"] if c["op"] == "all-reduce" and c["max"]]
    if name.endswith("tensorwise"):
        assert [c["shape"] for c in amax] == [[G]], case["fwd"]  # one pmax of the per-group amax
        assert case["scale_spec"] == "()", case  # one scale per group, replicated
    else:
        assert case["fwd"] == [], case["fwd"]  # per-row scales: nothing to communicate


def test_sharded_quantize_blockwise_straddling_k_raises(report):
    err = report["quantize/error_blockwise_k"]["error"]
    assert "ShardingRuleError" in err and "blockwise" in err and "'tp'" in err, err


def test_no_involuntary_rematerialization(report):
    assert not [n for n, c in report.items() if "Involuntary full rematerialization" in c.get("stderr", "")]


# ----------------------------------------------------------------------------------------------
# The subprocess


def _spec(s):
    from jax.sharding import PartitionSpec as P

    return P(*(tuple(e) if isinstance(e, list) else e for e in s))


def _collectives(text: str) -> list[dict]:
    """collectives_in_hlo, each all-reduce marked with whether its reduction is a maximum."""
    import re

    from moegemm.testing.hlo import collectives_in_hlo

    found = collectives_in_hlo(text)
    regions = dict(re.findall(r"\n(%?[\w.\-]+) [^\n]*\{\n((?:[^\n]*\n)*?)\}", text))
    reducers = [m.group(1) for m in re.finditer(r"all-reduce(?:-start)?\([^\n]*to_apply=(%?[\w.\-]+)", text)]
    it = iter(reducers)
    for c in found:
        if c["op"] == "all-reduce":
            body = regions.get(next(it, ""), "")
            c["max"] = "maximum(" in body
    return found


def _run_case(name, data) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding

    import moegemm.jax as mj
    from moegemm.jax import reference
    from moegemm.jax.sharding import ShardingRuleError, ragged_dot

    shape, axes, ls, rs, recipe = CASES[name]
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))
    gs, x, w, dy = data["gs"], data["x"], data["w"], data["dy"]
    f = lambda a, b: ragged_dot(
        a, b, gs, fp8_recipe=recipe, preferred_element_type=jnp.float32, backend="reference"
    )
    want_f = lambda a, b: mj.ragged_dot(
        a, b, gs, fp8_recipe=recipe, preferred_element_type=jnp.float32, backend="reference"
    )
    loss = lambda f: lambda a, b: jnp.vdot(f(a, b), dy)
    a = jax.device_put(x, NamedSharding(mesh, _spec(ls)))
    b = jax.device_put(w, NamedSharding(mesh, _spec(rs)))
    try:
        fwd = jax.jit(f)
        out = fwd(a, b)
        grad = jax.jit(jax.grad(loss(f), argnums=(0, 1)))
        dlhs, drhs = grad(a, b)
    except (ShardingRuleError, jax.errors.JaxRuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    want = want_f(x, w)
    want_dlhs, want_drhs = jax.grad(loss(want_f), argnums=(0, 1))(x, w)
    rel = lambda got, ref: float(
        np.linalg.norm(np.asarray(got) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
    )
    exact = reference.ragged_dot_reference(x, w, gs, out_dtype=jnp.float32)

    norm = _norm

    return {
        "fwd_err": rel(out, want),
        "dlhs_err": rel(dlhs, want_dlhs),
        "drhs_err": rel(drhs, want_drhs),
        "fwd_err_vs_exact": rel(out, exact),
        "fwd": _collectives(fwd.lower(a, b).compile().as_text()),
        "grad": _collectives(grad.lower(a, b).compile().as_text()),
        "lhs_spec": norm(a.sharding.spec),
        "rhs_spec": norm(b.sharding.spec),
        "dlhs_spec": norm(dlhs.sharding.spec),
        "drhs_spec": norm(drhs.sharding.spec),
    }


def _norm(spec) -> str:
    """The spec with trailing replicated dimensions dropped: P("ep") == P("ep", None, None)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return str(tuple(entries))


def _run_quantize_case(name, data) -> dict:
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding

    import moegemm.jax as mj
    from moegemm.jax import sharding

    shape, axes, xs, recipe = QUANTIZE_CASES[name]
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))
    gs, x = data["gs"], data["x"]
    a = jax.device_put(x, NamedSharding(mesh, _spec(xs)))
    f = jax.jit(lambda a: sharding.quantize_fp8(a, recipe, group_sizes=gs, backend="reference"))
    try:
        got = f(a)
    except (sharding.ShardingRuleError, jax.errors.JaxRuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    want = mj.quantize_fp8(x, recipe, group_sizes=gs, backend="reference")
    return {
        "same_data": bool(
            np.array_equal(np.asarray(got.data).view(np.uint8), np.asarray(want.data).view(np.uint8))
        ),
        "same_scale": bool(np.array_equal(np.asarray(got.scale), np.asarray(want.scale))),
        "fwd": _collectives(f.lower(a).compile().as_text()),
        "x_spec": _norm(a.sharding.spec),
        "data_spec": _norm(got.data.sharding.spec),
        "scale_spec": _norm(got.scale.sharding.spec),
    }


def _run_cases() -> dict:
    import tempfile

    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (M, K))
    x = x.at[3, :40].multiply(100.0)  # an outlier row
    data = {
        "gs": jnp.array(GROUP_SIZES, jnp.int32),
        "x": x,
        "w": jax.random.normal(keys[1], (G, K, N)) / K**0.5,
        "dy": jax.random.normal(keys[2], (M, N)),
    }
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in (*CASES, *QUANTIZE_CASES):
            path = os.path.join(tmp, f"{abs(hash(name))}.txt")
            sys.stderr.flush()
            saved = os.dup(2)
            with open(path, "wb") as f:
                os.dup2(f.fileno(), 2)
            try:
                run = _run_quantize_case if name in QUANTIZE_CASES else _run_case
                result[name] = run(name, data)
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
            with open(path, "rb") as f:
                result[name]["stderr"] = f.read().decode(errors="replace")
    return result


if __name__ == "__main__":
    print(json.dumps(_run_cases()))
