"""custom_vjp rules around the kernel executors (the JAX glue). Inputs are validated by ``moegemm.jax.api``.

Two differentiable primitives, each closed under differentiation (higher-order grads reuse them):

- ``m_grouped_mm(x, w, sizes, offset)``: ``out[rows(g)] = x[rows(g)] @ W[g]``, W = w, or w^T per
  group when ``transpose_w`` (w stored [G, N, K]; read through swapped strides, never copied).
  dx = m_grouped_mm(dy, w, not transpose_w); dW = k_grouped_mm(x, dy), stored transposed as
  k_grouped_mm(dy, x).
- ``k_grouped_mm(a, b, sizes, offset, c)``: ``out[g] = c[g] + a[rows(g)]^T @ b[rows(g)]`` (c optional).
  da = m_grouped_mm(b, dout, transpose_w=True); db = m_grouped_mm(a, dout); dc = dout.

``offset`` (int32 scalar or None) is expert parallelism: sizes covers all groups and the op's groups
are [offset, offset + G_local), read and written in place; rows of other groups are 0 in every
m-grouped output, so the rules above hold unchanged.

Both take the resolved ``Executor`` (``api`` resolves the backend string once) as a static argument.
Group sizes are integer inputs with no cotangent. Empty groups read no rows, so their weight
gradient is exactly zero and their rows' input gradient is exactly zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moegemm._src.jax import launch as _launch
from moegemm._src.jax.launch import Executor


def _m_grouped_mm_impl(x, w, group_sizes, group_offset, out_dtype, transpose_w, executor: Executor):
    M, K = x.shape
    N = w.shape[1] if transpose_w else w.shape[2]
    if M == 0 or N == 0 or K == 0 or w.shape[0] == 0:
        return jnp.zeros((M, N), out_dtype)
    call = _launch.m_grouped_mm_call(
        x,
        w,
        group_sizes,
        transpose_w=transpose_w,
        out_dtype=out_dtype,
        target=executor.target(),
        group_offset=group_offset,
    )
    return executor.run(call)


def _k_grouped_mm_impl(a, b, group_sizes, group_offset, c, out_dtype, num_groups, executor: Executor):
    (M, K), N, G = a.shape, b.shape[1], num_groups
    if M == 0 or N == 0 or K == 0 or G == 0:
        return jnp.zeros((G, K, N), out_dtype) if c is None else c
    call = _launch.k_grouped_mm_call(
        a,
        b,
        group_sizes,
        c,
        out_dtype=out_dtype,
        target=executor.target(),
        group_offset=group_offset,
        num_groups=num_groups,
    )
    return executor.run(call)


# ---------------------------------------------------------------- m_grouped_mm


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def m_grouped_mm(x, w, group_sizes, group_offset, out_dtype, transpose_w: bool, executor: Executor):
    return _m_grouped_mm_impl(x, w, group_sizes, group_offset, out_dtype, transpose_w, executor)


def _m_grouped_mm_fwd(x, w, group_sizes, group_offset, out_dtype, transpose_w, executor):
    out = m_grouped_mm(x, w, group_sizes, group_offset, out_dtype, transpose_w, executor)
    return out, (x, w, group_sizes, group_offset)


def _m_grouped_mm_bwd(out_dtype, transpose_w, executor, residuals, dy):
    x, w, group_sizes, group_offset = residuals
    dy = dy.astype(x.dtype)  # the kernels take one operand dtype; fp32 cotangents of bf16 inputs
    # Rows of non-local groups did not touch w: their dx rows come out 0 from the same offset launch.
    dx = m_grouped_mm(dy, w, group_sizes, group_offset, x.dtype, not transpose_w, executor)
    G = w.shape[0]
    if transpose_w:
        dw = k_grouped_mm(dy, x, group_sizes, group_offset, None, w.dtype, G, executor)
    else:
        dw = k_grouped_mm(x, dy, group_sizes, group_offset, None, w.dtype, G, executor)
    return dx, dw, None, None


m_grouped_mm.defvjp(_m_grouped_mm_fwd, _m_grouped_mm_bwd)


# ---------------------------------------------------------------- k_grouped_mm


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def k_grouped_mm(a, b, group_sizes, group_offset, c, out_dtype, num_groups: int, executor: Executor):
    return _k_grouped_mm_impl(a, b, group_sizes, group_offset, c, out_dtype, num_groups, executor)


def _k_grouped_mm_fwd(a, b, group_sizes, group_offset, c, out_dtype, num_groups, executor):
    # () vs None records statically whether c was given, without keeping c alive.
    out = k_grouped_mm(a, b, group_sizes, group_offset, c, out_dtype, num_groups, executor)
    return out, (a, b, group_sizes, group_offset, None if c is None else ())


def _k_grouped_mm_bwd(out_dtype, num_groups, executor, residuals, dout):
    a, b, group_sizes, group_offset, has_c = residuals
    dout_in = dout.astype(a.dtype)
    da = m_grouped_mm(b, dout_in, group_sizes, group_offset, a.dtype, True, executor)
    db = m_grouped_mm(a, dout_in, group_sizes, group_offset, b.dtype, False, executor)
    return da, db, None, None, None if has_c is None else dout


k_grouped_mm.defvjp(_k_grouped_mm_fwd, _k_grouped_mm_bwd)
