"""Plain jax.numpy twins of the kernels: the test oracle and the CPU fallback.

Same semantics as the kernels and ``moegemm.torch.reference``, clamping included (the rule of
``moegemm._src.layout``): sizes clamp to [0, M], offsets are prefix sums clamped at M, rows past
sum(group_sizes) belong to no group. Unlike the torch twin they stay on the device (no sync), so
they run under jit and are differentiable.
They compute densely over groups (a [G, M] row mask), which is fine for an oracle and CPU fallback.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moegemm._src import layout

HIGHEST = jax.lax.Precision.HIGHEST


def group_mask(group_sizes: jax.Array, M: int, group_offset=None, num_groups: int | None = None) -> jax.Array:
    """[G, M] bool: mask[g, r] = row r belongs to group g (``moegemm._src.layout``'s rule).

    With ``group_offset`` (expert parallelism): [num_groups, M], the masks of groups
    [offset, offset + num_groups) of the G_total in group_sizes (``layout.local_groups``).
    """
    if group_offset is not None:
        first_row, local_sizes = layout.local_groups(group_sizes, group_offset, num_groups, M, jnp)
        # Rows before first_row form a leading group, dropped.
        return group_mask(jnp.concatenate([first_row[None], local_sizes]), M)[1:]
    starts, ends = layout.group_layout(group_sizes, M, jnp)
    rows = jnp.arange(M, dtype=jnp.int32)
    return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])


def m_grouped_mm_reference(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset=None,
    out_dtype=None,
    compute_dtype=jnp.float32,
) -> jax.Array:
    """x [M, K], w [G, K, N] -> out [M, N]; for g: out[rows(g)] = x[rows(g)] @ w[g]; unowned rows 0.

    group_offset: w holds groups [offset, offset + G) of the G_total in group_sizes; rows of other
    groups are 0."""
    mask = group_mask(group_sizes, x.shape[0], group_offset, w.shape[0])
    xg = jnp.where(mask[:, :, None], x.astype(compute_dtype)[None], 0)
    out = jnp.einsum("gmk,gkn->mn", xg, w.astype(compute_dtype), precision=HIGHEST)
    return out.astype(out_dtype or x.dtype)


def k_grouped_mm_reference(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    *,
    c: jax.Array | None = None,
    group_offset=None,
    num_groups: int | None = None,
    out_dtype=jnp.float32,
    compute_dtype=jnp.float32,
) -> jax.Array:
    """a [M, K], b [M, N] -> out [G, K, N]; for g: out[g] = (c[g] +) a[rows(g)]^T @ b[rows(g)].

    With c, an empty group's out[g] is c[g] bit for bit (as the kernel, which skips it: 0 + -0.0
    would be +0.0). group_offset: out holds the num_groups groups [offset, offset + num_groups) of
    the G_total in group_sizes."""
    mask = group_mask(group_sizes, a.shape[0], group_offset, num_groups)
    cast = lambda t: t.astype(compute_dtype)
    out = jnp.einsum("gm,mk,mn->gkn", cast(mask), cast(a), cast(b), precision=HIGHEST)
    if c is not None:
        live = mask.any(axis=1)[:, None, None]
        return jnp.where(live, (out + c.astype(compute_dtype)).astype(c.dtype), c)
    return out.astype(out_dtype)


def ragged_dot_reference(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, group_offset=None, out_dtype=None
) -> jax.Array:
    """jax.lax.ragged_dot semantics, with megablox-style group_offset (rows of non-local groups are 0)."""
    return m_grouped_mm_reference(lhs, rhs, group_sizes, group_offset=group_offset, out_dtype=out_dtype)
