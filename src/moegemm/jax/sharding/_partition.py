"""custom_partitioning wiring: sharded operands under jit, one plan per op, and the jit backward.

Each op is a ``jax.experimental.custom_partitioning`` wrapper with a Shardy ``sharding_rule`` (for
propagation), a GSPMD ``infer_sharding_from_operands`` giving the same answer, and a ``partition``
callback that turns the operand shardings into a plan (:mod:`._plans`) and lowers to
:mod:`._per_shard`'s runner. The backward is a custom_vjp whose steps are partitioned ops too.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding

from moegemm._src import fp8
from moegemm._src.jax import ops as _ops
from moegemm.jax import api
from moegemm.jax.api import Fp8Array
from moegemm.jax.sharding._local_ops import LocalOps, _pmax, resolve_ops
from moegemm.jax.sharding._per_shard import k_grouped_local, linear_index, m_grouped_local, shard_group_sizes
from moegemm.jax.sharding._plans import Axes, ShardingRuleError, dims, plan_k_grouped, plan_m_grouped, spec


def named(mesh, *dim_axes):
    return NamedSharding(mesh, spec(*dim_axes))


def require_auto_axes(*arrays):
    """custom_partitioning traces its body with explicit-axis shardings in the types, where the
    reference's contractions over sharded dimensions are ambiguous: ask for Auto axes instead."""
    for x in arrays:
        sharding = jax.typeof(x).sharding
        types = dict(zip(sharding.mesh.axis_names, getattr(sharding.mesh, "axis_types", ())))
        explicit = [a for d in dims(sharding.spec, x.ndim) for a in d if types.get(a) == AxisType.Explicit]
        if explicit:
            raise ShardingRuleError(
                f"operand sharded over Explicit mesh axes {explicit}: moegemm's partitioning rules need "
                "AxisType.Auto axes: jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)"
            )


def _high_precision(op: str, lhs, rhs) -> None:
    """The sharded ops quantize on each shard (fp8_recipe=): quantized operands would need their scales
    partitioned with them, which the rules do not do."""
    if isinstance(lhs, Fp8Array) or isinstance(rhs, Fp8Array):
        kinds = ", ".join(
            f"{n} is {'an Fp8Array' if isinstance(a, Fp8Array) else 'high precision'}"
            for n, a in (("lhs", lhs), ("rhs", rhs))
        )
        raise TypeError(
            f"{op} takes high-precision operands ({kinds}); for FP8 pass them unquantized with fp8_recipe=, "
            "which quantizes on each shard"
        )


# ---------------------------------------------------------------- m_grouped_mm (ragged_dot)


def _m_grouped_partition(ops, out_dtype, mesh, arg_shapes, result_shape):
    lhs, rhs, gs, *like = arg_shapes
    want = like[0].sharding if like else result_shape.sharding
    out_rows = dims(want.spec, 2)[0] if isinstance(want, NamedSharding) else ()
    shapes = (lhs.shape, rhs.shape)
    plan = plan_m_grouped(lhs.sharding.spec, rhs.sharding.spec, out_rows, dict(mesh.shape), shapes)
    args = (named(mesh, *plan.lhs), named(mesh, *plan.rhs), named(mesh, ()), *(x.sharding for x in like))

    def lower(lhs, rhs, group_sizes, *like):
        return m_grouped_local(plan, ops, out_dtype, lhs, rhs, group_sizes)

    return mesh, lower, named(mesh, *plan.out), args


def _m_grouped_infer(ops, out_dtype, mesh, arg_shapes, result_shape):
    lhs, rhs, _, *like = arg_shapes
    if like:
        return NamedSharding(mesh, like[0].sharding.spec)
    return named(mesh, *plan_m_grouped(lhs.sharding.spec, rhs.sharding.spec).out)


@partial(custom_partitioning, static_argnums=(3, 4))
def _m_grouped_mm(lhs, rhs, group_sizes, ops, out_dtype):
    return ops.ragged_dot(lhs, rhs, group_sizes, None, out_dtype).astype(out_dtype)


@partial(custom_partitioning, static_argnums=(4, 5))
def _m_grouped_mm_like(lhs, rhs, group_sizes, like, ops, out_dtype):
    return ops.ragged_dot(lhs, rhs, group_sizes, None, out_dtype).astype(out_dtype)


# _m_grouped_mm_like: the output should be sharded like `like` (the input gradient: like lhs). The
# weight's columns get their own factor w: tied to the output, Shardy propagates the weight's FSDP
# axis into the gradient's columns while its rows use that axis too, and XLA then rematerializes it.
for _op, _rule in (
    (_m_grouped_mm, "m k, g k n, s -> m n"),
    (_m_grouped_mm_like, "m k, g k w, s, m n -> m n"),
):
    _op.def_partition(
        partition=_m_grouped_partition,
        infer_sharding_from_operands=_m_grouped_infer,
        sharding_rule=_rule,
        reduction_factors=("k", "g"),
        need_replication_factors=("s",),
    )


# ---------------------------------------------------------------- k_grouped_mm (the weight gradient)


def _rows(x):
    """[..., R] -> [rows, R]: the leading dimensions flattened into rows."""
    return x.reshape(-1, x.shape[-1])


