"""Dense GEMM with TransformerEngine-style collective-GEMM partitioning rules.

out ([B,] M, N) = lhs ([B,] M, K) @ rhs ([B,] K, N), or rhs stored ([B,] N, K) with rhs_layout="nk".
Rules, given the operand shardings (docs/sharding.md):

- B: keep lhs's B partitioning (rhs B follows it);
- FSDP: a weight K or N dimension sharded over one of lhs's B axes is all-gathered;
- rhs sharded on both K and N (after FSDP): ShardingRuleError naming the axes;
- K: lhs's K partitioning is forced to rhs's (if rhs K is replicated, rhs adopts lhs's: a local slice);
- M: lhs M axes that shard rhs's K or N are all-gathered (sequence parallelism), other M axes stay;
- out: psum over the K axes if lhs M was not partitioned, psum_scatter along M if it was.

The weight gradient of an unbatched rhs goes through sharding's k-grouped rule with one group (lhs
and dout kept [B, M, *], so their M sharding needs no reshard), so FSDP weights get a
reduce-scattered gradient.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

from moegemm.jax.sharding._local_ops import REFERENCE_OPS
from moegemm.jax.sharding._partition import k_grouped_mm_like, named, require_auto_axes
from moegemm.jax.sharding._per_shard import all_gather
from moegemm.jax.sharding._plans import Axes, ShardingRuleError, dims, minus, spec, split_weight_axes

__all__ = ["DENSE_REFERENCE_OPS", "DensePlan", "dense", "plan_dense", "shard_map_dense"]


def _reference_matmul(lhs, rhs, preferred_element_type):
    """lhs [..., M, K] @ rhs [..., K, N] in fp32 (HIGHEST), cast to preferred_element_type."""
    out = jnp.matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(preferred_element_type)


def _matmul_as_k_grouped_mm(a, b, group_sizes, group_offset, num_groups, out_dtype):
    """One group holding every row: out [1, K, N] = a^T @ b (the dense weight gradient)."""
    del group_sizes, group_offset, num_groups
    return _reference_matmul(a.T, b, out_dtype)[None]


DENSE_REFERENCE_OPS = dataclasses.replace(
    REFERENCE_OPS, k_grouped_mm=_matmul_as_k_grouped_mm, name="dense-reference"
)


@dataclasses.dataclass(frozen=True)
class DensePlan:
    """Per-shard recipe for the dense GEMM (canonical rhs order ([B,] K, N)).

    lhs, rhs: specs the local call receives (rhs canonical); rhs_gather: FSDP axes all-gathered out
    of rhs (K, N); psum / scatter: axes the partial output is all-reduced / reduce-scattered (along
    M) over; out: the output spec.
    """

    lhs: tuple[Axes, ...]
    rhs: tuple[Axes, ...]
    rhs_gather: tuple[Axes, Axes]
    psum: Axes
    scatter: Axes
    out: tuple[Axes, ...]


def plan_dense(lhs_spec, rhs_spec, lhs_ndim: int, rhs_ndim: int, rhs_layout: str = "kn") -> DensePlan:
    *b, m, kl = dims(lhs_spec, lhs_ndim)
    *_, r1, r2 = dims(rhs_spec, rhs_ndim)
    kr, nr = (r1, r2) if rhs_layout == "kn" else (r2, r1)
    batch = tuple(a for d in b for a in d)
    (fsdp_k, fsdp_n), (kr_keep, nr_keep) = split_weight_axes(kr, nr, fsdp_axes=batch)
    k = kr_keep or tuple(a for a in kl if a not in batch + m + nr_keep)
    m_keep = minus(m, k + nr_keep)  # all-gather LHS along M where the weight uses the axis
    scatter = k if m else ()
    psum = () if m else k
    rhs_b = tuple(b) if rhs_ndim == lhs_ndim else ()
    return DensePlan(
        lhs=(*b, m_keep, k),
        rhs=(*rhs_b, k + fsdp_k, nr_keep + fsdp_n),
        rhs_gather=(fsdp_k, fsdp_n),
        psum=psum,
        scatter=scatter,
        out=(*b, m_keep + scatter, nr_keep),
    )


def _dense_local(plan: DensePlan, matmul: Callable, out_dtype, lhs, rhs):
    """Run `plan` on this shard's blocks; rhs is canonical ([B,] K, N)."""
    rhs = all_gather(all_gather(rhs, plan.rhs_gather[0], rhs.ndim - 2), plan.rhs_gather[1], rhs.ndim - 1)
    reduces = bool(plan.psum or plan.scatter)
    out = matmul(lhs, rhs, jnp.float32 if reduces else out_dtype)
    if plan.psum:
        out = jax.lax.psum(out, plan.psum)
    if plan.scatter:
        out = jax.lax.psum_scatter(out, plan.scatter, scatter_dimension=out.ndim - 2, tiled=True)
    return out.astype(out_dtype)


