"""Flax integration: the ragged_dot injection point and GroupedDense, against jax.lax.ragged_dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moegemm.jax import _interpret

nn = pytest.importorskip("flax.linen", reason="flax is an optional dependency of moegemm.jax")
mflax = pytest.importorskip("moegemm.jax.flax")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# Triton-backed on a GPU; on CPU the interpreter, so the real kernels run in these tests too.
BACKEND = "triton" if jax.default_backend() == "gpu" else "interpret"


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


def test_grouped_dense_swaps_in_for_lax_ragged_dot():
    M, K, G = 26, 16, 3
    x = jnp.asarray(np.random.default_rng(0).standard_normal((M, K)), jnp.float32)
    sizes = jnp.asarray([9, 0, 14], jnp.int32)  # an empty expert and 3 unowned rows
    baseline = Experts(hidden=24, num_experts=G)
    ours = Experts(hidden=24, num_experts=G, ragged_dot_cls=mflax.make_ragged_dot_cls(backend=BACKEND))
    params = baseline.init(jax.random.key(0), x, sizes)
    assert params["params"]["fc1"]["kernel"].shape == (G, K, 24)

    def loss(module):
        return lambda p: jnp.sum(module.apply(p, x, sizes) ** 2)

    before = _interpret.CALLS.total()
    want, want_grads = jax.value_and_grad(loss(baseline))(params)
    got, got_grads = jax.jit(jax.value_and_grad(loss(ours)))(params)
    if BACKEND == "interpret":
        assert _interpret.CALLS.total() > before, "the injected ragged_dot did not reach the kernels"
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(got_grads):
        w = dict(jax.tree_util.tree_leaves_with_path(want_grads))[path]
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    # The empty expert's weights get exactly zero gradient.
    assert not np.asarray(got_grads["params"]["fc1"]["kernel"][1]).any()


def test_grouped_dense_group_offset():
    M, K, N = 20, 8, 12
    x = jnp.asarray(np.random.default_rng(1).standard_normal((M, K)), jnp.float32)
    global_sizes = jnp.asarray([4, 7, 5, 4], jnp.int32)
    layer = mflax.GroupedDense(2, N, ragged_dot_cls=mflax.make_ragged_dot_cls(backend=BACKEND))
    params = layer.init(jax.random.key(0), x, global_sizes, jnp.int32(1))
    out = layer.apply(params, x, global_sizes, jnp.int32(1))
    kernel = np.asarray(params["params"]["kernel"], np.float64)
    want = np.zeros((M, N))
    want[4:11] = np.asarray(x[4:11], np.float64) @ kernel[0]
    want[11:16] = np.asarray(x[11:16], np.float64) @ kernel[1]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_make_ragged_dot_cls_rejects_unservable_backend_at_build_time():
    with pytest.raises(ValueError, match="backend must be one of"):
        mflax.make_ragged_dot_cls(backend="pallas")
