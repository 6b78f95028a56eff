"""Runs a plan on one shard's blocks: the plan's all-gathers, one local call, its psum / psum_scatter.

Shared by the jit partitioner (:mod:`._partition`) and shard_map (:mod:`._shard_map`), so both run the
same collectives. Traced inside a computation with named mesh axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moegemm._src import layout
from moegemm.jax.sharding._local_ops import LocalOps
from moegemm.jax.sharding._plans import Axes, KGroupedPlan, MGroupedPlan


def linear_index(axes: Axes):
    """This shard's index along a dimension sharded over `axes` (major to minor)."""
    index = jnp.int32(0)
    for a in axes:
        index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return index


def shard_group_sizes(group_sizes: jax.Array, row_start, M_local: int) -> jax.Array:
    """Sizes of the global groups restricted to rows [row_start, row_start + M_local).

    group_sizes=[3, 0, 4] (M=8, rows 7.. unowned), row_start=4, M_local=4 -> [0, 0, 3].
    """
    starts, ends = layout.group_layout(group_sizes, jnp.iinfo(jnp.int32).max, jnp)
    clip = lambda x: jnp.clip(x - row_start, 0, M_local)
    return clip(ends) - clip(starts)


def all_gather(x, axes: Axes, axis: int):
    return jax.lax.all_gather(x, axes, axis=axis, tiled=True) if axes else x


def shard_groups(rows: Axes, experts: Axes, group_sizes, M_local: int, G_local: int):
    """(group sizes clipped to this shard's rows, group_offset = this shard's first expert, or None)."""
    if rows:
        group_sizes = shard_group_sizes(group_sizes, linear_index(rows) * M_local, M_local)
    return group_sizes, linear_index(experts) * G_local if experts else None


def m_grouped_gather(plan: MGroupedPlan, lhs, rhs, group_sizes):
    """The plan's all-gathers: (lhs rows, rhs, local group sizes, group_offset) for the local call."""
    rhs = all_gather(all_gather(rhs, plan.rhs_gather[0], 1), plan.rhs_gather[1], 2)
    lhs = all_gather(lhs, plan.row_gather, 0)
    return lhs, rhs, *shard_groups(plan.rows, plan.experts, group_sizes, lhs.shape[0], rhs.shape[0])


def _scale_axes(ops: LocalOps, *per_operand: tuple[Axes, Axes]) -> dict:
    """{"scale_axes": ((rows, columns) mesh axes per operand)} for ops that quantize, else {}."""
    return {"scale_axes": per_operand} if getattr(ops, "takes_scale_axes", False) else {}


def m_grouped_local(plan: MGroupedPlan, ops: LocalOps, out_dtype, lhs, rhs, group_sizes):
    """Run `plan` on this shard's blocks (inside a partitioned computation or shard_map)."""
    lhs, rhs, group_sizes, offset = m_grouped_gather(plan, lhs, rhs, group_sizes)
    acc = jnp.float32 if plan.reduces else out_dtype
    # FP8 local calls also take the mesh axes that share each operand's scales (moegemm.jax.sharding.fp8).
    k = plan.lhs[1]
    out = ops.ragged_dot(
        lhs, rhs, group_sizes, offset, acc, **_scale_axes(ops, (plan.rows, k), (k, plan.out[1]))
    )
    if plan.psum:
        out = jax.lax.psum(out, plan.psum)
    if plan.scatter:
        out = jax.lax.psum_scatter(out, plan.scatter, scatter_dimension=0, tiled=True)
    return out.astype(out_dtype)


def k_grouped_local(plan: KGroupedPlan, ops: LocalOps, out_dtype, a, b, group_sizes, num_groups: int):
    """Run `plan` on this shard's blocks: out [G_local, K, N] of the num_groups global groups."""
    G_local = num_groups // math.prod(jax.lax.axis_size(x) for x in plan.experts)
    group_sizes, offset = shard_groups(plan.rows, plan.experts, group_sizes, a.shape[0], G_local)
    scale_axes = _scale_axes(ops, (plan.rows, plan.a[1]), (plan.rows, plan.b[1]))
    out = ops.k_grouped_mm(a, b, group_sizes, offset, G_local, jnp.float32, **scale_axes)
    for dim, axes in enumerate(plan.scatter):
        if axes:
            out = jax.lax.psum_scatter(out, axes, scatter_dimension=dim, tiled=True)
    if plan.psum:  # after the reduce-scatters: all-reduce the smaller block
        out = jax.lax.psum(out, plan.psum)
    return out.astype(out_dtype)
