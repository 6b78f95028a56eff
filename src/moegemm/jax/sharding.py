"""Partitioning rules for the grouped GEMMs: sharded inputs under jit, and the same plan inside shard_map.

The Triton kernels are opaque custom calls, so XLA cannot partition them. Each op here is a
``jax.experimental.custom_partitioning`` wrapper with a Shardy ``sharding_rule`` (for propagation)
and a ``partition`` callback that turns the operand shardings into a :class:`GmmPlan` (or
:class:`TgmmPlan`): which collectives to run around one local call. Rules (docs/sharding.md):

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
re-raised by XLA as JaxRuntimeError); no rule silently replicates an operand. Inside shard_map,
:func:`shard_map_ragged_dot` runs the same plans on the blocks, with the transposed plan as its
backward. The local computation is a parameter (:class:`LocalOps`): the jnp reference by default,
the Triton kernels through :func:`moegemm_local_ops`. Dense GEMMs: ``collective_gemm``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from moegemm.jax import reference as _ref

Axes = tuple[str, ...]  # the mesh axes that shard one dimension, major to minor


class ShardingRuleError(ValueError):
    """The operand shardings ask for something the partitioning rules cannot serve (names the axes)."""


# ----------------------------------------------------------------------------------------------
# Local computation


def _reference_ragged_dot(lhs, rhs, group_sizes, group_offset, preferred_element_type):
    return _ref.ragged_dot_reference(
        lhs, rhs, group_sizes, group_offset=group_offset, out_dtype=preferred_element_type
    )


def _reference_k_grouped(a, b, group_sizes, group_offset, num_groups, out_dtype):
    """a [M, K], b [M, N] -> [num_groups, K, N]: groups group_offset .. group_offset + num_groups - 1."""
    if group_offset is None:
        return _ref.k_grouped_mm_reference(a, b, group_sizes, out_dtype=out_dtype)
    first_row, local_sizes = _ref.local_groups(group_sizes, group_offset, num_groups, a.shape[0])
    sizes = jnp.concatenate([first_row[None], local_sizes])  # rows before the local groups: dropped
    return _ref.k_grouped_mm_reference(a, b, sizes, out_dtype=out_dtype)[1:]


@dataclasses.dataclass(frozen=True)
class LocalOps:
    """The per-shard computation the collectives wrap (hashable: it is a static argument).

    ragged_dot(lhs [M, K], rhs [G_local, K, N], group_sizes [G_total], group_offset int32 [] or
        None, preferred_element_type) -> [M, N]; rows of groups outside [offset, offset + G_local)
        are 0 (moegemm.jax.ragged_dot's contract).
    k_grouped(a [M, K], b [M, N], group_sizes [G_total], group_offset or None, num_groups,
        out_dtype) -> [num_groups, K, N]; for j: out[j] = a[rows(offset + j)]^T @ b[rows(offset + j)].
    """

    ragged_dot: Callable = _reference_ragged_dot
    k_grouped: Callable = _reference_k_grouped
    name: str = "reference"


REFERENCE_OPS = LocalOps()


@functools.cache
def moegemm_local_ops(backend: str = "auto") -> LocalOps:
    """LocalOps running ``moegemm.jax``'s kernels (ragged_dot with group_offset, k_grouped_mm)."""
    from moegemm.jax import api

    def ragged_dot(lhs, rhs, group_sizes, group_offset, preferred_element_type):
        return api.ragged_dot(
            lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
            group_offset=group_offset, backend=backend,
        )  # fmt: skip

    def k_grouped(a, b, group_sizes, group_offset, num_groups, out_dtype):
        if group_offset is None:
            return api.k_grouped_mm(a, b, group_sizes, out_dtype=out_dtype, backend=backend)
        # Roll the local groups' rows to the top: rows past them fall outside every local group.
        first_row, local_sizes = _ref.local_groups(group_sizes, group_offset, num_groups, a.shape[0])
        a, b = jnp.roll(a, -first_row, axis=0), jnp.roll(b, -first_row, axis=0)
        return api.k_grouped_mm(a, b, local_sizes, out_dtype=out_dtype, backend=backend)

    return LocalOps(ragged_dot, k_grouped, name=f"moegemm-{backend}")


# ----------------------------------------------------------------------------------------------
# Plans: pure functions of the operand specs, shared by the jit partitioner and shard_map


def _dims(spec, ndim: int) -> tuple[Axes, ...]:
    """PartitionSpec -> one tuple of axis names per dimension."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _spec(*dims: Axes) -> P:
    return P(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims))


def _minus(axes: Axes, drop) -> Axes:
    return tuple(a for a in axes if a not in drop)


def _split_minor(axes: Axes, gather: Axes, what: str) -> Axes:
    """Axes kept after all-gathering `gather` out of a dimension sharded over `axes`.

    Gathering is contiguous only if the gathered axes are the minor ones of the dimension's tuple.
    """
    keep = _minus(axes, gather)
    if axes != keep + tuple(a for a in axes if a in gather):
        raise ShardingRuleError(
            f"{what} is sharded over mesh axes {axes}; the rules all-gather {gather} out of it, "
            f"which must be its minor (last) axes. Reorder the PartitionSpec to {keep + gather}."
        )
    return keep


def split_weight_axes(k: Axes, n: Axes, fsdp_axes: Axes) -> tuple[tuple[Axes, Axes], tuple[Axes, Axes]]:
    """((FSDP axes to all-gather out of K, N), (axes K, N keep)) for a weight sharded K over k, N over n.

    The axes in fsdp_axes (those sharding the activation's batch) are FSDP; they must be minor.
    What remains may shard K or N, not both: ShardingRuleError names the axes.
    """
    fsdp = tuple(a for a in k if a in fsdp_axes), tuple(a for a in n if a in fsdp_axes)
    keep = (
        _split_minor(k, fsdp[0], "rhs K (FSDP all-gather)"),
        _split_minor(n, fsdp[1], "rhs N (FSDP all-gather)"),
    )
    if keep[0] and keep[1]:
        raise ShardingRuleError(
            f"rhs is sharded over mesh axes {keep[0]} on K and {keep[1]} on N; the rules serve a "
            "sharded K or a sharded N, not both. Replicate one of them (or shard the batch on it: FSDP)."
        )
    return fsdp, keep


@dataclasses.dataclass(frozen=True)
class GmmPlan:
    """How out [M, N] = ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G]) runs per shard.

    lhs, rhs: the operand specs the local function receives (one Axes per dimension).
    rhs_gather: FSDP axes all-gathered out of rhs (K, N) before the call.
    row_gather: EP axes all-gathered out of lhs M (tokens sharded over the experts' axis).
    rows: axes that shard lhs M during the call; the shard owns rows [i * M_loc, (i + 1) * M_loc).
    experts: axes that shard rhs G; the shard owns groups [j * G_loc, (j + 1) * G_loc).
    psum: axes the partial output is all-reduced over; scatter: axes it is reduce-scattered over
    along M (in this order, after `rows`). out: the output spec.
    """

    lhs: tuple[Axes, Axes]
    rhs: tuple[Axes, Axes, Axes]
    rhs_gather: tuple[Axes, Axes]
    row_gather: Axes
    rows: Axes
    experts: Axes
    psum: Axes
    scatter: Axes
    out: tuple[Axes, Axes]

    @property
    def reduces(self) -> bool:
        return bool(self.psum or self.scatter)


def plan_gmm(
    lhs_spec, rhs_spec, out_rows: Axes = (), mesh_shape: dict[str, int] | None = None, shapes=None
) -> GmmPlan:
    """The GmmPlan for lhs [M, K] sharded as lhs_spec and rhs [G, K, N] sharded as rhs_spec.

    out_rows: the axes the caller wants the output rows sharded over; a sharded contraction is
    reduce-scattered along M over those of its axes that appear there, all-reduced over the rest.
    """
    m, kl = _dims(lhs_spec, 2)
    g, kr, nr = _dims(rhs_spec, 3)
    # FSDP: a weight dimension sharded over an axis that also shards the tokens is all-gathered.
    (fsdp_k, fsdp_n), (kr_keep, nr_keep) = split_weight_axes(kr, nr, fsdp_axes=m)
    # K: follow rhs; if rhs K is replicated, adopt lhs's K axes (rhs is then sliced locally, no comm).
    k = kr_keep or tuple(a for a in kl if a not in g + nr_keep + m)
    # EP: tokens sharded over an experts axis are all-gathered, and the output reduce-scattered back.
    row_gather = tuple(a for a in m if a in g)
    rows = _split_minor(m, row_gather, "lhs M (tokens; all-gathered over the expert axes)")
    scatter_k = tuple(a for a in k if a in out_rows)
    scatter = row_gather + scatter_k
    psum = _minus(g, m) + _minus(k, scatter_k)
    plan = GmmPlan(
        lhs=(m, k), rhs=(g, k + fsdp_k, nr_keep + fsdp_n), rhs_gather=(fsdp_k, fsdp_n),
        row_gather=row_gather, rows=rows, experts=g, psum=psum, scatter=scatter,
        out=(rows + scatter, nr_keep),
    )  # fmt: skip
    if mesh_shape is not None and shapes is not None:
        _check_divisible(plan, mesh_shape, shapes)
    return plan


def _check_divisible(plan: GmmPlan, mesh_shape, shapes):
    (M, K), (G, _, N) = shapes
    size = lambda axes: math.prod(mesh_shape[a] for a in axes)
    for what, dim, axes in (
        ("lhs M", M, plan.rows + plan.scatter), ("rhs G", G, plan.experts),
        ("K", K, plan.lhs[1]), ("rhs N", N, plan.out[1]),
    ):  # fmt: skip
        if dim % size(axes):
            raise ShardingRuleError(f"{what}={dim} is not divisible by mesh axes {axes} (size {size(axes)})")


def _linear_index(axes: Axes):
    """This shard's index along a dimension sharded over `axes` (major to minor)."""
    index = jnp.int32(0)
    for a in axes:
        index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return index


def shard_group_sizes(group_sizes: jax.Array, row_start, M_local: int) -> jax.Array:
    """Sizes of the global groups restricted to rows [row_start, row_start + M_local).

    group_sizes=[3, 0, 4] (M=8, rows 7.. unowned), row_start=4, M_local=4 -> [0, 0, 3].
    """
    starts, ends = _ref.group_bounds(group_sizes, jnp.iinfo(jnp.int32).max)
    clip = lambda x: jnp.clip(x - row_start, 0, M_local)
    return clip(ends) - clip(starts)


def _all_gather(x, axes: Axes, axis: int):
    return jax.lax.all_gather(x, axes, axis=axis, tiled=True) if axes else x


def _local_groups(rows: Axes, experts: Axes, group_sizes, M_local: int, G_local: int):
    """(group sizes clipped to this shard's rows, group_offset of its experts or None)."""
    if rows:
        group_sizes = shard_group_sizes(group_sizes, _linear_index(rows) * M_local, M_local)
    return group_sizes, _linear_index(experts) * G_local if experts else None


def _gmm_gather(plan: GmmPlan, lhs, rhs, group_sizes):
    """The plan's all-gathers: (lhs rows, rhs, local group sizes, group_offset) for the local call."""
    rhs = _all_gather(_all_gather(rhs, plan.rhs_gather[0], 1), plan.rhs_gather[1], 2)
    lhs = _all_gather(lhs, plan.row_gather, 0)
    return lhs, rhs, *_local_groups(plan.rows, plan.experts, group_sizes, lhs.shape[0], rhs.shape[0])


def gmm_local(plan: GmmPlan, ops: LocalOps, out_dtype, lhs, rhs, group_sizes):
    """Run `plan` on this shard's blocks (inside a partitioned computation or shard_map)."""
    lhs, rhs, group_sizes, offset = _gmm_gather(plan, lhs, rhs, group_sizes)
    acc = jnp.float32 if plan.reduces else out_dtype
    out = ops.ragged_dot(lhs, rhs, group_sizes, offset, acc)
    if plan.psum:
        out = jax.lax.psum(out, plan.psum)
    if plan.scatter:
        out = jax.lax.psum_scatter(out, plan.scatter, scatter_dimension=0, tiled=True)
    return out.astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class TgmmPlan:
    """How out [G, K, N] = k_grouped(a [M, K], b [M, N], group_sizes [G]) runs per shard.

    The output takes the sharding of `like` (the weight whose gradient this is). a, b: the specs
    the local function receives. rows: axes sharding M (a contraction: reduced over). experts:
    axes sharding the locally computed G. psum: row axes not in the output; scatter: per output
    dimension, the row axes it is reduce-scattered over (FSDP weight-gradient reduce-scatter).
    """

    a: tuple[Axes, Axes]
    b: tuple[Axes, Axes]
    rows: Axes
    experts: Axes
    psum: Axes
    scatter: tuple[Axes, Axes, Axes]
    out: tuple[Axes, Axes, Axes]


def plan_tgmm(a_spec, b_spec, like_spec) -> TgmmPlan:
    m, _ = _dims(a_spec, 2)
    g, k, n = _dims(like_spec, 3)
    scatter = tuple(tuple(x for x in d if x in m) for d in (g, k, n))
    keep = tuple(
        _split_minor(d, s, f"weight-gradient {name} (reduce-scattered over the token axes)")
        for d, s, name in zip((g, k, n), scatter, "GKN")
    )
    return TgmmPlan(
        a=(m, keep[1]), b=(m, keep[2]), rows=m, experts=keep[0],
        psum=_minus(m, g + k + n), scatter=scatter, out=(g, k, n),
    )  # fmt: skip


def tgmm_local(plan: TgmmPlan, ops: LocalOps, out_dtype, a, b, group_sizes, num_groups: int):
    G_local = num_groups // math.prod(jax.lax.axis_size(x) for x in plan.experts)
    group_sizes, offset = _local_groups(plan.rows, plan.experts, group_sizes, a.shape[0], G_local)
    out = ops.k_grouped(a, b, group_sizes, offset, G_local, jnp.float32)
    if plan.psum:
        out = jax.lax.psum(out, plan.psum)
    for dim, axes in enumerate(plan.scatter):
        if axes:
            out = jax.lax.psum_scatter(out, axes, scatter_dimension=dim, tiled=True)
    return out.astype(out_dtype)


# ----------------------------------------------------------------------------------------------
# custom_partitioning: jit with sharded operands


def _named(mesh, *dims):
    return NamedSharding(mesh, _spec(*dims))


def _gmm_partition(ops, out_dtype, mesh, arg_shapes, result_shape):
    lhs, rhs, gs, *like = arg_shapes
    want = like[0].sharding if like else result_shape.sharding
    out_rows = _dims(want.spec, 2)[0] if isinstance(want, NamedSharding) else ()
    plan = plan_gmm(lhs.sharding.spec, rhs.sharding.spec, out_rows, dict(mesh.shape), (lhs.shape, rhs.shape))
    args = (_named(mesh, *plan.lhs), _named(mesh, *plan.rhs), _named(mesh, ()), *(x.sharding for x in like))

    def lower(lhs, rhs, group_sizes, *like):
        return gmm_local(plan, ops, out_dtype, lhs, rhs, group_sizes)

    return mesh, lower, _named(mesh, *plan.out), args


def _gmm_infer(ops, out_dtype, mesh, arg_shapes, result_shape):
    lhs, rhs, _, *like = arg_shapes
    if like:
        return NamedSharding(mesh, like[0].sharding.spec)
    return _named(mesh, *plan_gmm(lhs.sharding.spec, rhs.sharding.spec).out)


@partial(custom_partitioning, static_argnums=(3, 4))
def _gmm(lhs, rhs, group_sizes, ops, out_dtype):
    return ops.ragged_dot(lhs, rhs, group_sizes, None, out_dtype).astype(out_dtype)


_gmm.def_partition(
    partition=_gmm_partition,
    infer_sharding_from_operands=_gmm_infer,
    sharding_rule="m k, g k n, s -> m n",
    reduction_factors=("k", "g"),
    need_replication_factors=("s",),
)


@partial(custom_partitioning, static_argnums=(4, 5))
def _gmm_like(lhs, rhs, group_sizes, like, ops, out_dtype):
    return ops.ragged_dot(lhs, rhs, group_sizes, None, out_dtype).astype(out_dtype)


# _gmm whose output should be sharded like `like` (the input gradient: like lhs). The weight's
# columns get their own factor w: tied to the output, Shardy propagates the weight's FSDP axis into
# the gradient's columns while its rows use that axis too, and XLA then rematerializes the gradient.
_gmm_like.def_partition(
    partition=_gmm_partition,
    infer_sharding_from_operands=_gmm_infer,
    sharding_rule="m k, g k w, s, m n -> m n",
    reduction_factors=("k", "g"),
    need_replication_factors=("s",),
)


def _tgmm_partition(ops, out_dtype, mesh, arg_shapes, result_shape):
    a, b, gs, like = arg_shapes
    plan = plan_tgmm(a.sharding.spec, b.sharding.spec, like.sharding.spec)
    args = (_named(mesh, *plan.a), _named(mesh, *plan.b), _named(mesh, ()), like.sharding)
    num_groups = like.shape[0]

    def lower(a, b, group_sizes, like):
        return tgmm_local(plan, ops, out_dtype, a, b, group_sizes, num_groups)

    return mesh, lower, _named(mesh, *plan.out), args


def _tgmm_infer(ops, out_dtype, mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, arg_shapes[3].sharding.spec)


@partial(custom_partitioning, static_argnums=(4, 5))
def _tgmm(a, b, group_sizes, like, ops, out_dtype):
    return ops.k_grouped(a, b, group_sizes, None, like.shape[0], out_dtype)


# `like` (the weight) only carries the sharding the gradient should have; the call never reads it.
_tgmm.def_partition(
    partition=_tgmm_partition,
    infer_sharding_from_operands=_tgmm_infer,
    sharding_rule="m k, m n, s, g k n -> g k n",
    reduction_factors=("m",),
    need_replication_factors=("s",),
)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _sharded_gmm(lhs, rhs, group_sizes, ops, out_dtype):
    return _gmm(lhs, rhs, group_sizes, ops, out_dtype)


def _sharded_gmm_fwd(lhs, rhs, group_sizes, ops, out_dtype):
    return _gmm(lhs, rhs, group_sizes, ops, out_dtype), (lhs, rhs, group_sizes)


def _sharded_gmm_bwd(ops, out_dtype, res, dout):
    lhs, rhs, group_sizes = res
    dlhs = _gmm_like(dout, jnp.swapaxes(rhs, 1, 2), group_sizes, lhs, ops, lhs.dtype)
    drhs = _tgmm(lhs, dout, group_sizes, rhs, ops, rhs.dtype)
    return dlhs, drhs, None


_sharded_gmm.defvjp(_sharded_gmm_fwd, _sharded_gmm_bwd)


def ragged_dot(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
    preferred_element_type=None, ops: LocalOps = REFERENCE_OPS,
) -> jax.Array:  # fmt: skip
    """jax.lax.ragged_dot for sharded operands under jit: for g: out[rows(g)] = lhs[rows(g)] @ rhs[g].

    lhs [M, K], rhs [G, K, N], group_sizes int32 [G] (global, replicated) -> [M, N]. The shardings
    of lhs and rhs pick the collectives (module docstring); unservable ones raise ShardingRuleError
    at compile time. Differentiable in lhs and rhs; the weight gradient keeps rhs's sharding.
    """
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"want lhs [M, K], rhs [G, K, N], group_sizes [G]; got {lhs.shape}, {rhs.shape}, "
                         f"{group_sizes.shape}")  # fmt: skip
    _require_auto_axes(lhs, rhs)
    return _sharded_gmm(lhs, rhs, group_sizes.astype(jnp.int32), ops, out_dtype)


