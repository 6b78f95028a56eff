"""custom_vjp rules and executor dispatch (the JAX glue). Inputs are validated by ``moegemm.jax.api``.

Two differentiable primitives, each closed under differentiation (higher-order grads reuse them):

- ``m_grouped(x, w, sizes)``: ``out[rows(g)] = x[rows(g)] @ W[g]``, W = w, or w^T per group when
  ``transpose_w`` (w stored [G, N, K]; read through swapped strides, never copied).
  dx = m_grouped(dy, w, not transpose_w); dW = k_grouped(x, dy), stored transposed as k_grouped(dy, x).
- ``k_grouped(a, b, sizes, c)``: ``out[g] = c[g] + a[rows(g)]^T @ b[rows(g)]`` (c optional).
  da = m_grouped(b, dout, transpose_w=True); db = m_grouped(a, dout); dc = dout.

Group sizes are integer inputs with no cotangent. Empty groups read no rows, so their weight
gradient is exactly zero and their rows' input gradient is exactly zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moegemm.jax import _interpret, _launch, _triton


def _execute(call: _launch.KernelCall, backend: str):
    if backend == "triton":
        return _triton.run(call)
    return _interpret.run(call)


def _target(backend: str) -> _launch.Target:
    return _launch.gpu_target() if backend == "triton" else _launch.INTERPRET


def _m_grouped_impl(x, w, group_sizes, out_dtype, transpose_w, backend):
    M, K = x.shape
    N = w.shape[1] if transpose_w else w.shape[2]
    if M == 0 or N == 0 or K == 0 or w.shape[0] == 0:
        return jnp.zeros((M, N), out_dtype)
    call = _launch.m_grouped_call(
        x, w, group_sizes, transpose_w=transpose_w, out_dtype=out_dtype, target=_target(backend)
    )
    return _execute(call, backend)


def _k_grouped_impl(a, b, group_sizes, c, out_dtype, backend):
    (M, K), N, G = a.shape, b.shape[1], group_sizes.shape[0]
    if M == 0 or N == 0 or K == 0 or G == 0:
        return jnp.zeros((G, K, N), out_dtype) if c is None else c
    call = _launch.k_grouped_call(a, b, group_sizes, c, out_dtype=out_dtype, target=_target(backend))
    return _execute(call, backend)


# ---------------------------------------------------------------- m_grouped


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def m_grouped(x, w, group_sizes, out_dtype, transpose_w: bool, backend: str):
    return _m_grouped_impl(x, w, group_sizes, out_dtype, transpose_w, backend)


def _m_grouped_fwd(x, w, group_sizes, out_dtype, transpose_w, backend):
    return m_grouped(x, w, group_sizes, out_dtype, transpose_w, backend), (x, w, group_sizes)


def _m_grouped_bwd(out_dtype, transpose_w, backend, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)  # the kernels take one operand dtype; fp32 cotangents of bf16 inputs
    dx = m_grouped(dy, w, group_sizes, x.dtype, not transpose_w, backend)
    if transpose_w:
        dw = k_grouped(dy, x, group_sizes, None, w.dtype, backend)
    else:
        dw = k_grouped(x, dy, group_sizes, None, w.dtype, backend)
    return dx, dw, None


m_grouped.defvjp(_m_grouped_fwd, _m_grouped_bwd)


# ---------------------------------------------------------------- k_grouped


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def k_grouped(a, b, group_sizes, c, out_dtype, backend: str):
    return _k_grouped_impl(a, b, group_sizes, c, out_dtype, backend)


def _k_grouped_fwd(a, b, group_sizes, c, out_dtype, backend):
    # () vs None records statically whether c was given, without keeping c alive.
    return k_grouped(a, b, group_sizes, c, out_dtype, backend), (a, b, group_sizes, None if c is None else ())


def _k_grouped_bwd(out_dtype, backend, residuals, dout):
    a, b, group_sizes, has_c = residuals
    dout_in = dout.astype(a.dtype)
    da = m_grouped(b, dout_in, group_sizes, a.dtype, True, backend)
    db = m_grouped(a, dout_in, group_sizes, b.dtype, False, backend)
    return da, db, None, None if has_c is None else dout


k_grouped.defvjp(_k_grouped_fwd, _k_grouped_bwd)


# ---------------------------------------------------------------- expert parallelism


def roll_rows(x: jax.Array, shift: jax.Array) -> jax.Array:
    """jnp.roll along rows by a device-side shift (a copy; differentiable, its VJP rolls back)."""
    return jnp.roll(x, shift, axis=0)
