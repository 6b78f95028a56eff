"""JAX expert parallelism: ``moegemm.jax.moe_experts(..., ep_axis=...)`` under ``jax.shard_map`` against the
single-device block with all E experts on the concatenated tokens, forward and the gradients of x, topk_weights,
w13 and w2 (docs/design.md, 'Expert parallelism'); the local step's ``expert_base`` (routing, the fused block
and the reference twin, Python int and traced); the Flax ``MoE(ep_axis=...)``; no tokens (T = 0); bad
input.

Several devices need XLA host devices, fixed before jax starts: those checks run this file as a child process
(``_worker``) with XLA_FLAGS=--xla_force_host_platform_device_count=P and TRITON_INTERPRET=1, the "interpret"
backend (the fused launches under the Triton interpreter) at P = 2 and 4, the "reference" twin at P = 2, 4, 8.
Shapes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moegemm.testing.accuracy import relerr

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

TOL = 2e-5  # fp32, relative Frobenius: accumulation order only (the psum_scatter adds the partial sums)
NAMES = ("out", "dx", "dweights", "dw13", "dw2")


def make(T, d, n, E, k, *, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, d)).astype(np.float32)
    ids = (np.stack([rng.permutation(E)[:k] for _ in range(T)]) if T else np.zeros((0, k))).astype(np.int32)
    weights = (rng.random((T, k)) + 0.1).astype(np.float32)
    w13 = (rng.standard_normal((E, 2 * n, d)) / d**0.5).astype(np.float32)
    w2 = (rng.standard_normal((E, d, n)) / n**0.5).astype(np.float32)
    return x, ids, weights, w13, w2


def assert_close(got, want, what, tol=TOL):
    assert np.shape(got) == np.shape(want), f"{what}: shape {np.shape(got)} != {np.shape(want)}"
    err = relerr(got, want)
    assert err <= tol, f"{what}: relerr {err:.3e} > {tol:.1e}"


def grads(block, args, dout, jit=False):
    """(out, dx, dweights, dw13, dw2) of ``block(x, ids, weights, w13, w2)`` by jax.vjp."""
    x, ids, weights, w13, w2 = args

    def f(x, weights, w13, w2):
        out, vjp = jax.vjp(lambda x, w, a, b: block(x, ids, w, a, b), x, weights, w13, w2)
        return out, *vjp(jnp.asarray(dout))

    return (jax.jit(f) if jit else f)(x, weights, w13, w2)


# ---------------------------------------------------------------- child process: P XLA host devices


def _cases(E):
    """(name, (T, k), ids edit): an expert with zero tokens (and two ids out of range); one hot expert (every
    token's first choice);
    k = 1 with every token on the last expert (all but one device have no rows)."""

    def no_expert_1(ids):
        ids[ids == 1] = 0  # a token may then choose expert 0 twice: each counts
        ids[0, 0], ids[-1, -1] = E + 5, -3  # out of range: clamped, on every device as on one
        return ids

    def hot(ids):
        ids[:, 0] = E - 1  # the others stay random, so a token may choose E - 1 twice
        return ids

    def all_last(ids):
        ids[:] = E - 1
        return ids

    return [("zero-token expert", 2, no_expert_1), ("hot expert", 2, hot), ("k=1 one device", 1, all_last)]


def _worker(
    P: int, backends: list[str], T_r: int, d: int, n: int, E_local: int, jit: bool, cases: int
) -> None:
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as Spec

    import moegemm.jax as mj
    from moegemm._src.jax import interpret as _interpret

    assert len(jax.devices()) == P, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    E = P * E_local
    for backend in backends:
        for name, k, edit in _cases(E)[:cases]:
            x, ids, weights, w13, w2 = make(P * T_r, d, n, E, k, seed=P + k)
            ids = edit(ids)
            dout = np.random.default_rng(7).standard_normal(x.shape).astype(np.float32)
            single = lambda *a, backend=backend: mj.moe_experts(*a, backend=backend)
            ep = jax.shard_map(
                lambda *a, backend=backend: mj.moe_experts(*a, backend=backend, ep_axis="ep"),
                mesh=mesh,
                in_specs=(Spec("ep"),) * 5,
                out_specs=Spec("ep"),
            )
            want = grads(single, (x, ids, weights, w13, w2), dout, jit=True)
            before = sum(_interpret.CALLS.values())
            got = jax.block_until_ready(grads(ep, (x, ids, weights, w13, w2), dout, jit=jit))
            if backend == "interpret":
                assert sum(_interpret.CALLS.values()) > before, "the interpreter launched nothing"
            for what, a, b in zip(NAMES, got, want):
                assert_close(a, b, f"P={P} {backend} {name}: {what}")
            print(f"ok P={P} {backend} {name}", flush=True)
    if "reference" in backends:
        _flax_worker(mesh, P, E_local)


def _flax_worker(mesh, P: int, E_local: int) -> None:
    """The Flax MoE with ep_axis against the same module without, its w13 and w2 sharded on the expert axis."""
    from jax.sharding import PartitionSpec as Spec

    from moegemm.jax.moe_layer import MoE

    E, d, T_r = P * E_local, 16, 4
    x = jnp.asarray(np.random.default_rng(3).standard_normal((P * T_r, d)), jnp.float32)
    kw = dict(hidden_dim=8, num_experts=E, top_k=2, load_balance=None, shared_experts=1, backend="reference")
    params = MoE(**kw).init(jax.random.PRNGKey(0), x)
    want = MoE(**kw).apply(params, x)
    specs = jax.tree_util.tree_map_with_path(
        lambda path, _: Spec("ep") if path[-1].key in ("w13", "w2") else Spec(), params
    )
    model = MoE(**kw, ep_axis="ep")
    got = jax.shard_map(
        lambda p, x: model.apply(p, x), mesh=mesh, in_specs=(specs, Spec("ep")), out_specs=Spec("ep")
    )(params, x)
    assert_close(got, want, f"P={P} Flax MoE(ep_axis)")
    # Init inside shard_map: each device draws its own experts (not P copies of one shard).
    local = jax.shard_map(
        lambda x: model.init(jax.random.PRNGKey(0), x)["params"]["w13"],
        mesh=mesh,
        in_specs=Spec("ep"),
        out_specs=Spec("ep"),
    )(x)
    assert local.shape == (E, 16, d) and not np.allclose(local[:E_local], local[E_local : 2 * E_local])
    print(f"ok P={P} flax", flush=True)


def _no_tokens_worker(P: int) -> None:
    """T = 0 tokens per device (allowed, as on one device): out [0, d], gradients of x and topk_weights empty,
    of w13 and w2 exact zeros, eager and jitted, on both backends; the Flax MoE(ep_axis) on no tokens."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as Spec

    import moegemm.jax as mj
    from moegemm.jax.moe_layer import MoE

    mesh = Mesh(np.array(jax.devices()), ("ep",))
    x, ids, weights, w13, w2 = make(0, 32, 16, 2 * P, 2)
    for backend in ("interpret", "reference"):
        ep = jax.shard_map(
            lambda *a, backend=backend: mj.moe_experts(*a, backend=backend, ep_axis="ep"),
            mesh=mesh,
            in_specs=(Spec("ep"),) * 5,
            out_specs=Spec("ep"),
        )
        for jit in (False, True):
            got = jax.block_until_ready(grads(ep, (x, ids, weights, w13, w2), np.zeros_like(x), jit=jit))
            for what, a, shape in zip(NAMES, got, (x.shape, x.shape, ids.shape, w13.shape, w2.shape)):
                assert a.shape == shape and a.dtype == np.float32, f"{backend} {what}: {a.dtype} {a.shape}"
            assert not np.asarray(got[3]).any() and not np.asarray(got[4]).any(), f"{backend}: nonzero dw"
            print(f"ok P={P} {backend} jit={jit} T=0", flush=True)
    kw = dict(hidden_dim=8, num_experts=2 * P, top_k=2, load_balance=None, backend="reference")
    params = MoE(**kw).init(jax.random.PRNGKey(0), np.ones((P, 16), np.float32))
    specs = jax.tree_util.tree_map_with_path(
        lambda path, _: Spec("ep") if path[-1].key in ("w13", "w2") else Spec(), params
    )
    model = MoE(**kw, ep_axis="ep")
    out = jax.shard_map(
        lambda p, x: model.apply(p, x), mesh=mesh, in_specs=(specs, Spec("ep")), out_specs=Spec("ep")
    )(params, np.zeros((0, 16), np.float32))
    assert out.shape == (0, 16), out.shape
    print(f"ok P={P} flax T=0", flush=True)


def _spawn(P: int, backends: str, jit: bool, cases: int, T_r: int = 4, E_local: int = 2):
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={P}", TRITON_INTERPRET="1", JAX_PLATFORMS="cpu"
    )
    args = [str(v) for v in (P, backends, T_r, 32, 16, E_local, int(jit), cases)]
    proc = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"worker P={P} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.mark.parametrize(
    "P, backends, jit, cases",
    [(4, "interpret,reference", True, 3), (2, "interpret,reference", True, 2), (8, "reference", True, 2)],
)
def test_ep_matches_single_device(P, backends, jit, cases):
    """Forward and every gradient of the shard_map EP block equal the single-device block's (jitted), on the
    first ``cases`` of ``_cases`` (an expert with no token, a hot expert, k = 1 with rows on one device only).
    Jitted: eager shard_map under the interpreter costs a minute a case (eager EP runs at P = 1 below)."""
    out = _spawn(P, backends, jit, cases)
    assert out.count("ok ") == cases * len(backends.split(",")) + ("reference" in backends), out


