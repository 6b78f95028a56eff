"""The sharding rules on 2-4 real GPUs, with moegemm's Triton kernels as the local computation.

Each rule of moegemm.jax.sharding / collective_gemm on a mesh built from the GPUs JAX sees: forward
and gradients against the unsharded reference, and the collectives in the compiled HLO. Runs in the
pytest process (no fake devices), so it is skipped unless JAX sees >= 2 GPUs and the Triton path
can run. The same rules on 8 fake CPU devices, with every case's HLO checked in detail:
test_jax_sharding.py. Timings of a sharded MoE layer: benchmarks/sharding_bench.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moegemm.jax as mj
from moegemm._src.jax import gpu as _gpu
from moegemm.jax import collective_gemm, reference
from moegemm.jax import sharding as msh
from moegemm.testing.hlo import COLLECTIVES, collectives_in_hlo


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this jaxlib
        return []


N = min(len(_gpus()), 4)
_TRITON = _gpu.available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(N < 2, reason=f"needs >= 2 GPUs visible to JAX, found {len(_gpus())}"),
    pytest.mark.skipif(_TRITON is not None, reason=f"backend='triton' cannot run here: {_TRITON}"),
]

M, K, N_OUT, G, B = 256, 64, 96, 8, 4
GROUP_SIZES = [40, 0, 25, 51, 2, 37, 61, 19]  # sum 235 < M: an empty group and unowned rows


def rule_table(n: int) -> dict:
    """name: (mesh shape, mesh axes, op, lhs spec, rhs spec, the forward's collectives) on n GPUs."""
    tp = n // 2  # the (fsdp=2, tp) mesh; tp == 1 on 2 or 3 GPUs, where the tp rules need no collective
    ep, fsdp_tp = ("dp", "ep"), ("fsdp", "tp")
    table = {
        "experts_ep/tokens_replicated": ((1, n), ep, "gmm", P(), P("ep"), {"all-reduce"}),
        "experts_ep/tokens_ep": ((1, n), ep, "gmm", P("ep"), P("ep"), {"all-gather", "reduce-scatter"}),
        "tokens_dp": ((n, 1), ep, "gmm", P("dp"), P(), set()),
        "fsdp/tp_n": ((2, tp), fsdp_tp, "gmm", P("fsdp"), P(None, "fsdp", "tp"), {"all-gather"}),
        "tp_k": (
            (2, tp),
            fsdp_tp,
            "gmm",
            P(None, "tp"),
            P(None, "tp", None),
            {"all-reduce"} if tp > 1 else set(),
        ),
        "dense/fsdp/tp_n": ((2, tp), fsdp_tp, "dense", P("fsdp"), P("fsdp", "tp"), {"all-gather"}),
        # lhs M over tp, the weight's K axis: the partitioner moves tp from M to K (all-to-all)
        "dense/sp_m/tp_k": (
            (2, tp),
            fsdp_tp,
            "dense",
            P(None, "tp"),
            P("tp", None),
            {"all-to-all", "reduce-scatter"} if tp > 1 else set(),
        ),
    }
    if n >= 4:
        table["experts_ep/tokens_dp"] = ((n // 2, 2), ep, "gmm", P("dp"), P("ep"), {"all-reduce"})
    return table


RULES = rule_table(max(N, 2))


def max_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / (1 + np.max(np.abs(want))))


@pytest.mark.parametrize("name", list(RULES))
def test_rule_on_gpus(name):
    shape, axes, op, lhs_spec, rhs_spec, expected = RULES[name]
    devices = _gpus()[: int(np.prod(shape))]
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)
    keys = jax.random.split(jax.random.key(0), 2)
    gs = jnp.asarray(GROUP_SIZES, jnp.int32)
    if op == "gmm":
        lhs, rhs = jax.random.normal(keys[0], (M, K)), jax.random.normal(keys[1], (G, K, N_OUT))
        f = lambda a, b: msh.ragged_dot(a, b, gs, backend="triton")
        want_f = lambda a, b: reference.ragged_dot_reference(a, b, gs)
    else:
        lhs, rhs = jax.random.normal(keys[0], (B, M, K)), jax.random.normal(keys[1], (K, N_OUT))
        f = collective_gemm.dense
        want_f = lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))
    a = jax.device_put(lhs, NamedSharding(mesh, lhs_spec))
    b = jax.device_put(rhs, NamedSharding(mesh, rhs_spec))
    fwd, grad = jax.jit(f), jax.jit(jax.grad(loss(f), argnums=(0, 1)))
    got, got_grads = fwd(a, b), grad(a, b)
    want, want_grads = want_f(lhs, rhs), jax.grad(loss(want_f), argnums=(0, 1))(lhs, rhs)
    # fp32 throughout (IEEE fp32 products in the kernels, HIGHEST in the reference).
    assert max_err(got, want) <= 1e-4, "forward"
    for what, g, r in zip(("d lhs", "d rhs"), got_grads, want_grads):
        assert max_err(g, r) <= 1e-4, what
    hlo = fwd.lower(a, b).compile().as_text()
    seen = {c["op"] for c in collectives_in_hlo(hlo)}
    lines = [line.strip()[:300] for line in hlo.splitlines() if any(op in line for op in COLLECTIVES)]
    assert seen == expected, f"mesh {dict(mesh.shape)}: collectives {sorted(seen)}; HLO lines:\n" + "\n".join(
        lines
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("tokens", ["replicated", "dp"])
def test_fp8_rule_on_gpus(recipe, tokens):
    """FP8 through the same rules: EP-sharded experts (tokens replicated or over dp), the FP8 kernels on
    each shard, forward and gradients against the unsharded FP8 op (the same kernels)."""
    n = N if tokens == "replicated" else 2 * (N // 2)
    shape = (1, n) if tokens == "replicated" else (n // 2, 2)
    mesh = jax.make_mesh(shape, ("dp", "ep"), axis_types=(AxisType.Auto,) * 2, devices=_gpus()[:n])
    keys = jax.random.split(jax.random.key(1), 2)
    gs = jnp.asarray(GROUP_SIZES, jnp.int32)
    lhs = jax.random.normal(keys[0], (M, 128)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (G, 128, 128)) / 128**0.5).astype(jnp.bfloat16)
    kw = dict(fp8_recipe=recipe, preferred_element_type=jnp.float32, backend="triton")
    f = lambda a, b: msh.ragged_dot(a, b, gs, **kw)
    want_f = lambda a, b: mj.ragged_dot(a, b, gs, fp8_fprop_fast_accum=False, **kw)
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))
    a = jax.device_put(lhs, NamedSharding(mesh, P() if tokens == "replicated" else P("dp")))
    b = jax.device_put(rhs, NamedSharding(mesh, P("ep")))
    got, got_grads = jax.jit(f)(a, b), jax.jit(jax.grad(loss(f), argnums=(0, 1)))(a, b)
    want, want_grads = want_f(lhs, rhs), jax.grad(loss(want_f), argnums=(0, 1))(lhs, rhs)
    # The same FP8 products; a tensorwise scale reduced over shards equals the unsharded one.
    assert max_err(got, want) <= 1e-3, "forward"
    for what, g, r in zip(("d lhs", "d rhs"), got_grads, want_grads):
        assert max_err(g, r) <= 1e-2, what
