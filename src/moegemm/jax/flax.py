"""Flax (linen) integration: a ragged_dot injection point and a GroupedDense module.

A MoE layer that calls ``jax.lax.ragged_dot`` takes a ``ragged_dot_cls`` factory instead (the same
pattern as ``dot_general_cls`` for nn.Dense), and the model definition stays unchanged::

    class Experts(nn.Module):
        ragged_dot_cls: Callable = lambda: None  # None -> jax.lax.ragged_dot

        @nn.compact
        def __call__(self, x, w, group_sizes):
            ragged_dot = self.ragged_dot_cls() or jax.lax.ragged_dot
            return ragged_dot(x, w, group_sizes)

    Experts(ragged_dot_cls=make_ragged_dot_cls())  # moegemm's kernels
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moegemm._src import fp8
from moegemm.jax import api

__all__ = ["GroupedDense", "make_ragged_dot_cls"]


def make_ragged_dot_cls(*, backend: api.Backend = "auto", fp8_recipe: str | None = None) -> type[nn.Module]:
    """A stateless linen Module class whose instances are called like ``jax.lax.ragged_dot``.

    ``fp8_recipe`` ("tensorwise", "rowwise" or "blockwise") switches the layer to FP8: operands are
    quantized inside, and forward, dgrad and wgrad run on FP8 tensor cores
    (``moegemm.jax.ragged_dot(..., fp8_recipe=...)``; gradients straight through the quantization).
    The parameters stay in their own dtype.
    """
    api.resolve_backend(backend)  # fail at model build time, not at the first step
    if fp8_recipe is not None:
        fp8.check_recipe(fp8_recipe)

    class MoegemmRaggedDot(nn.Module):
        def __call__(
            self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None
        ):
            return api.ragged_dot(
                lhs,
                rhs,
                group_sizes,
                precision,
                preferred_element_type,
                group_offset,
                fp8_recipe=fp8_recipe,
                backend=backend,
            )

    suffix = "" if fp8_recipe is None else f"_fp8_{fp8_recipe}"
    MoegemmRaggedDot.__name__ = MoegemmRaggedDot.__qualname__ = f"MoegemmRaggedDot_{backend}{suffix}"
    return MoegemmRaggedDot


class GroupedDense(nn.Module):
    """Per-expert linear layer: ``for g: y[rows(g)] = x[rows(g)] @ kernel[g]``, kernel [G, K, N].

    x [M, K] rows sorted by expert, group_sizes [G] (or [G_total] with ``group_offset`` under expert
    parallelism, kernel then holding the G local experts). Rows past sum(group_sizes) give 0.
    ``ragged_dot_cls`` picks the GEMM: ``lambda: None`` uses jax.lax.ragged_dot,
    ``make_ragged_dot_cls()`` moegemm's Triton kernels. ``fp8_recipe`` runs the layer in FP8 with
    moegemm's kernels (it overrides ``ragged_dot_cls``): one argument switches an existing layer.
    """

    num_groups: int
    features: int
    dtype: Any = None  # computation dtype; None keeps x's dtype (promoted with the kernel's)
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    preferred_element_type: Any = None
    ragged_dot_cls: Callable[[], Any] = lambda: None
    fp8_recipe: str | None = None
    backend: api.Backend = "auto"  # for fp8_recipe

    @nn.compact
    def __call__(
        self, x: jax.Array, group_sizes: jax.Array, group_offset: jax.Array | None = None
    ) -> jax.Array:
        kernel = self.param(
            "kernel", self.kernel_init, (self.num_groups, x.shape[-1], self.features), self.param_dtype
        )
        dtype = self.dtype if self.dtype is not None else jnp.result_type(x, kernel)
        x, kernel = x.astype(dtype), kernel.astype(dtype)
        if self.fp8_recipe is not None:
            ragged_dot = make_ragged_dot_cls(backend=self.backend, fp8_recipe=self.fp8_recipe)()
        else:
            ragged_dot = self.ragged_dot_cls() or jax.lax.ragged_dot
        kwargs = {} if group_offset is None else {"group_offset": group_offset}
        return ragged_dot(
            x, kernel, group_sizes, preferred_element_type=self.preferred_element_type, **kwargs
        )
