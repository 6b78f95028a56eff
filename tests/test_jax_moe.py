"""JAX expert block ``moegemm.jax.moe_experts`` and its Flax module: forward and every gradient against an fp64 numpy
oracle (token by token, sharing no code with the op), routing edge cases, bad input, the routing metadata, jax.jit.

One backend-agnostic base class, subclassed per backend: "interpret" runs the fused launches (the GPU path's
KernelCalls) under the Triton interpreter on CPU (a launch counter proves it; outputs start as NaN), "reference" the
jax.numpy twin, "triton" the compiled kernels through the JAX GPU executor (``pytest -m gpu``). Shapes are tiny: the
interpreter is slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moegemm.jax as mj
from moegemm._src.jax import gpu as _gpu
from moegemm._src.jax import interpret as _interpret
from moegemm._src.jax import moe as _moe
from moegemm.testing import oracle
from moegemm.testing.accuracy import relerr

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

F32_TOL = 2e-5  # relative error vs fp64 in fp32: accumulation order only (test_jax.REL_TOL)
# The bf16 block rounds z, h and fc2's rows before its output (each below 2^-9 relative); the interpreter's
# fp32 -> bf16 cast truncates (twice that, one-sided): as test_moe.BF16_BLOCK_TOL on CPU.
BF16_TOL = 2e-2
NAMES = ("out", "dx", "dweights", "dw13", "dw2")


def make(T, d, n, E, k, *, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, d))
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]) if T else np.zeros((0, k))
    weights = rng.random((T, k)) + 0.1
    w13 = rng.standard_normal((E, 2 * n, d)) / max(d, 1) ** 0.5
    w2 = rng.standard_normal((E, d, n)) / max(n, 1) ** 0.5
    return x.astype(dtype), ids.astype(np.int32), weights.astype(dtype), w13.astype(dtype), w2.astype(dtype)


def oracle_grads(x, ids, weights, w13, w2, dout):
    """(out, dx, dweights, dw13, dw2) in fp64, token by token: ids clamped into [0, E), a non-finite weight
    counted as 0 in the forward (its own gradient stays <dout[t], y>, as the kernels compute it)."""
    x, weights, w13, w2, dout = (np.asarray(a, np.float64) for a in (x, weights, w13, w2, dout))
    ids = np.asarray(ids)
    E, two_n, _ = w13.shape
    n = two_n // 2
    out, dx, dweights = np.zeros((x.shape[0], w2.shape[1])), np.zeros_like(x), np.zeros_like(weights)
    dw13, dw2 = np.zeros_like(w13), np.zeros_like(w2)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = min(max(int(ids[t, j]), 0), E - 1)
            s = weights[t, j] if np.isfinite(weights[t, j]) else 0.0
            z = w13[e] @ x[t]
            g, u = z[:n], z[n:]
            sig = 1.0 / (1.0 + np.exp(-g))
            h = g * sig * u
            y = w2[e] @ h
            out[t] += s * y
            dweights[t, j] = dout[t] @ y
            dw2[e] += np.outer(s * dout[t], h)
            dh = w2[e].T @ (s * dout[t])
            dz = np.concatenate([dh * u * sig * (1.0 + g * (1.0 - sig)), dh * g * sig])
            dw13[e] += np.outer(dz, x[t])
            dx[t] += w13[e].T @ dz
    return out, dx, dweights, dw13, dw2


def assert_close(got, want, tol, what):
    got64, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got64.shape == want.shape, f"{what}: shape {got64.shape} != {want.shape}"
    err = relerr(got64, want)
    if not err <= tol:
        diff = np.nan_to_num(np.abs(got64 - want), nan=np.inf)
        idx = np.unravel_index(np.argmax(diff), diff.shape)
        raise AssertionError(
            f"{what}: relerr {err:.3e} > tol {tol:.1e}; worst at {idx}: got {got64[idx]}, want {want[idx]}; "
            f"{int(np.isnan(got64).sum())} NaN elements (interpreter outputs start as NaN)"
        )


def _runs(backend, reason):
    return pytest.mark.skipif(reason is not None, reason=f"backend={backend!r} cannot run here: {reason}")


class MoeExpertsTest:
    BACKEND: str

    @pytest.fixture(autouse=True)
    def _launches(self):
        """The interpreter backend must have launched the fused kernels (not fallen back to the twin)."""
        before = dict(_interpret.CALLS)
        yield
        if self.BACKEND == "interpret" and self.expect_launch:
            launched = {k for k, v in _interpret.CALLS.items() if v > before.get(k, 0)}
            assert {"m_grouped_mm_kernel", "combine_kernel"} <= launched, launched

    expect_launch = True

    def block(self, x, ids, weights, w13, w2, **kw):
        return mj.moe_experts(x, ids, weights, w13, w2, backend=self.BACKEND, **kw)

    def run(self, args, dout, jit=False):
        """(out, dx, dweights, dw13, dw2) of one forward and backward."""
        x, ids, weights, w13, w2 = args

        def f(x, weights, w13, w2):
            out, vjp = jax.vjp(lambda *a: self.block(a[0], ids, *a[1:]), x, weights, w13, w2)
            return out, *vjp(jnp.asarray(dout, out.dtype))

        return (jax.jit(f) if jit else f)(x, weights, w13, w2)

    def check_all(self, args, jit=False, tol=F32_TOL, seed=0):
        dout = np.random.default_rng(seed + 100).standard_normal(args[0].shape).astype(args[0].dtype)
        got = self.run(args, dout, jit)
        want = oracle_grads(*args, dout)
        for name, a, b in zip(NAMES, got, want):
            assert_close(a, b, tol, f"{self.BACKEND} {name}")
        return got

    @pytest.mark.parametrize("jit", [False, True])
    def test_forward_matches_token_by_token_oracle(self, jit):
        """Against the oracle that shares no code (moegemm.testing.oracle), with an empty expert."""
        x, ids, weights, w13, w2 = make(13, 24, 20, 6, 2, seed=1)
        ids[ids == 5] = 4  # expert 5 gets no token
        fn = jax.jit(self.block) if jit else self.block
        out = fn(x, ids, weights, w13, w2)
        assert out.dtype == jnp.float32
        assert_close(out, oracle.moe_experts(x, ids, weights, w13, w2), F32_TOL, "out")

    @pytest.mark.parametrize(
        "case, jit",
        [
            (dict(T=17, d=40, n=24, E=5, k=2), True),  # several tiles along d and n (interpreter tiles: 32)
            (dict(T=9, d=13, n=7, E=4, k=3), False),  # odd (unaligned) dims
            (dict(T=11, d=32, n=16, E=3, k=1), False),  # k = 1
        ],
    )
    def test_gradients_of_every_input(self, case, jit):
        self.check_all(make(**case, seed=2), jit=jit)

    def test_one_hot_expert_and_empty_experts_get_exact_zero_grads(self):
        x, ids, weights, w13, w2 = make(10, 24, 16, 5, 2, seed=3)
        ids[:] = 2  # every choice of every token on expert 2 (duplicates within a token too)
        _, _, _, dw13, dw2 = self.check_all((x, ids, weights, w13, w2))
        for e in (0, 1, 3, 4):
            assert np.array_equal(np.asarray(dw13[e]), np.zeros_like(dw13[e])), f"expert {e}: dw13 must be 0"
            assert np.array_equal(np.asarray(dw2[e]), np.zeros_like(dw2[e])), f"expert {e}: dw2 must be 0"

    def test_duplicate_experts_in_a_token_each_count(self):
        x, ids, weights, w13, w2 = make(6, 16, 8, 4, 3, seed=4)
        ids[:, 1] = ids[:, 0]
        got = self.check_all((x, ids, weights, w13, w2))
        # Two choices of one expert with weights a and b: the same as one choice with a + b.
        merged = weights.copy()
        merged[:, 0] += merged[:, 1]
        merged[:, 1] = 0
        assert_close(self.block(x, ids, merged, w13, w2), got[0], F32_TOL, "duplicate == merged")

    def test_no_tokens(self):
        self.expect_launch = False
        x, ids, weights, w13, w2 = make(0, 16, 8, 4, 2)
        out, dx, dweights, dw13, dw2 = self.run((x, ids, weights, w13, w2), np.zeros((0, 16), np.float32))
        assert out.shape == (0, 16) and dx.shape == (0, 16) and dweights.shape == (0, 2)
        assert not np.asarray(dw13).any() and not np.asarray(dw2).any()
        assert dw13.shape == w13.shape and dw2.shape == w2.shape

    @pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the kernels' inf - inf
    def test_bad_ids_and_weights_are_clamped(self):
        """Out-of-range ids act as the clamped id and non-finite weights as 0, forward and backward: the same
        result as the cleaned input, with no NaN anywhere (nothing read or written out of bounds)."""
        x, ids, weights, w13, w2 = make(8, 16, 8, 4, 2, seed=5)
        ids[0, 0], ids[3, 1] = -7, 99
        weights[2, 0], weights[5, 1], weights[6, 0] = np.nan, np.inf, -np.inf
        clean_ids = np.clip(ids, 0, 3)
        clean_w = np.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
        dout = np.random.default_rng(6).standard_normal(x.shape).astype(np.float32)
        got = self.run((x, ids, weights, w13, w2), dout, jit=True)
        want = self.run((x, clean_ids, clean_w, w13, w2), dout)
        # A non-finite weight is the constant 0, so its gradient is exactly 0 (the clean input's is <dout[t], y>).
        bad = ~np.isfinite(weights)
        for name, a, b in zip(NAMES, got, want):
            assert np.isfinite(np.asarray(a)).all(), f"{name} has non-finite values"
            if name == "dweights":
                assert (np.asarray(a)[bad] == 0).all(), "a non-finite weight's gradient must be 0"
                b = np.where(bad, 0, b)
            assert_close(a, b, F32_TOL, f"clamped {name}")
        assert_close(got[0], oracle.moe_experts(x, ids, weights, w13, w2), F32_TOL, "out vs oracle")

    def test_int64_ids_clamp_before_the_int32_cast(self):
        """Under jax_enable_x64, int64 ids past int32 clamp in int64 (2**32 + 1 -> E - 1, not 1), as the PyTorch
        op clamps them (issue 63)."""
        x, ids, weights, w13, w2 = make(6, 16, 8, 4, 2, seed=8)
        wide = ids.astype(np.int64)
        wide[0, 0], wide[2, 1], wide[4, 0] = 2**32 + 1, -(2**32) + 2, 2**40
        with jax.enable_x64(True):
            got = self.block(x, jnp.asarray(wide), weights, w13, w2)
        assert_close(got, self.block(x, np.clip(wide, 0, 3).astype(np.int32), weights, w13, w2), 0.0, "ids")

    def test_bf16_within_bf16_tolerance(self):
        args = make(16, 48, 32, 4, 2, seed=7)
        bf16 = tuple(a if a.dtype == np.int32 else jnp.asarray(a, jnp.bfloat16) for a in args)
        dout = np.random.default_rng(107).standard_normal((16, 48)).astype(np.float32)
        got = self.run(bf16, jnp.asarray(dout, jnp.bfloat16))
        want = oracle_grads(
            *(np.asarray(a, np.float64) for a in bf16), np.asarray(jnp.asarray(dout, jnp.bfloat16))
        )
        for name, a, b in zip(NAMES, got, want):
            assert a.dtype == (jnp.bfloat16 if name != "dweights" else bf16[2].dtype), name
            assert_close(a, b, BF16_TOL, f"bf16 {name}")


class TestInterpret(MoeExpertsTest):
    BACKEND = "interpret"
    pytestmark = _runs("interpret", _interpret.available())


class TestReference(MoeExpertsTest):
    BACKEND = "reference"


class TestTriton(MoeExpertsTest):
    BACKEND = "triton"
    pytestmark = [pytest.mark.gpu, _runs("triton", _gpu.available())]

    def test_real_sized_block(self):
        """A block with 128-row tiles and several experts' worth of rows: the GPU's tiles, not the interpreter's."""
        self.check_all(make(256, 512, 256, 8, 4, seed=9), jit=True, tol=5e-5)


