"""JAX-side impls: moegemm's JAX front end, jax.lax.ragged_dot, and tokamax (when importable).

Inputs come from the problem's torch tensors through DLPack once, in ``prepare``; each impl gets
the layout it wants there (outside the timing). Every callable is a jitted function that ends with
``block_until_ready()``, timed by wall clock (XLA runs on its own stream). Layouts as in
``problem.py``: x [M, K], w [G, N, K], dy [M, N]; wgrad returns [G, N, K].
"""

from __future__ import annotations

import importlib.util
import itertools

import jax
import jax.numpy as jnp

from moegemm.bench.registry import Impl, register
from moegemm.jax import api as moegemm_jax

OPS = ("fwd", "dgrad", "wgrad")
# wgrad as a ragged-contracting dot: [M, N] x [M, K] -> [G, N, K], groups along the contracted M.
WGRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def _to_jax(tensor) -> jax.Array:
    return jax.dlpack.from_dlpack(tensor.contiguous())


def _jax_dtype(problem):
    return jnp.dtype(str(problem.dtype).removeprefix("torch."))


def _prepared(problem, op, make_fn, *, w_kn: bool = False):
    """fn() cycling over the input copies; make_fn(x, w, dy, group_sizes) -> a jitted zero-arg call."""
    gs = jnp.asarray(problem.sizes, jnp.int32)
    calls = []
    for x, w, dy in problem.copies:
        w = _to_jax(w)
        if w_kn:  # a [G, K, N] copy for impls that cannot read the nn.Linear layout
            w = jnp.swapaxes(w, 1, 2).copy()
        calls.append(make_fn(_to_jax(x), w, _to_jax(dy), gs))
    it = itertools.cycle(calls)
    return lambda: next(it)()


def _bind(fn, *args):
    fn = jax.jit(fn)
    return lambda: fn(*args).block_until_ready()


# ---------------------------------------------------------------- moegemm (JAX front end)


def _moegemm_jax(problem, op):
    out_dtype = _jax_dtype(problem)

    def make(x, w, dy, gs):
        if op == "fwd":  # w [G, N, K] read as [G, K, N] through swapped strides
            return _bind(lambda x, w, gs: moegemm_jax.m_grouped_mm(x, w, gs, transpose_w=True), x, w, gs)
        if op == "dgrad":
            return _bind(lambda dy, w, gs: moegemm_jax.m_grouped_mm(dy, w, gs), dy, w, gs)
        return _bind(lambda dy, x, gs: moegemm_jax.k_grouped_mm(dy, x, gs, out_dtype=out_dtype), dy, x, gs)

    return _prepared(problem, op, make)


register(Impl("moegemm-jax", OPS, _moegemm_jax, clock="wall"))


# ---------------------------------------------------------------- jax.lax.ragged_dot


def _lax(problem, op):
    out_dtype = _jax_dtype(problem)

    def make(x, w, dy, gs):
        if op == "fwd":
            return _bind(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs), x, w, gs)
        if op == "dgrad":
            return _bind(lambda dy, w, gs: jax.lax.ragged_dot(dy, w, gs), dy, w, gs)  # w[g] is [N, K]
        return _bind(
            lambda dy, x, gs: jax.lax.ragged_dot_general(dy, x, gs, WGRAD_DIMS, preferred_element_type=out_dtype),
            dy, x, gs,
        )  # fmt: skip

    return _prepared(problem, op, make, w_kn=op == "fwd")


register(Impl("jax.lax.ragged_dot", OPS, _lax, clock="wall"))


# ---------------------------------------------------------------- tokamax


def _tokamax_available(problem, op) -> str | None:
    del problem, op
    return None if importlib.util.find_spec("tokamax") is not None else "tokamax is not installed"


def _tokamax(problem, op):
    import tokamax

    def make(x, w, dy, gs):
        if op == "fwd":
            return _bind(lambda x, w, gs: tokamax.ragged_dot(x, w, gs), x, w, gs)
        if op == "dgrad":
            return _bind(lambda dy, w, gs: tokamax.ragged_dot(dy, w, gs), dy, w, gs)

        # wgrad through tokamax's own VJP of out = dy @ W (W [G, N, K]): dW[g] = dy_g^T @ x_g.
        # Only the rhs cotangent is requested. The primal output is unused, so XLA drops the forward
        # call if tokamax's kernel call is side-effect free; otherwise this row times fwd + wgrad.
        def wgrad(dy, x, gs):
            w0 = jnp.zeros((gs.shape[0], dy.shape[1], x.shape[1]), dy.dtype)
            _, vjp = jax.vjp(lambda w: tokamax.ragged_dot(dy, w, gs), w0)
            return vjp(x)[0]

        return _bind(wgrad, dy, x, gs)

    return _prepared(problem, op, make, w_kn=op == "fwd")


register(Impl("tokamax", OPS, _tokamax, available=_tokamax_available, clock="wall"))