def test_ep_with_no_tokens():
    """T = 0 tokens per device under shard_map over P = 2 host devices (issue 63: the all_gather and
    psum_scatter over an empty dimension failed to lower)."""
    out = _spawn(2, "no-tokens", False, 0)
    assert out.count("ok ") == 5, out


# ---------------------------------------------------------------- one device: expert_base and errors


@pytest.mark.parametrize("traced", [False, True])
def test_routing_expert_base_marks_other_experts_absent(traced):
    from moegemm._src.jax import moe as _moe

    ids = jnp.array([[5, 2], [3, 4], [2, 9]], jnp.int32)  # local experts [2, 4): 2 and 3
    weights = jnp.array([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0]], jnp.float32)
    fn = jax.jit(_moe.routing, static_argnums=2) if traced else _moe.routing
    r = fn(ids, weights, 2, jnp.int32(2) if traced else 2)
    assert np.asarray(r.group_sizes).tolist() == [2, 1]
    pos = np.asarray(r.pos)
    assert (pos[[0, 1, 2], [0, 1, 1]] == -1).all()  # experts 5, 4, 9: absent
    assert sorted(pos[[0, 1, 2], [1, 0, 0]].tolist()) == [0, 1, 2]  # the present rows come first
    assert np.asarray(r.row_scale)[:3].tolist() == [0.25, 3.0, 1.0]  # expert 2 (tokens 0, 2), then 3
    assert not np.asarray(r.row_scale)[3:].any()


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_local_steps_sum_to_the_whole_block(backend):
    """The local steps over P = 2 expert ranges (Python-int expert_base) sum to the block with all E experts:
    outputs and dx add up, each range's dw13 and dw2 are its slice, and dweights add (0 where absent)."""
    from moegemm._src.jax import moe as _moe
    from moegemm.jax import api
    from moegemm.jax.reference import moe_experts_reference

    x, ids, weights, w13, w2 = make(9, 32, 16, 4, 2, seed=11)
    ids[:, 0] = 3  # a hot expert; expert 0 gets only the random second choices
    dout = np.random.default_rng(12).standard_normal(x.shape).astype(np.float32)
    executor = api._executor(backend)

    def local(base):
        def block(x, ids, w, a, b):
            if executor is None:
                return moe_experts_reference(
                    x, ids, w, a[base : base + 2], b[base : base + 2], expert_base=base
                )
            return _moe.moe_experts(x, ids, w, a[base : base + 2], b[base : base + 2], base, executor)

        return block

    args = tuple(map(jnp.asarray, (x, ids, weights, w13, w2)))  # the private op takes jax arrays
    whole = grads(lambda *a: moe_experts_reference(*a), args, dout)
    parts = [grads(local(base), args, dout, jit=base == 2) for base in (0, 2)]
    summed = [a + b for a, b in zip(*parts)]  # dw13 and dw2 are of the whole w13 and w2, sliced in the block
    for what, a, b in zip(NAMES, summed, whole):
        assert_close(a, b, f"{backend} local steps: {what}")
    for j, base in enumerate((0, 2)):
        absent = (ids < base) | (ids >= base + 2)
        assert not np.asarray(parts[j][2])[absent].any(), "an absent choice's weight gradient must be 0"
        other = slice(2 - base, 4 - base)  # the other range's experts
        assert not np.asarray(parts[j][3])[other].any() and not np.asarray(parts[j][4])[other].any()