# ---------------------------------------------------------------- checks, metadata (no backend)


def test_check_raises_naming_the_value():
    x, ids, weights, w13, w2 = make(4, 8, 4, 3, 2)
    bad = ids.copy()
    bad[1, 1] = 3
    with pytest.raises(ValueError, match=r"topk_ids\[1, 1\] = 3 is outside \[0, E=3\)"):
        mj.moe_experts(x, bad, weights, w13, w2, check=True, backend="reference")
    w_bad = weights.copy()
    w_bad[2, 0] = np.nan
    with pytest.raises(ValueError, match=r"topk_weights\[2, 0\] = nan is not finite"):
        mj.moe_experts(x, ids, w_bad, w13, w2, check=True, backend="reference")
    with pytest.raises(ValueError, match="cannot run under jax.jit"):
        jax.jit(lambda i: mj.moe_experts(x, i, weights, w13, w2, check=True, backend="reference"))(ids)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (dict(w13=(3, 7, 8)), "w13"),  # odd 2n
        (dict(w2=(3, 8, 5)), "w2"),  # n mismatch
        (dict(weights=(4, 3)), "topk_weights"),
        (dict(x=(4, 9)), "d=9"),
    ],
)
def test_bad_shapes_name_them(shapes, match):
    x, ids, weights, w13, w2 = make(4, 8, 4, 3, 2)
    arrays = dict(x=x, weights=weights, w13=w13, w2=w2)
    for name, shape in shapes.items():
        arrays[name] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=match):
        mj.moe_experts(arrays["x"], ids, arrays["weights"], arrays["w13"], arrays["w2"], backend="reference")


