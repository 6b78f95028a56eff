"""FP8 under the partitioning rules: the same plans and collectives as BF16, with FP8 local calls whose
scales are reduced across the shards that share them.

``ragged_dot_fp8(lhs, rhs, group_sizes, recipe=...)`` is :func:`moegemm.jax.sharding.ragged_dot` with
:class:`Fp8LocalOps` as the per-shard computation: forward, dgrad and wgrad each quantize their
operands on the shard (after the plan's all-gathers: an FSDP weight is gathered, then quantized) and
run moegemm's FP8 kernels, with the group offset for EP (no row copies). The plans are unchanged, so
the collectives are the BF16 rules' (``docs/sharding.md``) plus, for tensorwise scaling, one
all-reduce max per quantized operand:

- tensorwise: the per-group (activations) or per-expert (weights) amax is computed on the shard and
  ``pmax``-ed over every mesh axis that shards the operand's rows or columns (DP, EP, FSDP token axes;
  a sharded K or N), so every shard casts with the scale of the unsharded tensor (bit for bit);
- rowwise: a row's scale spans K, an expert column's spans the weight's rows: those dimensions must
  not be sharded in the local call (ShardingRuleError names the axes); per-(group, column) scales of
  the wgrad's transposed copies are per token shard, each shard's partial product dequantized with its
  own scales before the psum;
- blockwise: scales are local when every shard boundary falls on a 128 block (else ShardingRuleError);
  the wgrad's 128-token blocks start at each group's first row on the shard.

The backward saves lhs and rhs in their own precision and quantizes them again (deterministic: the
same bits as the forward's), rather than carrying per-shard FP8 layouts between the two passes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from moegemm import fp8
from moegemm.jax import _ops_fp8
from moegemm.jax.api import Backend, _executor
from moegemm.jax.sharding.partition import ragged_dot
from moegemm.jax.sharding.plans import Axes, ShardingRuleError


def _pmax(axes: Axes):
    return (lambda amax: jax.lax.pmax(amax, axes)) if axes else None


def _local_size(dim: int, axes: Axes) -> int:
    return dim // math.prod(jax.lax.axis_size(a) for a in axes) if axes else dim


@dataclasses.dataclass(frozen=True)
class Fp8LocalOps:
    """The per-shard computation of the FP8 rules (a ``LocalOps`` that also takes the mesh axes sharing
    each operand's scales: ``scale_axes = (rows, columns)`` per operand, from the plan)."""

    recipe: str
    dtype: object = jnp.float8_e4m3fn
    backend: Backend = "auto"
    takes_scale_axes = True

    @property
    def name(self) -> str:
        return f"moegemm-fp8-{self.recipe}-{self.backend}"

    def _check(self, what: str, shape, rows: Axes, cols: Axes) -> None:
        """Rowwise scales span whole rows (and a weight's columns); blockwise needs block-aligned shards."""
        if self.recipe == "tensorwise":
            return
        if self.recipe == "rowwise" and (cols or (len(shape) == 3 and rows)):
            raise ShardingRuleError(
                f"rowwise FP8 scales span the whole row: {what} must not be sharded along its "
                f"contraction or columns in the local call (mesh axes {rows + cols})"
            )
        if self.recipe == "blockwise":
            sharded = [(d, a) for d, a in zip(shape[-2:], (rows, cols)) if a]
            if len(shape) == 2:
                sharded = [(shape[1], cols)] if cols else []
            for dim, axes in sharded:
                if _local_size(dim, axes) % fp8.SCALE_BLOCK:
                    raise ShardingRuleError(
                        f"blockwise FP8: {what}'s dimension {dim} sharded over mesh axes {axes} leaves blocks "
                        f"that straddle shards (the local size must be a multiple of {fp8.SCALE_BLOCK})"
                    )

    def ragged_dot(self, lhs, rhs, group_sizes, group_offset, preferred_element_type, *, scale_axes=None):
        (lhs_rows, lhs_k), (rhs_k, rhs_n) = scale_axes or (((), ()), ((), ()))
        self._check("lhs", lhs.shape, lhs_rows, lhs_k)
        self._check("rhs", rhs.shape, rhs_k, rhs_n)
        executor = _executor(self.backend)
        reduce_x = _pmax(lhs_rows + lhs_k) if self.recipe == "tensorwise" else None
        reduce_w = _pmax(rhs_k + rhs_n) if self.recipe == "tensorwise" else None
        x_q = _ops_fp8.quantize_activation(
            lhs, group_sizes, self.recipe, self.dtype, False, executor, reduce_x
        )
        # rhs [G, K, N] quantized as a [G, K, N] weight; its transposed copy [G, N, padded(K)] is K-major.
        w_q = _ops_fp8.quantize_weight(rhs, self.recipe, self.dtype, True, executor, reduce_w)
        return _ops_fp8.m_grouped(
            x_q.data,
            x_q.scale,
            w_q.data_t,
            w_q.scale_t,
            group_sizes,
            group_offset,
            self.recipe,
            preferred_element_type,
            executor,
        )

    def k_grouped_mm(self, a, b, group_sizes, group_offset, num_groups, out_dtype, *, scale_axes=None):
        (a_rows, a_k), (b_rows, b_n) = scale_axes or (((), ()), ((), ()))
        if self.recipe == "blockwise" and (a_k or b_n):
            self._check("the weight gradient", (a.shape[1], b.shape[1]), a_k, b_n)
        executor = _executor(self.backend)
        tensorwise = self.recipe == "tensorwise"
        a_q = _ops_fp8.quantize_activation(
            a,
            group_sizes,
            self.recipe,
            self.dtype,
            True,
            executor,
            _pmax(a_rows + a_k) if tensorwise else None,
        )
        b_q = _ops_fp8.quantize_activation(
            b,
            group_sizes,
            self.recipe,
            self.dtype,
            True,
            executor,
            _pmax(b_rows + b_n) if tensorwise else None,
        )
        return _ops_fp8.k_grouped(
            a.shape[0],
            a_q.data_t,
            a_q.scale_t,
            b_q.data_t,
            b_q.scale_t,
            group_sizes,
            group_offset,
            None,
            num_groups,
            self.recipe,
            out_dtype,
            executor,
        )


def fp8_local_ops(recipe: fp8.Recipe, dtype=jnp.float8_e4m3fn, backend: Backend = "auto") -> Fp8LocalOps:
    """The FP8 per-shard computation for ``moegemm.jax.sharding.ragged_dot(..., ops=...)``."""
    fp8.check_recipe(recipe)
    return Fp8LocalOps(fp8.check_recipe(recipe), jnp.dtype(dtype), backend)


def ragged_dot_fp8(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: fp8.Recipe = "blockwise",
    dtype=jnp.float8_e4m3fn,
    preferred_element_type=None,
    backend: Backend = "auto",
) -> jax.Array:
    """FP8 ``ragged_dot`` for sharded operands under jit: lhs [M, K], rhs [G, K, N], group_sizes [G]
    (global, replicated) -> [M, N]. The shardings pick the BF16 rules' collectives; each local call
    quantizes (scales reduced across the shards sharing them) and runs the FP8 kernels, forward and
    backward. Differentiable in lhs and rhs (straight through the quantization)."""
    return ragged_dot(
        lhs,
        rhs,
        group_sizes,
        preferred_element_type=preferred_element_type,
        ops=fp8_local_ops(recipe, dtype, backend),
    )
