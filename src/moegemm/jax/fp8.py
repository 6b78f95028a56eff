"""FP8 grouped GEMMs for JAX: quantize, scaled m-grouped (fprop/dgrad) and k-grouped (wgrad), and
``ragged_dot_fp8``, the differentiable training op.

Recipes and scale layouts are ``moegemm._src.fp8``'s (tensorwise current scaling, per tensor or per
group; rowwise; blockwise: 1x128 activation tiles, 128x128 weight blocks, fp32 promotion every 128
of K), and the kernels are the PyTorch front end's (one Triton source), launched through jax-triton.

Training (quantization inside, FP8 forward and backward, straight-through gradients)::

    out = ragged_dot_fp8(x, w, group_sizes, recipe="blockwise")      # x [M, K], w [G, K, N]
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)                    # dgrad and wgrad in FP8

Quantized operands (not differentiable: their inputs are quantized data), as in moegemm.torch.fp8::

    x_q = quantize_fp8(x, "rowwise", group_sizes=gs, transpose=True)  # data for fprop, data_t for wgrad
    w_q = quantize_fp8(w_nk, "rowwise", transpose=True)               # a weight [G, N, K]
    y = m_grouped_mm_fp8(x_q, w_q, gs)                                # fprop: x @ w[g]^T
    dx = m_grouped_mm_fp8(dy_q, w_q.t(), gs)                          # dgrad: dy @ w[g]
    dw = k_grouped_mm_fp8(dy_q, x_q, gs)                              # wgrad [G, N, K]

No host sync anywhere; every op runs under jit with device-side group sizes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moegemm._src import fp8
from moegemm._src.jax import ops_fp8 as _ops_fp8
from moegemm.jax import reference_fp8
from moegemm.jax.api import (
    Backend,
    _accumulate_buffer,
    _executor,
    _float_dtype,
    _group_offset,
    _group_sizes,
    _local_groups,
)

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))

__all__ = ["Fp8Array", "k_grouped_mm_fp8", "m_grouped_mm_fp8", "quantize_fp8", "ragged_dot_fp8"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Array:
    """A quantized array, a pytree: ``data * scale`` approximates it (layouts in ``moegemm._src.fp8``).

    Activations (``shape`` = (M, K)): data [M, K]; scale [G] (tensorwise), [M] (rowwise) or
    [cdiv(K, 128), M] (blockwise, M-major); data_t [K, M_t] and scale_t (the wgrad operand) or None;
    group_sizes the [G] sizes it was quantized with (None: one group).
    A weight (``shape`` = (G, N, K)): data [G, N, K]; data_t [G, K, padded(N)] (the dgrad operand,
    rows padded to 16 bytes) or None.
    """

    data: jax.Array
    scale: jax.Array
    data_t: jax.Array | None
    scale_t: jax.Array | None
    group_sizes: jax.Array | None
    recipe: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def is_weight(self) -> bool:
        return self.data.ndim == 3

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """data * scale in ``dtype``, in the original layout; rows past the last group are 0."""
        if self.is_weight:
            return reference_fp8.dequantize_weight(self.data, self.scale, self.recipe, dtype=dtype)
        return reference_fp8.dequantize_activation(
            self.data, self.scale, self.recipe, self.group_sizes, dtype=dtype
        )

    def dequantize_t(self, dtype=jnp.float32) -> jax.Array:
        """The transposed copy, dequantized, in the original layout (x's [M, K], w's [G, N, K])."""
        if self.data_t is None:
            raise ValueError("this Fp8Array has no transposed copy: quantize with transpose=True")
        if self.is_weight:
            N = self.data.shape[1]
            wt = reference_fp8.dequantize_weight(self.data_t[..., :N], self.scale_t, self.recipe, dtype=dtype)
            return jnp.swapaxes(wt, 1, 2)
        return reference_fp8.dequantize_activation_t(
            self.data_t, self.scale_t, self.recipe, self.group_sizes, self.data.shape[0], dtype=dtype
        )

    def t(self) -> Fp8Array:
        """A weight's transpose [G, K, N] (data and data_t swap roles): the dgrad operand of
        ``m_grouped_mm_fp8``. Its data is the transposed copy's storage [G, K, padded(N)] as is (no
        copy; the GEMM reads the first N columns of each row)."""
        if not self.is_weight or self.data_t is None:
            raise ValueError("t() needs a weight [G, N, K] quantized with transpose=True")
        return Fp8Array(self.data_t, self.scale_t, None, None, None, self.recipe)


def _fp8_dtype(name: str, dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {dtype}")
    return dtype


def quantize_fp8(
    x: jax.Array,
    recipe: fp8.Recipe,
    *,
    group_sizes: jax.Array | None = None,
    dtype=jnp.float8_e4m3fn,
    transpose: bool = False,
    backend: Backend = "auto",
) -> Fp8Array:
    """Quantizes activations x [M, K] (rows grouped by ``group_sizes``) or a weight x [G, N, K].

    One scale per block of the recipe, ``scale = amax / max(dtype)`` (current scaling; an all-zero
    block gets scale 1), data = round-to-nearest-even(x / scale). ``transpose`` also writes the
    transposed copy the other GEMM needs (wgrad for activations, dgrad for a weight). Tensorwise
    activations get one scale per group when ``group_sizes`` is given. Not differentiable: for
    training use :func:`ragged_dot_fp8`, which quantizes inside and differentiates straight through.
    """
    fp8.check_recipe(recipe)
    x = jnp.asarray(x)
    _float_dtype("x", x.dtype)
    dtype = _fp8_dtype("dtype", dtype)
    executor = _executor(backend)
    if x.ndim == 3:
        if group_sizes is not None:
            raise ValueError(
                "a weight [G, N, K] is grouped by its first dimension; group_sizes is for activations"
            )
        parts = _ops_fp8.quantize_weight(x, recipe, dtype, transpose, executor)
        return Fp8Array(*parts, None, recipe)
    if x.ndim != 2:
        raise ValueError(f"quantize_fp8 takes activations [M, K] or a weight [G, N, K], got shape {x.shape}")
    sizes = None if group_sizes is None else _group_sizes(group_sizes, None)
    parts = _ops_fp8.quantize_activation(x, sizes, recipe, dtype, transpose, executor)
    return Fp8Array(*parts, sizes, recipe)


def _check_pair(what: str, a: Fp8Array, b: Fp8Array) -> None:
    if not isinstance(a, Fp8Array) or not isinstance(b, Fp8Array):
        raise TypeError(
            f"{what} takes Fp8Array operands from quantize_fp8, got {type(a).__name__}, {type(b).__name__}"
        )
    if a.recipe != b.recipe:
        raise ValueError(f"{what}: both operands must use one recipe, got {a.recipe!r} and {b.recipe!r}")


def m_grouped_mm_fp8(
    x_q: Fp8Array,
    w_q: Fp8Array,
    group_sizes: jax.Array,
    *,
    group_offset: jax.Array | None = None,
    out_dtype=jnp.bfloat16,
    fast_accum: bool = False,
    backend: Backend = "auto",
) -> jax.Array:
    """Scaled m-grouped GEMM (fprop, and dgrad with ``w_q.t()``): ``out[rows(g)] = x[rows(g)] @ w[g]^T``.

    x_q: activations [M, K]; w_q: a weight [G, N, K], one recipe. Returns [M, N] in ``out_dtype``
    (fp32 accumulation, promoted every 128 of K); rows past sum(group_sizes) are 0. A tensorwise
    x_q quantized in groups has one scale per entry of group_sizes. ``group_offset``: w_q holds
    groups [offset, offset + G) of group_sizes' G_total (expert parallelism; other rows are 0).
    ``fast_accum`` (tensorwise/rowwise): the tensor cores accumulate all of K, as torch's use_fast_accum.
    """
    _check_pair("m_grouped_mm_fp8", x_q, w_q)
    # w_q's rows may be padded storage (a transposed copy, from Fp8Array.t()): [G, N, padded(K)].
    if x_q.is_weight or not w_q.is_weight or w_q.shape[2] not in (x_q.shape[1], fp8.padded(x_q.shape[1])):
        raise ValueError(
            f"m_grouped_mm_fp8 expects activations [M, K] and a weight [G, N, K] with matching K; got "
            f"{x_q.shape} and {w_q.shape}"
        )
    G = w_q.shape[0]
    sizes = _group_sizes(group_sizes, None if group_offset is not None else G)
    offset = _group_offset(group_offset, G, sizes.shape[0])
    if x_q.recipe == "tensorwise" and x_q.scale.size not in (1, sizes.shape[0]):
        raise ValueError(
            f"tensorwise x_q has {x_q.scale.size} group scales but group_sizes has {sizes.shape[0]} entries"
        )
    out_dtype = _float_dtype("out_dtype", out_dtype)
    return _ops_fp8.m_grouped(
        x_q.data,
        x_q.scale,
        w_q.data,
        w_q.scale,
        sizes,
        offset,
        x_q.recipe,
        out_dtype,
        _executor(backend),
        fast_accum,
    )


def k_grouped_mm_fp8(
    a_q: Fp8Array,
    b_q: Fp8Array,
    group_sizes: jax.Array | None = None,
    *,
    accumulate: jax.Array | None = None,
    out_dtype=jnp.float32,
    group_offset: jax.Array | None = None,
    num_groups: int | None = None,
    fast_accum: bool = False,
    backend: Backend = "auto",
) -> jax.Array:
    """Scaled k-grouped GEMM (wgrad): ``out[g] = (accumulate[g] +) a[rows(g)]^T @ b[rows(g)]``, [G, Ka, Nb].

    a_q [M, Ka] and b_q [M, Nb]: activations quantized with ``transpose=True`` and the same group
    sizes (their transposed copies are laid out by them); ``group_sizes`` defaults to a_q's. For dW
    of y = x @ w^T: ``k_grouped_mm_fp8(dy_q, x_q)`` gives [G, N, K]. ``accumulate``: an fp32 buffer
    (aliased to the output on GPU). ``group_offset`` + ``num_groups``: out holds groups
    [offset, offset + num_groups) (expert parallelism).
    """
    _check_pair("k_grouped_mm_fp8", a_q, b_q)
    if a_q.is_weight or b_q.is_weight or a_q.shape[0] != b_q.shape[0]:
        raise ValueError(
            f"k_grouped_mm_fp8 expects activations [M, Ka] and [M, Nb]; got {a_q.shape} and {b_q.shape}"
        )
    if a_q.data_t is None or b_q.data_t is None:
        raise ValueError(
            "k_grouped_mm_fp8 reads the transposed copies: quantize both operands with transpose=True"
        )
    if a_q.group_sizes is None or b_q.group_sizes is None or a_q.group_sizes.shape != b_q.group_sizes.shape:
        raise ValueError(
            "k_grouped_mm_fp8: quantize a and b with the same group_sizes (their transposed copies are laid "
            "out group by group)"
        )
    sizes = _group_sizes(a_q.group_sizes if group_sizes is None else group_sizes, a_q.group_sizes.shape[0])
    num_groups, offset = _local_groups(group_offset, num_groups, sizes.shape[0])
    M, K, N = a_q.shape[0], a_q.shape[1], b_q.shape[1]
    out_dtype = _float_dtype("out_dtype", out_dtype)
    if accumulate is not None:
        accumulate = _accumulate_buffer(accumulate, (num_groups, K, N), "[G, Ka, Nb]")
        out_dtype = accumulate.dtype
    return _ops_fp8.k_grouped(
        M,
        a_q.data_t,
        a_q.scale_t,
        b_q.data_t,
        b_q.scale_t,
        sizes,
        offset,
        accumulate,
        num_groups,
        a_q.recipe,
        out_dtype,
        _executor(backend),
        fast_accum,
    )


def ragged_dot_fp8(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: fp8.Recipe = "blockwise",
    group_offset: jax.Array | None = None,
    preferred_element_type=None,
    dtype=jnp.float8_e4m3fn,
    grad_dtype=None,
    fprop_fast_accum: bool = True,
    backend: Backend = "auto",
) -> jax.Array:
    """``jax.lax.ragged_dot`` in FP8, differentiable: ``for g: out[rows(g)] = lhs[rows(g)] @ rhs[g]``.

    lhs [M, K] and rhs [G, K, N] in bf16/fp16/fp32 are quantized inside (``recipe``; activations per
    group for tensorwise), the product runs on FP8 tensor cores with fp32 accumulation, and
    ``jax.grad`` runs dgrad and wgrad in FP8 too, dy quantized in the backward (``grad_dtype``,
    default ``dtype``; jnp.float8_e5m2 is TransformerEngine's "hybrid"). Gradients are straight
    through the quantization. Returns [M, N] in ``preferred_element_type`` (default lhs's dtype).
    ``fprop_fast_accum`` (tensorwise/rowwise): the forward accumulates on the tensor cores without
    the fp32 promotion (TransformerEngine's fprop default, and GroupedLinear's); dgrad and wgrad promote.
    ``group_offset``: expert parallelism as in :func:`moegemm.jax.ragged_dot`. For a Flax layer:
    ``make_ragged_dot_cls(functools.partial(ragged_dot_fp8, recipe=...))``.
    """
    fp8.check_recipe(recipe)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"ragged_dot_fp8 expects lhs [M, K] and rhs [G, K, N] with matching K; got lhs {lhs.shape}, rhs {rhs.shape}"
        )
    lhs_dtype, rhs_dtype = _float_dtype("lhs", lhs.dtype), _float_dtype("rhs", rhs.dtype)
    out_dtype = _float_dtype("preferred_element_type", preferred_element_type or lhs_dtype)
    dtype = _fp8_dtype("dtype", dtype)
    grad_dtype = dtype if grad_dtype is None else _fp8_dtype("grad_dtype", grad_dtype)
    G = rhs.shape[0]
    sizes = _group_sizes(group_sizes, None if group_offset is not None else G)
    offset = _group_offset(group_offset, G, sizes.shape[0])
    options = _ops_fp8.Fp8Options(
        recipe, dtype, grad_dtype, out_dtype, lhs_dtype, rhs_dtype, _executor(backend), fprop_fast_accum
    )
    return _ops_fp8.ragged_dot_fp8(lhs, rhs, sizes, offset, options)
