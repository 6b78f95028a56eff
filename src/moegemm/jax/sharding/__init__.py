"""Partitioning rules for the grouped GEMMs: sharded inputs under jit, and the same plans inside shard_map.

The Triton kernels are opaque custom calls, so XLA cannot partition them. The operand shardings
pick a plan: which collectives run around one local call. Rules (docs/sharding.md):

====================================  =========================================================
operand sharding                      what runs per shard
====================================  =========================================================
lhs M (tokens) over DP/EP axes        local, group sizes clipped to the shard's rows; no collective
rhs G (experts) over EP axes          group_offset = ep_index * G_local; psum(out, EP)
rhs G and lhs M over the same axis    all-gather lhs rows over it; psum_scatter(out rows) over it
rhs K or N over an axis of lhs M      FSDP: all-gather the weight; the weight grad is reduce-scattered
lhs and rhs K over an axis            psum(out), or psum_scatter(out rows) if the rows are sharded
rhs K and N both sharded              error naming the axes
====================================  =========================================================

Unservable shardings raise ShardingRuleError naming the mesh axes (under jit, at compile time,
re-raised by XLA as JaxRuntimeError); no rule silently replicates an operand.

FP8 goes through the same plans: ``ragged_dot(lhs, rhs, group_sizes, fp8_recipe=...)`` quantizes on
each shard, reducing the tensorwise amax (``pmax``) over the axes that shard an operand; rowwise and
blockwise scales must not straddle shards (ShardingRuleError). ``quantize_fp8`` is the grouped
quantize of sharded activations.

One job per private module:

- ``_plans``: the rules, as pure functions of the PartitionSpecs (``plan_m_grouped``, ``plan_k_grouped``);
- ``_per_shard``: runs a plan on one shard's blocks (all-gathers, one local call, psum / psum_scatter);
- ``_local_ops``: that local call (:class:`LocalOps`): moegemm's kernels by default (FP8 with a recipe),
  the jnp reference (``REFERENCE_OPS``) on request;
- ``_partition``: ``custom_partitioning`` wiring and the jit backward (:func:`ragged_dot`), and the
  sharded :func:`quantize_fp8`;
- ``_shard_map``: the same plans inside shard_map, with the transposed backward (:func:`shard_map_ragged_dot`).

Dense GEMMs: ``moegemm.jax.collective_gemm``. The HLO collectives checker: ``moegemm.testing.hlo``.
"""

from moegemm.jax.sharding._local_ops import REFERENCE_OPS, LocalOps, moegemm_local_ops
from moegemm.jax.sharding._partition import quantize_fp8, ragged_dot
from moegemm.jax.sharding._plans import (
    KGroupedPlan,
    MGroupedPlan,
    ShardingRuleError,
    out_spec,
    plan_k_grouped,
    plan_m_grouped,
)
from moegemm.jax.sharding._shard_map import shard_map_ragged_dot

__all__ = [
    "KGroupedPlan",
    "LocalOps",
    "MGroupedPlan",
    "REFERENCE_OPS",
    "ShardingRuleError",
    "moegemm_local_ops",
    "out_spec",
    "plan_k_grouped",
    "plan_m_grouped",
    "quantize_fp8",
    "ragged_dot",
    "shard_map_ragged_dot",
]