def _k_grouped_partition(ops, out_dtype, mesh, arg_shapes, result_shape):
    a, b, gs, like = arg_shapes
    *lead, _ = dims(a.sharding.spec, a.ndim)
    plan = plan_k_grouped(spec(tuple(x for d in lead for x in d)), b.sharding.spec, like.sharding.spec)
    args = (named(mesh, *lead, plan.a[1]), named(mesh, *lead, plan.b[1]), named(mesh, ()), like.sharding)
    num_groups = like.shape[0]

    def lower(a, b, group_sizes, like):
        return k_grouped_local(plan, ops, out_dtype, _rows(a), _rows(b), group_sizes, num_groups)

    return mesh, lower, named(mesh, *plan.out), args


def _k_grouped_infer(ops, out_dtype, mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, arg_shapes[3].sharding.spec)


def _k_grouped_rule(ops, out_dtype, mesh, operand_types, result_types):
    rows = tuple(f"m{i}" for i in range(len(operand_types[0].shape) - 1))
    r = " ".join(rows)
    return f"{r} k, {r} n, s, g k n -> g k n", {"reduction_factors": rows, "need_replication_factors": ("s",)}


@partial(custom_partitioning, static_argnums=(4, 5))
def k_grouped_mm_like(a, b, group_sizes, like, ops, out_dtype):
    """out [G, K, N] = for g: a[rows(g)]^T @ b[rows(g)], sharded like `like` [G, K, N] (the weight).

    a [..., M, K] and b [..., M, N]: leading dimensions are flattened into the rows. Kept apart, a
    row sharding over any of them needs no reshard (the dense weight gradient of lhs [B, M, K]
    sequence-parallel on M); a shard's rows are then not contiguous, so more than one leading
    dimension is for one group only.
    """
    return ops.k_grouped_mm(_rows(a), _rows(b), group_sizes, None, like.shape[0], out_dtype)


# `like` (the weight) only carries the sharding the gradient should have; the call never reads it.
k_grouped_mm_like.def_partition(
    partition=_k_grouped_partition,
    infer_sharding_from_operands=_k_grouped_infer,
    sharding_rule=_k_grouped_rule,
)


# ---------------------------------------------------------------- the differentiable op


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_dot(lhs, rhs, group_sizes, ops, out_dtype):
    return _m_grouped_mm(lhs, rhs, group_sizes, ops, out_dtype)


def _ragged_dot_fwd(lhs, rhs, group_sizes, ops, out_dtype):
    return _m_grouped_mm(lhs, rhs, group_sizes, ops, out_dtype), (lhs, rhs, group_sizes)


def _ragged_dot_bwd(ops, out_dtype, res, dout):
    lhs, rhs, group_sizes = res
    dlhs = _m_grouped_mm_like(dout, jnp.swapaxes(rhs, 1, 2), group_sizes, lhs, ops, lhs.dtype)
    drhs = k_grouped_mm_like(lhs, dout, group_sizes, rhs, ops, rhs.dtype)
    return dlhs, drhs, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    fp8_recipe: fp8.Recipe | None = None,
    fp8_dtype=jnp.float8_e4m3fn,
    backend: api.Backend = "auto",
    ops: LocalOps | None = None,
) -> jax.Array:
    """jax.lax.ragged_dot for sharded operands under jit: for g: out[rows(g)] = lhs[rows(g)] @ rhs[g].

    lhs [M, K], rhs [G, K, N], group_sizes int32 [G] (global, replicated) -> [M, N]. The shardings
    of lhs and rhs pick the collectives (``moegemm.jax.sharding``'s table); unservable ones raise
    ShardingRuleError at compile time. Differentiable in lhs and rhs; the weight gradient keeps
    rhs's sharding. The per-shard computation is moegemm's kernels on ``backend``
    (``moegemm_local_ops(backend)``), or ``ops``. ``fp8_recipe``: the same plans with FP8 local calls
    (quantized on the shard, scales reduced across the shards sharing them; ``moegemm.jax.sharding``'s
    FP8 rules), forward, dgrad and wgrad, straight through the quantization.
    """
    _high_precision("sharding.ragged_dot", lhs, rhs)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"want lhs [M, K], rhs [G, K, N], group_sizes [G]; got {lhs.shape}, {rhs.shape}, {group_sizes.shape}"
        )
    require_auto_axes(lhs, rhs)
    ops = resolve_ops(ops, backend, fp8_recipe, fp8_dtype)
    return _ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), ops, out_dtype)


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
        parts = _ops.quantize_activation(x, group_sizes, recipe, dtype, False, api._executor(backend), reduce)
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
    parts = _ops.quantize_activation(x, group_sizes, recipe, dtype, False, api._executor(backend))
    return parts.data, parts.scale


_quantize.def_partition(
    partition=_quantize_partition, infer_sharding_from_operands=_quantize_infer, sharding_rule=_quantize_rule
)


def quantize_fp8(
    x: jax.Array,
    recipe: fp8.Recipe,
    *,
    group_sizes: jax.Array,
    dtype=jnp.float8_e4m3fn,
    backend: api.Backend = "auto",
) -> Fp8Array:
    """The grouped quantize of activations x [M, K] sharded under jit (``moegemm.jax.quantize_fp8``'s
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