def _require_auto_axes(*arrays):
    """custom_partitioning traces its body with explicit-axis shardings in the types, where the
    reference's contractions over sharded dimensions are ambiguous: ask for Auto axes instead."""
    for x in arrays:
        sharding = jax.typeof(x).sharding
        types = dict(zip(sharding.mesh.axis_names, getattr(sharding.mesh, "axis_types", ())))
        explicit = [a for d in _dims(sharding.spec, x.ndim) for a in d if types.get(a) == AxisType.Explicit]
        if explicit:
            raise ShardingRuleError(
                f"operand sharded over Explicit mesh axes {explicit}: moegemm's partitioning rules need "
                "AxisType.Auto axes: jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)"
            )


# ----------------------------------------------------------------------------------------------
# shard_map: the same plans, with the specs given explicitly


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _shard_map_gmm(lhs, rhs, group_sizes, plan, ops, out_dtype):
    return gmm_local(plan, ops, out_dtype, lhs, rhs, group_sizes)


def _shard_map_gmm_fwd(lhs, rhs, group_sizes, plan, ops, out_dtype):
    return gmm_local(plan, ops, out_dtype, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _shard_map_gmm_bwd(plan, ops, out_dtype, res, dout):
    """The transpose of gmm_local, collective by collective, with a k-grouped weight gradient.

    psum_scatter -> all-gather, psum -> nothing (the cotangent is already replicated), all-gather
    -> psum_scatter; then _match_vma sums each gradient over the manual axes its operand is
    replicated on. With the tokens sharded as lhs_spec says, this runs the jit backward's collectives.
    """
    lhs, rhs, group_sizes = res
    lhs_full, rhs_full, group_sizes, offset = _gmm_gather(plan, lhs, rhs, group_sizes)
    dout = _all_gather(dout, plan.scatter, 0)
    dlhs = ops.ragged_dot(dout, jnp.swapaxes(rhs_full, 1, 2), group_sizes, offset, jnp.float32)
    drhs = ops.k_grouped(lhs_full, dout, group_sizes, offset, rhs_full.shape[0], jnp.float32)
    if plan.row_gather:
        dlhs = jax.lax.psum_scatter(dlhs, plan.row_gather, scatter_dimension=0, tiled=True)
    for dim, axes in ((1, plan.rhs_gather[0]), (2, plan.rhs_gather[1])):
        if axes:
            drhs = jax.lax.psum_scatter(drhs, axes, scatter_dimension=dim, tiled=True)
    dlhs, drhs = _match_vma(dlhs, lhs).astype(lhs.dtype), _match_vma(drhs, rhs).astype(rhs.dtype)
    return dlhs, drhs, None


_shard_map_gmm.defvjp(_shard_map_gmm_fwd, _shard_map_gmm_bwd)


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
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, lhs_spec, rhs_spec, out_rows: Axes = (),
    preferred_element_type=None, ops: LocalOps = REFERENCE_OPS,
) -> jax.Array:  # fmt: skip
    """Inside shard_map: lhs/rhs are this shard's blocks of arrays sharded as lhs_spec/rhs_spec.

    Runs the plans the jit partitioner would pick, forward and backward (same collectives, same
    result); the output is this shard's block of out_spec(lhs_spec, rhs_spec, out_rows).
    group_sizes is global (all G groups) and replicated.
    """
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    plan = plan_gmm(lhs_spec, rhs_spec, out_rows)
    if plan.lhs != _dims(lhs_spec, 2) or plan.rhs != _dims(rhs_spec, 3):
        raise ShardingRuleError(
            f"under shard_map the blocks must already be laid out as the rules want: lhs {_spec(*plan.lhs)}, "
            f"rhs {_spec(*plan.rhs)} (got {lhs_spec}, {rhs_spec})"
        )
    return _shard_map_gmm(lhs, rhs, group_sizes.astype(jnp.int32), plan, ops, out_dtype)


