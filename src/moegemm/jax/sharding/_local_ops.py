"""The per-shard computation that the collectives wrap: moegemm's kernels, or the jnp reference.

:func:`moegemm_local_ops` calls ``moegemm.jax``'s ops, on the backend it is given; the sharded ops
default to ``moegemm_local_ops("auto")``, which the api resolves when they are traced (the Triton
kernels on a GPU, the reference elsewhere). :data:`REFERENCE_OPS` is the jax.numpy reference, which
computes every group over all rows (G times the work): an explicit choice, for tests.

FP8 (``moegemm_local_ops(backend, fp8_recipe=...)``): the same plans and collectives as in high
precision, with local calls that quantize their operands on the shard (after the plan's all-gathers:
an FSDP weight is gathered, then quantized) and run moegemm's FP8 kernels, with the group offset for
EP (no row copies). Per recipe, the scales that span shards:

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
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from moegemm._src import fp8
from moegemm._src.jax import ops as _ops
from moegemm.jax import api, reference
from moegemm.jax.sharding._plans import Axes, ShardingRuleError


@dataclasses.dataclass(frozen=True)
class LocalOps:
    """The per-shard computation the collectives wrap (hashable: it is a static argument).

    ragged_dot(lhs [M, K], rhs [G_local, K, N], group_sizes [G_total], group_offset int32 [] or
        None, preferred_element_type) -> [M, N]; rows of groups outside [offset, offset + G_local)
        are 0 (moegemm.jax.ragged_dot's contract).
    k_grouped_mm(a [M, K], b [M, N], group_sizes [G_total], group_offset or None, num_groups,
        out_dtype) -> [num_groups, K, N]; for j: out[j] = a[rows(offset + j)]^T @ b[rows(offset + j)].
    """

    ragged_dot: Callable
    k_grouped_mm: Callable
    name: str = "custom"


def _reference_ragged_dot(lhs, rhs, group_sizes, group_offset, preferred_element_type):
    return reference.ragged_dot_reference(
        lhs, rhs, group_sizes, group_offset=group_offset, out_dtype=preferred_element_type
    )


def _reference_k_grouped_mm(a, b, group_sizes, group_offset, num_groups, out_dtype):
    return reference.k_grouped_mm_reference(
        a, b, group_sizes, group_offset=group_offset, num_groups=num_groups, out_dtype=out_dtype
    )


REFERENCE_OPS = LocalOps(_reference_ragged_dot, _reference_k_grouped_mm, name="reference")


@functools.cache
def moegemm_local_ops(
    backend: api.Backend = "auto", *, fp8_recipe: fp8.Recipe | None = None, fp8_dtype=jnp.float8_e4m3fn
) -> LocalOps:
    """LocalOps running ``moegemm.jax``'s ops (ragged_dot with group_offset, k_grouped_mm) on ``backend``;
    with ``fp8_recipe``, quantizing on each shard and running the FP8 kernels (the module's FP8 rules)."""
    if fp8_recipe is not None:
        return _Fp8LocalOps(
            fp8.check_recipe(fp8_recipe), jnp.dtype(api._fp8_dtype("fp8_dtype", fp8_dtype)), backend
        )

    def ragged_dot(lhs, rhs, group_sizes, group_offset, preferred_element_type):
        return api.ragged_dot(
            lhs,
            rhs,
            group_sizes,
            preferred_element_type=preferred_element_type,
            group_offset=group_offset,
            backend=backend,
        )

    def k_grouped_mm(a, b, group_sizes, group_offset, num_groups, out_dtype):
        # The local groups' rows are read in place (the kernels' group offset): no row copies.
        return api.k_grouped_mm(
            a,
            b,
            group_sizes,
            out_dtype=out_dtype,
            group_offset=group_offset,
            num_groups=num_groups,
            backend=backend,
        )

    return LocalOps(ragged_dot, k_grouped_mm, name=f"moegemm-{backend}")


def resolve_ops(
    ops: LocalOps | None,
    backend: api.Backend = "auto",
    fp8_recipe: str | None = None,
    fp8_dtype=jnp.float8_e4m3fn,
) -> LocalOps:
    """``ops``, or moegemm's kernels on ``backend`` (FP8 with ``fp8_recipe``); raises if both are asked for."""
    if ops is None:
        return moegemm_local_ops(backend, fp8_recipe=fp8_recipe, fp8_dtype=fp8_dtype)
    if fp8_recipe is not None or backend != "auto":
        raise ValueError(
            f"pass either ops={ops.name!r} or backend/fp8_recipe (got backend={backend!r}, fp8_recipe={fp8_recipe!r})"
        )
    return ops


# ---------------------------------------------------------------- FP8


def _pmax(axes: Axes):
    return (lambda amax: jax.lax.pmax(amax, axes)) if axes else None


def _local_size(dim: int, axes: Axes) -> int:
    return dim // math.prod(jax.lax.axis_size(a) for a in axes) if axes else dim


@dataclasses.dataclass(frozen=True)
class _Fp8LocalOps:
    """The per-shard computation of the FP8 rules (a ``LocalOps`` that also takes the mesh axes sharing
    each operand's scales: ``scale_axes = (rows, columns)`` per operand, from the plan)."""

    recipe: str
    dtype: object = jnp.float8_e4m3fn
    backend: api.Backend = "auto"
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
        executor = api._executor(self.backend)
        reduce_x = _pmax(lhs_rows + lhs_k) if self.recipe == "tensorwise" else None
        reduce_w = _pmax(rhs_k + rhs_n) if self.recipe == "tensorwise" else None
        out, _, _ = _ops.fprop(
            lhs, rhs, group_sizes, group_offset, self.recipe, self.dtype, preferred_element_type, executor,
            lhs_transpose=False, lhs_amax_reduce=reduce_x, rhs_amax_reduce=reduce_w,
        )  # fmt: skip
        return out

    def k_grouped_mm(self, a, b, group_sizes, group_offset, num_groups, out_dtype, *, scale_axes=None):
        # The wgrad reads the transposed copies only: their scales are per column (rowwise per (group,
        # column), blockwise per 128 tokens of a column), so sharded columns need no check.
        (a_rows, a_k), (b_rows, b_n) = scale_axes or (((), ()), ((), ()))
        executor = api._executor(self.backend)
        tensorwise = self.recipe == "tensorwise"
        a_q = _ops.quantize_activation(
            a,
            group_sizes,
            self.recipe,
            self.dtype,
            True,
            executor,
            _pmax(a_rows + a_k) if tensorwise else None,
        )
        b_q = _ops.quantize_activation(
            b,
            group_sizes,
            self.recipe,
            self.dtype,
            True,
            executor,
            _pmax(b_rows + b_n) if tensorwise else None,
        )
        return _ops.k_grouped_fp8(
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