def test_bad_dtypes_and_options_raise():
    x, ids, weights, w13, w2 = make(4, 8, 4, 3, 2)
    with pytest.raises(TypeError, match="share a dtype"):
        mj.moe_experts(x, ids, weights, w13.astype(np.float16), w2, backend="reference")
    with pytest.raises(ValueError, match="topk_ids must be int32 or int64"):
        mj.moe_experts(x, ids.astype(np.float32), weights, w13, w2, backend="reference")
    with pytest.raises(ValueError, match="activation 'gelu'"):
        mj.moe_experts(x, ids, weights, w13, w2, activation="gelu", backend="reference")
    with pytest.raises(NotImplementedError, match="fp8_recipe='rowwise'"):
        mj.moe_experts(x, ids, weights, w13, w2, fp8_recipe="rowwise", backend="reference")
    with pytest.raises(ValueError, match="backend must be one of"):
        mj.moe_experts(x, ids, weights, w13, w2, backend="cuda")


def test_routing_metadata_example():
    """Routing's docstring example, an empty expert included."""
    r = _moe.routing(jnp.array([[2, 0], [0, 2]]), jnp.ones((2, 2)), 3)
    assert r.gather.tolist() == [0, 1, 0, 1]
    assert r.pos.tolist() == [[2, 0], [1, 3]]
    assert r.group_sizes.tolist() == [2, 0, 2]
    assert r.gather.dtype == r.pos.dtype == r.group_sizes.dtype == jnp.int32