def test_ep_on_one_device_and_bad_input():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as Spec

    import moegemm.jax as mj

    x, ids, weights, w13, w2 = make(5, 32, 16, 3, 2, seed=13)
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))

    def ep(*a, **kw):
        return jax.shard_map(
            lambda *a: mj.moe_experts(*a, backend="interpret", ep_axis="ep", **kw),
            mesh=mesh,
            in_specs=(Spec("ep"),) * 5,
            out_specs=Spec("ep"),
        )(*a)

    want = mj.moe_experts(x, ids, weights, w13, w2, backend="interpret")
    assert_close(ep(x, ids, weights, w13, w2), want, "P=1")
    with pytest.raises(ValueError, match="ep_axis='ep' is not a bound mesh axis"):
        mj.moe_experts(x, ids, weights, w13, w2, backend="reference", ep_axis="ep")
    with pytest.raises(ValueError, match=r"w13 \[E, 2n, d=32\]"):
        ep(x, ids, weights, w13[:, :, :16], w2)
    with pytest.raises(ValueError, match="check=True reads topk_ids"):
        ep(x, ids, weights, w13, w2, check=True)


if __name__ == "__main__":
    P, backends, T_r, d, n, E_local, jit, cases = sys.argv[1:]
    if backends == "no-tokens":
        sys.exit(_no_tokens_worker(int(P)))
    _worker(int(P), backends.split(","), int(T_r), int(d), int(n), int(E_local), bool(int(jit)), int(cases))