def _swap_kn(x, rhs_layout):
    """Stored rhs layout <-> canonical ([B,] K, N): swaps the last two axes for "nk" (its own inverse)."""
    return x if rhs_layout == "kn" else jnp.swapaxes(x, -1, -2)


def _stored(dim_axes: tuple[Axes, ...], rhs_layout) -> tuple[Axes, ...]:
    return dim_axes if rhs_layout == "kn" else (*dim_axes[:-2], dim_axes[-1], dim_axes[-2])


def _n_axes_to_move_to_m(out: tuple[Axes, ...], wanted: tuple[Axes, ...]) -> Axes:
    """The minor axes of out's N that `wanted` has as the minor axes of M instead, and nothing else
    differs; () if `wanted` is not such a move.

    Sequence parallelism all-gathers lhs along M and shards out on N over the weight's axis, while
    Shardy may propagate that axis to out's M (from lhs, through the backward): out=((), (), ("tp",)),
    wanted=((), ("tp",), ()) -> ("tp",). The partition callback then moves the axis with one
    all-to-all; declaring N and leaving the reshard to XLA makes it warn "Involuntary full
    rematerialization" (jax 0.11). The same move, read backwards, takes an operand propagated with
    M where the plan wants K: _n_axes_to_move_to_m(plan.lhs, lhs's dims).
    """
    *b, m, n = out
    *wb, wm, wn = wanted
    moved = wm[len(m) :]
    if not moved or tuple(b) != tuple(wb) or wm[: len(m)] != m or n != wn + moved:
        return ()
    return moved