def test_routing_metadata_is_a_permutation_under_jit():
    rng = np.random.default_rng(6)
    ids, weights = rng.integers(0, 7, (50, 3)), rng.random((50, 3)).astype(np.float32)
    r = jax.jit(_moe.routing, static_argnums=2)(ids, weights, 7)
    rows = np.asarray(r.pos).reshape(-1)
    assert sorted(rows.tolist()) == list(range(150))
    np.testing.assert_array_equal(np.asarray(r.gather)[rows], np.arange(150) // 3)  # (t, j)'s row reads t
    np.testing.assert_array_equal(np.asarray(r.row_scale)[rows], weights.reshape(-1))
    np.testing.assert_array_equal(np.asarray(r.group_sizes), np.bincount(ids.reshape(-1), minlength=7))
    expert_of_row = np.repeat(np.arange(7), np.asarray(r.group_sizes))
    np.testing.assert_array_equal(expert_of_row, ids.reshape(-1)[np.argsort(rows)])  # expert-major rows


# ---------------------------------------------------------------- the Flax module

nn = pytest.importorskip("flax.linen", reason="flax is an optional dependency of moegemm.jax")
moe_layer = pytest.importorskip("moegemm.jax.moe_layer")
ScopeParamShapeError = pytest.importorskip("flax.errors").ScopeParamShapeError


def _flax_oracle(params, x, top_k, **router_kw):
    """The module's output from its parameters: the router's choice (applied alone), the fp64 block oracle and
    a numpy shared SwiGLU."""
    E = params["w13"].shape[0]
    router = moe_layer.Router(E, top_k, **router_kw)
    weights, ids, _ = router.apply({"params": params["router"]}, x)
    out = oracle.moe_experts(x, ids, weights, params["w13"], params["w2"])
    if "shared" in params:
        s = {k: np.asarray(v["kernel"], np.float64) for k, v in params["shared"].items()}
        g, u = x @ s["w1"], x @ s["w3"]
        out = out + (g / (1 + np.exp(-g)) * u) @ s["w2"]
    return out, np.asarray(ids)


@pytest.mark.parametrize(
    "backend", ["reference", pytest.param("interpret", marks=_runs("interpret", _interpret.available()))]
)
def test_flax_moe_matches_oracle_and_trains(backend):
    """Group-limited sigmoid routing with route_norm/scale and a shared expert: the output against the oracle,
    the parameter gradients against the reference twin's autodiff, under jax.jit."""
    kw = dict(
        score_func="sigmoid", route_norm=True, route_scale=2.5, num_expert_groups=3, num_limited_groups=2
    )
    x = np.random.default_rng(10).standard_normal((2, 7, 16)).astype(np.float32)
    moe = moe_layer.MoE(8, 6, 3, shared_experts=1, load_balance=None, backend=backend, **kw)
    ref = moe.clone(backend="reference")
    variables = moe.init(jax.random.key(0), x)
    params = variables["params"]
    out = jax.jit(moe.apply)(variables, x)
    want, ids = _flax_oracle(params, x.reshape(-1, 16), 3, **kw)
    assert_close(out.reshape(-1, 16), want, F32_TOL, "flax out")
    groups = ids // 2  # 3 groups of 2 experts: each token's choices lie in at most 2 groups
    assert all(len(set(row)) <= 2 for row in groups.tolist())
    loss = lambda m: jax.jit(jax.grad(lambda p: (m.apply({"params": p}, x) ** 2).sum()))(params)
    got, want_g = loss(moe), loss(ref)
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = jax.tree_util.tree_leaves_with_path(want_g)
        assert_close(a, dict(b)[path], 1e-4, f"grad {jax.tree_util.keystr(path)}")


def test_flax_aux_loss_sown_and_returned():
    x = np.random.default_rng(11).standard_normal((12, 16)).astype(np.float32)
    moe = moe_layer.MoE(8, 4, 2, aux_loss_coef=0.1, backend="reference")
    variables = moe.init(jax.random.key(1), x)
    assert "losses" not in variables
    (out, aux), state = moe.apply(variables, x, return_aux_loss=True, mutable=["losses"])
    assert state["losses"]["aux_loss"] == (aux,)
    # aux = coef * E * sum_e f_e * P_e, from the router's own scores (softmax).
    router = moe_layer.Router(4, 2)
    _, ids, scores = router.apply({"params": variables["params"]["router"]}, x)
    f = np.bincount(np.asarray(ids).reshape(-1), minlength=4) / ids.size
    np.testing.assert_allclose(aux, 0.1 * 4 * (f * np.asarray(scores).mean(0)).sum(), rtol=1e-6)
    g = jax.grad(lambda p: moe.apply({"params": p}, x, return_aux_loss=True)[1])(variables["params"])
    assert np.abs(np.asarray(g["router"]["gate"]["kernel"])).sum() > 0, "P carries the aux loss's gradient"


def test_flax_expert_bias_counts_and_update():
    x = np.random.default_rng(12).standard_normal((10, 16)).astype(np.float32)
    moe = moe_layer.MoE(8, 4, 2, load_balance="bias", backend="reference")
    variables = moe.init(jax.random.key(2), x)
    state = variables["moe_state"]
    assert not np.asarray(state["tokens_per_expert"]).any()
    _, new = moe.apply(variables, x, train=True, mutable=["moe_state"])
    load = np.asarray(new["moe_state"]["tokens_per_expert"])
    assert load.sum() == 20
    updated = moe_layer.update_expert_bias(new["moe_state"], 0.5)
    np.testing.assert_allclose(updated["expert_bias"], 0.5 * np.sign(load.mean() - load))
    assert not np.asarray(updated["tokens_per_expert"]).any()
    nested = moe_layer.update_expert_bias({"layer0": new["moe_state"]}, 0.5)  # a model's collection
    np.testing.assert_allclose(nested["layer0"]["expert_bias"], updated["expert_bias"])
    # The bias selects the experts: a large bias on expert 3 routes every token there.
    biased = {**variables, "moe_state": {**state, "expert_bias": jnp.array([0, 0, 0, 10.0])}}
    _, counted = moe.apply(biased, x, train=True, mutable=["moe_state"])
    assert counted["moe_state"]["tokens_per_expert"][3] == 10


def test_flax_input_of_another_dim_raises():
    """The Flax MoE takes dim from x, so x [4, 32] on parameters built for dim 16 meets flax's parameter shape
    check (the PyTorch MoE needed its own check: issue 63)."""
    moe = moe_layer.MoE(16, 4, 2, backend="reference")
    variables = moe.init(jax.random.key(3), np.zeros((4, 16), np.float32))
    with pytest.raises(ScopeParamShapeError, match=r"\(32, 4\).*\(16, 4\)"):
        moe.apply(variables, np.zeros((4, 32), np.float32))


def test_flax_bad_options_raise():
    with pytest.raises(ValueError, match="load_balance"):
        moe_layer.MoE(8, 4, 2, load_balance="z_loss")
    with pytest.raises(ValueError, match="must divide num_experts"):
        moe_layer.MoE(8, 6, 2, num_expert_groups=4, num_limited_groups=2)
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_layer.Router(4, 5)


def test_public_names_are_declared():
    """As test_jax.test_public_api_is_declared, for the block's modules."""
    import types

    from moegemm.jax import moe

    for module in (moe, moe_layer):
        defined = {
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and not isinstance(value, types.ModuleType)
            and getattr(value, "__module__", "") == module.__name__
        }
        assert defined <= set(module.__all__) <= set(vars(module)), module.__name__
    assert {"moe_experts", "moe_experts_reference"} <= set(mj.__all__)
