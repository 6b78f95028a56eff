"""Plan algebra: pure functions from the operands' PartitionSpecs to per-shard plans.

A plan says which collectives run around one local call; :mod:`._per_shard` runs it. No devices and
no tracing here, so the rules are tested on specs alone. Axis tuples are major to minor.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]  # the mesh axes that shard one dimension, major to minor


class ShardingRuleError(ValueError):
    """The operand shardings ask for something the partitioning rules cannot serve (names the axes)."""


def dims(spec, ndim: int) -> tuple[Axes, ...]:
    """PartitionSpec -> one tuple of axis names per dimension."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def spec(*dim_axes: Axes) -> P:
    """One tuple of axis names per dimension -> PartitionSpec (the inverse of :func:`dims`)."""
    return P(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dim_axes))


def minus(axes: Axes, drop) -> Axes:
    return tuple(a for a in axes if a not in drop)


def _split_minor(axes: Axes, gather: Axes, what: str) -> Axes:
    """Axes kept after all-gathering `gather` out of a dimension sharded over `axes`.

    Gathering is contiguous only if the gathered axes are the minor ones of the dimension's tuple.
    """
    keep = minus(axes, gather)
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


# ---------------------------------------------------------------- m_grouped_mm (ragged_dot)


@dataclasses.dataclass(frozen=True)
class MGroupedPlan:
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


def plan_m_grouped(
    lhs_spec, rhs_spec, out_rows: Axes = (), mesh_shape: dict[str, int] | None = None, shapes=None
) -> MGroupedPlan:
    """The MGroupedPlan for lhs [M, K] sharded as lhs_spec and rhs [G, K, N] sharded as rhs_spec.

    out_rows: the axes the caller wants the output rows sharded over; a sharded contraction is
    reduce-scattered along M over those of its axes that appear there, all-reduced over the rest.
    With mesh_shape and shapes ((M, K), (G, K, N)), also checks that each dimension divides evenly.
    """
    m, kl = dims(lhs_spec, 2)
    g, kr, nr = dims(rhs_spec, 3)
    # FSDP: a weight dimension sharded over an axis that also shards the tokens is all-gathered.
    (fsdp_k, fsdp_n), (kr_keep, nr_keep) = split_weight_axes(kr, nr, fsdp_axes=m)
    # K: follow rhs; if rhs K is replicated, adopt lhs's K axes (rhs is then sliced locally, no comm).
    k = kr_keep or tuple(a for a in kl if a not in g + nr_keep + m)
    # EP: tokens sharded over an experts axis are all-gathered, and the output reduce-scattered back.
    row_gather = tuple(a for a in m if a in g)
    rows = _split_minor(m, row_gather, "lhs M (tokens; all-gathered over the expert axes)")
    scatter_k = tuple(a for a in k if a in out_rows)
    scatter = row_gather + scatter_k
    psum = minus(g, m) + minus(k, scatter_k)
    plan = MGroupedPlan(
        lhs=(m, k),
        rhs=(g, k + fsdp_k, nr_keep + fsdp_n),
        rhs_gather=(fsdp_k, fsdp_n),
        row_gather=row_gather,
        rows=rows,
        experts=g,
        psum=psum,
        scatter=scatter,
        out=(rows + scatter, nr_keep),
    )
    if mesh_shape is not None and shapes is not None:
        _check_divisible(plan, mesh_shape, shapes)
    return plan


def _check_divisible(plan: MGroupedPlan, mesh_shape, shapes):
    (M, K), (G, _, N) = shapes
    size = lambda axes: math.prod(mesh_shape[a] for a in axes)
    sharded = {"lhs M": (M, plan.rows + plan.scatter), "rhs G": (G, plan.experts)}
    sharded |= {"K": (K, plan.lhs[1]), "rhs N": (N, plan.out[1])}
    for what, (dim, axes) in sharded.items():
        if dim % size(axes):
            raise ShardingRuleError(f"{what}={dim} is not divisible by mesh axes {axes} (size {size(axes)})")


def out_spec(lhs_spec, rhs_spec, out_rows: Axes = ()) -> P:
    """The output PartitionSpec the rules give ragged_dot(lhs_spec, rhs_spec)."""
    return spec(*plan_m_grouped(lhs_spec, rhs_spec, out_rows).out)


# ---------------------------------------------------------------- k_grouped_mm (the weight gradient)


@dataclasses.dataclass(frozen=True)
class KGroupedPlan:
    """How out [G, K, N] = k_grouped_mm(a [M, K], b [M, N], group_sizes [G]) runs per shard.

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


def plan_k_grouped(a_spec, b_spec, like_spec) -> KGroupedPlan:
    """The KGroupedPlan for a [M, K] sharded as a_spec and b [M, N] as b_spec, out sharded as like_spec."""
    m, _ = dims(a_spec, 2)
    g, k, n = dims(like_spec, 3)
    scatter = tuple(tuple(x for x in d if x in m) for d in (g, k, n))
    keep = tuple(
        _split_minor(d, s, f"weight-gradient {name} (reduce-scattered over the token axes)")
        for d, s, name in zip((g, k, n), scatter, "GKN")
    )
    return KGroupedPlan(
        a=(m, keep[1]),
        b=(m, keep[2]),
        rows=m,
        experts=keep[0],
        psum=minus(m, g + k + n),
        scatter=scatter,
        out=(g, k, n),
    )