def out_spec(lhs_spec, rhs_spec, out_rows: Axes = ()) -> P:
    """The output PartitionSpec the rules give ragged_dot(lhs_spec, rhs_spec)."""
    return _spec(*plan_gmm(lhs_spec, rhs_spec, out_rows).out)


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# On GPU, XLA emits async collectives whose result is a tuple ("(bf16[..], bf16[..]) all-gather-start("),
# so the op is matched on its own and the shape is the last array type before it (the result's).
_HLO_COLLECTIVE = re.compile(r"= .* (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives_in_hlo(text: str) -> list[dict]:
    """[{op, shape, group_size}] for each collective in compiled HLO text (shape: its result's).

    Use: collectives_in_hlo(jax.jit(f).lower(*args).compile().as_text()).
    """
    found = []
    for line in text.splitlines():
        match = _HLO_COLLECTIVE.search(line)
        if match:
            groups = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
            iota = re.search(r"replica_groups=\[\d+,(\d+)\]<=", line)  # iota form: [num_groups,size]<=[n]
            size = len(groups.group(1).split(",")) if groups else int(iota.group(1)) if iota else None
            dims = re.findall(r"\w+\[([\d,]*)\]", line[: match.start(1)])[-1]
            shape = [int(d) for d in dims.split(",") if d]
            found.append({"op": match.group(1), "shape": shape, "group_size": size})
    return found


__all__: Sequence[str] = (
    "collectives_in_hlo",
    "LocalOps",
    "REFERENCE_OPS",
    "GmmPlan",
    "TgmmPlan",
    "ShardingRuleError",
    "moegemm_local_ops",
    "out_spec",
    "plan_gmm",
    "plan_tgmm",
    "ragged_dot",
    "shard_group_sizes",
    "shard_map_ragged_dot",
)
