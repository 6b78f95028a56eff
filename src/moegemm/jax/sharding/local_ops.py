"""The per-shard computation that the collectives wrap: moegemm's kernels, or the jnp reference.

:func:`moegemm_local_ops` calls ``moegemm.jax``'s ops, on the backend it is given; the sharded ops
default to ``moegemm_local_ops("auto")``, which the api resolves when they are traced (the Triton
kernels on a GPU, the reference elsewhere). :data:`REFERENCE_OPS` is the jax.numpy reference, which
computes every group over all rows (G times the work): an explicit choice, for tests.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from moegemm.jax import api, reference


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
def moegemm_local_ops(backend: api.Backend = "auto") -> LocalOps:
    """LocalOps running ``moegemm.jax``'s ops (ragged_dot with group_offset, k_grouped_mm) on ``backend``."""

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


def resolve_ops(ops: LocalOps | None) -> LocalOps:
    """``ops``, or by default moegemm's kernels: ``moegemm_local_ops("auto")``."""
    return moegemm_local_ops("auto") if ops is None else ops