def _dense_partition(matmul, rhs_layout, out_dtype, mesh, arg_shapes, result_shape):
    lhs, rhs = arg_shapes
    plan = plan_dense(lhs.sharding.spec, rhs.sharding.spec, lhs.ndim, rhs.ndim, rhs_layout)
    M, size = lhs.shape[-2], math.prod(mesh.shape[a] for a in plan.out[-2])
    if M % size:
        raise ShardingRuleError(f"lhs M={M} is not divisible by mesh axes {plan.out[-2]} (size {size})")
    # lhs sharded on M over the K axes the plan wants (the dgrad of sequence parallelism: dout's M
    # over tp, the weight's N): move them to K here, rather than demand K and leave XLA the reshard.
    lhs_in = dims(lhs.sharding.spec, lhs.ndim)
    lhs_moved = _n_axes_to_move_to_m(plan.lhs, lhs_in)
    if lhs.shape[-1] % math.prod(mesh.shape[a] for a in plan.lhs[-1]):
        lhs_moved = ()
    out, moved = plan.out, ()
    if isinstance(result_shape.sharding, NamedSharding):
        moved = _n_axes_to_move_to_m(plan.out, dims(result_shape.sharding.spec, lhs.ndim))
        if (M // size) % math.prod(mesh.shape[a] for a in moved):
            moved = ()
        out = (*plan.out[:-2], plan.out[-2] + moved, plan.out[-1][: len(plan.out[-1]) - len(moved)])

    def lower(lhs, rhs):
        if lhs_moved:
            lhs = jax.lax.all_to_all(lhs, lhs_moved, lhs.ndim - 1, lhs.ndim - 2, tiled=True)
        result = _dense_local(plan, matmul, out_dtype, lhs, _swap_kn(rhs, rhs_layout))
        if moved:
            result = jax.lax.all_to_all(result, moved, result.ndim - 2, result.ndim - 1, tiled=True)
        return result

    args = (named(mesh, *(lhs_in if lhs_moved else plan.lhs)), named(mesh, *_stored(plan.rhs, rhs_layout)))
    return mesh, lower, named(mesh, *out), args


def _dense_infer(matmul, rhs_layout, out_dtype, mesh, arg_shapes, result_shape):
    lhs, rhs = arg_shapes
    return named(mesh, *plan_dense(lhs.sharding.spec, rhs.sharding.spec, lhs.ndim, rhs.ndim, rhs_layout).out)


def _dense_rule(matmul, rhs_layout, out_dtype, mesh, operand_types, result_types):
    lhs_ndim, rhs_ndim = (len(t.shape) for t in operand_types)
    b = " ".join(f"b{i}" for i in range(lhs_ndim - 2))
    rb = b if rhs_ndim == lhs_ndim else ""
    rhs = "k n" if rhs_layout == "kn" else "n k"
    return f"{b} m k, {rb} {rhs} -> {b} m n", {"reduction_factors": ("k",)}


@partial(custom_partitioning, static_argnums=(2, 3, 4))
def _dense(lhs, rhs, matmul, rhs_layout, out_dtype):
    return matmul(lhs, _swap_kn(rhs, rhs_layout), out_dtype).astype(out_dtype)


_dense.def_partition(
    partition=_dense_partition, infer_sharding_from_operands=_dense_infer, sharding_rule=_dense_rule
)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dense_vjp(lhs, rhs, matmul, rhs_layout, out_dtype):
    return _dense(lhs, rhs, matmul, rhs_layout, out_dtype)


def _dense_vjp_fwd(lhs, rhs, matmul, rhs_layout, out_dtype):
    return _dense(lhs, rhs, matmul, rhs_layout, out_dtype), (lhs, rhs)


def _dense_vjp_bwd(matmul, rhs_layout, out_dtype, res, dout):
    lhs, rhs = res
    # dlhs = dout @ rhs^T: the stored rhs read in the other layout.
    dlhs = _dense(dout, rhs, matmul, "nk" if rhs_layout == "kn" else "kn", lhs.dtype)
    if rhs.ndim == lhs.ndim:  # batched weights: a batched GEMM contracting M
        drhs = _dense(jnp.swapaxes(lhs, -1, -2), dout, matmul, "kn", rhs.dtype)
        return dlhs, _swap_kn(drhs, rhs_layout)
    like = _swap_kn(rhs, rhs_layout)[None]
    gs = jnp.full((1,), math.prod(lhs.shape[:-1]), jnp.int32)
    drhs = k_grouped_mm_like(lhs, dout, gs, like, DENSE_REFERENCE_OPS, rhs.dtype)[0]
    return dlhs, _swap_kn(drhs, rhs_layout)


_dense_vjp.defvjp(_dense_vjp_fwd, _dense_vjp_bwd)


def dense(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    rhs_layout: str = "kn",
    preferred_element_type=None,
    matmul: Callable = _reference_matmul,
) -> jax.Array:
    """Collective GEMM under jit: out ([B,] M, N) = lhs ([B,] M, K) @ rhs ([B,] K, N) (or rhs ([B,] N, K)^T).

    matmul(lhs, rhs [.., K, N], preferred_element_type) is the local computation (hashable).
    """
    if rhs_layout not in ("kn", "nk"):
        raise ValueError(f"rhs_layout must be 'kn' or 'nk', got {rhs_layout!r}")
    if lhs.ndim not in (2, 3) or rhs.ndim not in (2, lhs.ndim):
        raise ValueError(f"want lhs ([B,] M, K) and rhs ([B,] K, N); got {lhs.shape}, {rhs.shape}")
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    require_auto_axes(lhs, rhs)
    return _dense_vjp(lhs, rhs, matmul, rhs_layout, out_dtype)


def shard_map_dense(
    lhs,
    rhs,
    *,
    lhs_spec,
    rhs_spec,
    rhs_layout: str = "kn",
    preferred_element_type=None,
    matmul: Callable = _reference_matmul,
):
    """Inside shard_map: run the plan the jit partitioner would pick on this shard's blocks."""
    plan = plan_dense(lhs_spec, rhs_spec, lhs.ndim, rhs.ndim, rhs_layout)
    if plan.lhs != dims(lhs_spec, lhs.ndim) or _stored(plan.rhs, rhs_layout) != dims(rhs_spec, rhs.ndim):
        raise ShardingRuleError(
            f"under shard_map the blocks must already be laid out as the rules want: lhs {spec(*plan.lhs)}, "
            f"rhs {spec(*_stored(plan.rhs, rhs_layout))} (got {lhs_spec}, {rhs_spec})"
        )
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    return _dense_local(plan, matmul, out_dtype, lhs, _swap_kn(rhs, rhs_layout))
