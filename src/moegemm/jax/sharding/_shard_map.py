"""Inside shard_map: the plans the jit partitioner picks, on explicit specs, with their transposed backward.

The forward is :mod:`._per_shard`'s runner; the backward is its transpose, collective by collective
(psum_scatter <-> all-gather, psum -> nothing), with a k-grouped weight gradient and each gradient
summed over the manual axes its operand is replicated on.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from moegemm.jax.sharding._local_ops import LocalOps, resolve_ops
from moegemm.jax.sharding._partition import _high_precision
from moegemm.jax.sharding._per_shard import _scale_axes, all_gather, m_grouped_gather, m_grouped_local
from moegemm.jax.sharding._plans import Axes, ShardingRuleError, dims, plan_m_grouped, spec


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _shard_map_ragged_dot(lhs, rhs, group_sizes, plan, ops, out_dtype):
    return m_grouped_local(plan, ops, out_dtype, lhs, rhs, group_sizes)


def _shard_map_ragged_dot_fwd(lhs, rhs, group_sizes, plan, ops, out_dtype):
    return m_grouped_local(plan, ops, out_dtype, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _shard_map_ragged_dot_bwd(plan, ops, out_dtype, res, dout):
    """The transpose of m_grouped_local, collective by collective, with a k-grouped weight gradient.

    psum_scatter -> all-gather, psum -> nothing (the cotangent is already replicated), all-gather
    -> psum_scatter; then _match_vma sums each gradient over the manual axes its operand is
    replicated on. With the tokens sharded as lhs_spec says, this runs the jit backward's collectives.
    """
    lhs, rhs, group_sizes = res
    lhs_full, rhs_full, group_sizes, offset = m_grouped_gather(plan, lhs, rhs, group_sizes)
    dout = all_gather(dout, plan.scatter, 0)
    k, n = plan.lhs[1], plan.out[1]
    dlhs = ops.ragged_dot(
        dout, jnp.swapaxes(rhs_full, 1, 2), group_sizes, offset, jnp.float32,
        **_scale_axes(ops, (plan.rows, n), (n, k)),
    )  # fmt: skip
    drhs = ops.k_grouped_mm(
        lhs_full, dout, group_sizes, offset, rhs_full.shape[0], jnp.float32,
        **_scale_axes(ops, (plan.rows, k), (plan.rows, n)),
    )  # fmt: skip
    if plan.row_gather:
        dlhs = jax.lax.psum_scatter(dlhs, plan.row_gather, scatter_dimension=0, tiled=True)
    for dim, axes in ((1, plan.rhs_gather[0]), (2, plan.rhs_gather[1])):
        if axes:
            drhs = jax.lax.psum_scatter(drhs, axes, scatter_dimension=dim, tiled=True)
    dlhs, drhs = _match_vma(dlhs, lhs).astype(lhs.dtype), _match_vma(drhs, rhs).astype(rhs.dtype)
    return dlhs, drhs, None


_shard_map_ragged_dot.defvjp(_shard_map_ragged_dot_fwd, _shard_map_ragged_dot_bwd)


def _varying(x) -> frozenset:
    """The manual axes x varies over (JAX >= 0.10 keeps them in manual_axis_type; earlier, vma)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _match_vma(grad, primal):
    """Sum a gradient over the manual axes it varies over and its primal does not.

    Axes the specs do not name act as independent replicas (say dp, with tokens routed per shard):
    an operand invariant over such an axis (the weight) gets the sum of the replicas' gradients,
    as JAX's own transposes do. Needs shard_map's check_vma=True (the default) to know the axes.
    """
    have, want = _varying(grad), _varying(primal)
    if have - want:
        grad = jax.lax.psum(grad, tuple(sorted(have - want)))
    if want - have:
        grad = jax.lax.pcast(grad, tuple(sorted(want - have)), to="varying")
    return grad


def shard_map_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_spec,
    rhs_spec,
    out_rows: Axes = (),
    preferred_element_type=None,
    fp8_recipe: str | None = None,
    fp8_dtype=jnp.float8_e4m3fn,
    backend: str = "auto",
    ops: LocalOps | None = None,
) -> jax.Array:
    """Inside shard_map: lhs/rhs are this shard's blocks of arrays sharded as lhs_spec/rhs_spec.

    Runs the plans the jit partitioner would pick, forward and backward (same collectives, same
    result); the output is this shard's block of out_spec(lhs_spec, rhs_spec, out_rows).
    group_sizes is global (all G groups) and replicated. fp8_recipe, backend, ops: as for ``ragged_dot``.
    """
    _high_precision("sharding.shard_map_ragged_dot", lhs, rhs)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    plan = plan_m_grouped(lhs_spec, rhs_spec, out_rows)
    if plan.lhs != dims(lhs_spec, 2) or plan.rhs != dims(rhs_spec, 3):
        raise ShardingRuleError(
            f"under shard_map the blocks must already be laid out as the rules want: lhs {spec(*plan.lhs)}, "
            f"rhs {spec(*plan.rhs)} (got {lhs_spec}, {rhs_spec})"
        )
    ops = resolve_ops(ops, backend, fp8_recipe, fp8_dtype)
    return _shard_map_ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), plan, ops, out_dtype)
