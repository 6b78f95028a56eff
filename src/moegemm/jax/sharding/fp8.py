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
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning

from moegemm._src import fp8
from moegemm._src.jax import ops_fp8 as _ops_fp8
from moegemm.jax.api import Backend, _executor
from moegemm.jax.fp8 import Fp8Array
from moegemm.jax.sharding.partition import named, ragged_dot, require_auto_axes
from moegemm.jax.sharding.per_shard import linear_index, shard_group_sizes
from moegemm.jax.sharding.plans import Axes, ShardingRuleError, dims


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
        out, _, _ = _ops_fp8.fprop(
            lhs, rhs, group_sizes, group_offset, self.recipe, self.dtype, preferred_element_type, executor,
            lhs_transpose=False, lhs_amax_reduce=reduce_x, rhs_amax_reduce=reduce_w,
        )  # fmt: skip
        return out

    def k_grouped_mm(self, a, b, group_sizes, group_offset, num_groups, out_dtype, *, scale_axes=None):
        # The wgrad reads the transposed copies only: their scales are per column (rowwise per (group,
        # column), blockwise per 128 tokens of a column), so sharded columns need no check.
        (a_rows, a_k), (b_rows, b_n) = scale_axes or (((), ()), ((), ()))
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


# ---------------------------------------------------------------- the grouped quantize


def _quantize_specs(recipe: str, m: Axes, k: Axes) -> tuple[tuple[Axes, ...], tuple[Axes, ...]]:
    """(data's, scale's) axes per dimension for activations whose rows are sharded over m, K over k."""
    scale = {"tensorwise": ((),), "rowwise": (m,), "blockwise": (k, m)}[recipe]
    return (m, k), scale


def _quantize_plan(recipe: str, x_spec, shape, mesh_shape) -> tuple[Axes, Axes]:
    m, k = dims(x_spec, 2)
    if recipe == "rowwise" and k:
        raise ShardingRuleError(
            f"rowwise FP8 scales span the whole row: x's K must not be sharded (mesh axes {k})"
        )
    if recipe == "blockwise" and k and (shape[1] // math.prod(mesh_shape[a] for a in k)) % fp8.SCALE_BLOCK:
        raise ShardingRuleError(
            f"blockwise FP8: x's K={shape[1]} sharded over mesh axes {k} leaves 1x128 tiles that straddle shards"
        )
    return m, k


def _quantize_partition(recipe, dtype, backend, mesh, arg_shapes, result_shape):
    x, _ = arg_shapes
    m, k = _quantize_plan(recipe, x.sharding.spec, x.shape, dict(mesh.shape))
    data_axes, scale_axes = _quantize_specs(recipe, m, k)
    M_local = x.shape[0] // math.prod(mesh.shape[a] for a in m) if m else x.shape[0]

    def lower(x, group_sizes):
        if m:  # this shard's rows of every group
            group_sizes = shard_group_sizes(group_sizes, linear_index(m) * M_local, M_local)
        reduce = _pmax(m + k) if recipe == "tensorwise" else None
        parts = _ops_fp8.quantize_activation(x, group_sizes, recipe, dtype, False, _executor(backend), reduce)
        return parts.data, parts.scale

    outs = (named(mesh, *data_axes), named(mesh, *scale_axes))
    return mesh, lower, outs, (named(mesh, m, k), named(mesh, ()))


def _quantize_infer(recipe, dtype, backend, mesh, arg_shapes, result_shape):
    m, k = dims(arg_shapes[0].sharding.spec, 2)
    data_axes, scale_axes = _quantize_specs(recipe, m, k)
    return named(mesh, *data_axes), named(mesh, *scale_axes)


def _quantize_rule(recipe, dtype, backend, mesh, operand_types, result_types):
    scale = {"tensorwise": "g", "rowwise": "m", "blockwise": "b m"}[recipe]
    factors = ("s", "g") if recipe == "tensorwise" else ("s",)
    return f"m k, s -> m k, {scale}", {"need_replication_factors": factors}


@partial(custom_partitioning, static_argnums=(2, 3, 4))
def _quantize(x, group_sizes, recipe, dtype, backend):
    parts = _ops_fp8.quantize_activation(x, group_sizes, recipe, dtype, False, _executor(backend))
    return parts.data, parts.scale


_quantize.def_partition(
    partition=_quantize_partition, infer_sharding_from_operands=_quantize_infer, sharding_rule=_quantize_rule
)


def quantize_fp8(
    x: jax.Array,
    recipe: fp8.Recipe,
    group_sizes: jax.Array,
    *,
    dtype=jnp.float8_e4m3fn,
    backend: Backend = "auto",
) -> Fp8Array:
    """The grouped quantize of activations x [M, K] sharded under jit (``moegemm.jax.fp8.quantize_fp8``'s
    semantics, no transposed copy): tokens may be sharded over any DP/EP/FSDP axes. Tensorwise: each
    group's amax is computed on the shard and ``pmax``-ed over the axes sharding x, so every shard
    casts with the unsharded tensor's scale (the data and scales equal the unsharded op's bit for bit).
    Rowwise and blockwise scales are per row, local. data comes out sharded like x; the scale
    replicated (tensorwise [G]), like x's rows (rowwise [M]) or [K axes, row axes] (blockwise
    [cdiv(K, 128), M]). group_sizes [G] is global and replicated."""
    fp8.check_recipe(recipe)
    if x.ndim != 2 or group_sizes.ndim != 1:
        raise ValueError(f"want x [M, K] and group_sizes [G]; got {x.shape} and {group_sizes.shape}")
    require_auto_axes(x)
    sizes = group_sizes.astype(jnp.int32)
    data, scale = _quantize(x, sizes, recipe, jnp.dtype(dtype), backend)
    return Fp8Array(data, scale, None, None, sizes, recipe)
