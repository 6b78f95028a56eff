"""Flax integration: the ragged_dot injection point and GroupedDense, against an fp64 oracle and
jax.lax.ragged_dot, on every backend that runs the kernels here ("triton" on a GPU, marked ``gpu``;
"interpret" on CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moegemm._src.jax import gpu as _gpu
from moegemm._src.jax import interpret as _interpret
from moegemm.testing import oracle

nn = pytest.importorskip("flax.linen", reason="flax is an optional dependency of moegemm.jax")
mflax = pytest.importorskip("moegemm.jax.flax")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

F32_TOL = 2e-5  # relative error vs fp64: fp32 accumulation order (as test_jax.REL_TOL)


def _runs(backend, reason):
    return pytest.mark.skipif(reason is not None, reason=f"backend={backend!r} cannot run here: {reason}")


@pytest.fixture(
    params=[
        pytest.param("triton", marks=[pytest.mark.gpu, _runs("triton", _gpu.available())]),
        pytest.param("interpret", marks=_runs("interpret", _interpret.available())),
    ]
)
def backend(request) -> str:
    return request.param


def relerr(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def gelu_tanh(x):
    """jax.nn.gelu(approximate=True) in fp64."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


class Experts(nn.Module):
    """A MoE expert MLP written against jax.lax.ragged_dot, with the GEMM injectable."""

    hidden: int
    num_experts: int
    ragged_dot_cls: object = lambda: None

    @nn.compact
    def __call__(self, x, group_sizes):
        h = mflax.GroupedDense(self.num_experts, self.hidden, ragged_dot_cls=self.ragged_dot_cls, name="fc1")(
            x, group_sizes
        )
        return mflax.GroupedDense(
            self.num_experts, x.shape[-1], ragged_dot_cls=self.ragged_dot_cls, name="fc2"
        )(jax.nn.gelu(h), group_sizes)


def test_grouped_dense_swaps_in_for_lax_ragged_dot(backend):
    M, K, G = 26, 16, 3
    x = jnp.asarray(np.random.default_rng(0).standard_normal((M, K)), jnp.float32)
    sizes = jnp.asarray([9, 0, 14], jnp.int32)  # an empty expert and 3 unowned rows
    baseline = Experts(hidden=24, num_experts=G)
    ours = Experts(hidden=24, num_experts=G, ragged_dot_cls=mflax.make_ragged_dot_cls(backend=backend))
    params = baseline.init(jax.random.key(0), x, sizes)
    assert params["params"]["fc1"]["kernel"].shape == (G, K, 24)

    def loss(module):
        return lambda p: jnp.sum(module.apply(p, x, sizes) ** 2)

    before = _interpret.CALLS.total()
    # jax.lax.ragged_dot's default precision is TF32-like on GPU: the baseline runs at HIGHEST.
    with jax.default_matmul_precision("highest"):
        want, want_grads = jax.value_and_grad(loss(baseline))(params)
    got, got_grads = jax.jit(jax.value_and_grad(loss(ours)))(params)
    if backend == "interpret":
        assert _interpret.CALLS.total() > before, "the injected ragged_dot did not reach the kernels"
    # Both losses against the fp64 oracle of the same MLP.
    kernels = [np.asarray(params["params"][fc]["kernel"], np.float64) for fc in ("fc1", "fc2")]
    h = gelu_tanh(oracle.m_grouped_mm(x, kernels[0], sizes.tolist()))
    exact = float(np.sum(oracle.m_grouped_mm(h, kernels[1], sizes.tolist()) ** 2))
    for what, value in (("moegemm", got), ("jax.lax.ragged_dot (HIGHEST)", want)):
        assert abs(float(value) - exact) <= F32_TOL * exact, f"{what} loss {float(value)} vs fp64 {exact}"
    for path, g in jax.tree_util.tree_leaves_with_path(got_grads):
        w = dict(jax.tree_util.tree_leaves_with_path(want_grads))[path]
        err = relerr(g, w)
        assert err <= F32_TOL, f"{jax.tree_util.keystr(path)}: relerr {err:.2e} vs jax.lax.ragged_dot"
    # The empty expert's weights get exactly zero gradient.
    assert not np.asarray(got_grads["params"]["fc1"]["kernel"][1]).any()
    assert not np.asarray(got_grads["params"]["fc2"]["kernel"][1]).any()


def test_grouped_dense_group_offset(backend):
    M, K, N = 20, 8, 12
    x = jnp.asarray(np.random.default_rng(1).standard_normal((M, K)), jnp.float32)
    global_sizes = jnp.asarray([4, 7, 5, 4], jnp.int32)
    layer = mflax.GroupedDense(2, N, ragged_dot_cls=mflax.make_ragged_dot_cls(backend=backend))
    params = layer.init(jax.random.key(0), x, global_sizes, jnp.int32(1))
    out = layer.apply(params, x, global_sizes, jnp.int32(1))
    kernel = np.asarray(params["params"]["kernel"], np.float64)
    # Experts 1 and 2 of the 4 are local: the oracle sees zero weights for the others.
    kernel_full = np.zeros((4, K, N))
    kernel_full[1:3] = kernel
    want = oracle.m_grouped_mm(x, kernel_full, global_sizes.tolist())
    assert relerr(out, want) <= F32_TOL
    assert not np.asarray(out[:4]).any() and not np.asarray(out[16:]).any(), "rows of other experts not zero"


def test_make_ragged_dot_cls_rejects_unservable_backend_at_build_time():
    with pytest.raises(ValueError, match="backend must be one of"):
        mflax.make_ragged_dot_cls(backend="pallas")


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_grouped_dense_fp8_recipe_one_argument(backend, recipe):
    """fp8_recipe switches an existing layer to FP8: same parameters, values and gradients are
    ragged_dot(fp8_recipe=...)'s (the FP8 op itself is checked in test_jax.py), FP8-close to the BF16 layer."""
    import moegemm.jax as mj

    M, K, N, sizes = 40, 32, 24, [10, 0, 25, 5]
    x = jnp.asarray(np.random.default_rng(2).standard_normal((M, K)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    plain = mflax.GroupedDense(4, N, ragged_dot_cls=mflax.make_ragged_dot_cls(backend=backend))
    layer = mflax.GroupedDense(4, N, fp8_recipe=recipe, backend=backend)
    params = plain.init(jax.random.key(0), x, gs)
    loss = lambda layer: lambda p, x: jnp.sum(jnp.sin(layer.apply(p, x, gs)))
    (value, (dp, dx)) = jax.value_and_grad(loss(layer), argnums=(0, 1))(params, x)
    kernel = params["params"]["kernel"]
    direct = lambda k, x: jnp.sum(jnp.sin(mj.ragged_dot(x, k, gs, fp8_recipe=recipe, backend=backend)))
    want_value, (want_dk, want_dx) = jax.value_and_grad(direct, argnums=(0, 1))(kernel, x)
    assert float(value) == float(want_value)
    np.testing.assert_array_equal(np.asarray(dp["params"]["kernel"]), np.asarray(want_dk))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(want_dx))
    out_fp8, out_bf16 = layer.apply(params, x, gs), plain.apply(params, x, gs)
    assert 0 < relerr(out_fp8, out_bf16) < 0.1  # FP8, not a silent fallback to the high-precision op
    with pytest.raises(ValueError, match="recipe"):
        mflax.make_ragged_dot_cls(backend=backend, fp8_recipe="mxfp8")
