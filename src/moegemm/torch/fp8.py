"""FP8 grouped GEMMs for PyTorch: quantize, scaled m-grouped (fprop/dgrad) and k-grouped (wgrad).

Recipes and scale layouts are in ``moegemm._src.fp8``: tensorwise (current scaling, per tensor or per
group), rowwise (as ``torch._scaled_grouped_mm``) and blockwise (DeepSeek-V3: 1x128 activation
tiles, 128x128 weight blocks, fp32 promotion every 128 of K).

A training step with y = x @ w[g]^T per group::

    x_q = quantize_fp8(x, "blockwise", group_sizes=gs, transpose=True)    # data for fprop, data_t for wgrad
    w_q = quantize_fp8(w, "blockwise", transpose=True)                    # w [G, N, K]; data_t for dgrad
    y = m_grouped_mm_fp8(x_q, w_q, gs)                                     # fprop
    dy_q = quantize_fp8(dy, "blockwise", group_sizes=gs, transpose=True)
    dx = m_grouped_mm_fp8(dy_q, w_q.t(), gs)                               # dgrad: dy @ w[g]
    dw = k_grouped_mm_fp8(dy_q, x_q, gs)                                   # wgrad: dy_g^T x_g, [G, N, K]

``GroupedLinear(fp8_recipe=...)`` runs exactly this with autograd.
"""

from __future__ import annotations

import dataclasses

import torch

from moegemm._src import fp8
from moegemm._src.torch import ops_fp8 as _ops_fp8
from moegemm.torch import reference_fp8
from moegemm.torch.api import (
    Backend,
    GroupSizes,
    as_group_sizes,
    check_group_sizes_values,
    check_out_buffer,
    checks_enabled,
    resolve_backend,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = ["Fp8Tensor", "k_grouped_mm_fp8", "m_grouped_mm_fp8", "quantize_fp8"]


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """A quantized tensor: ``data * scale`` approximates it (layouts in ``moegemm._src.fp8``).

    Activations (``shape`` = (M, K)): data [M, K], data_t [K, M_t] (wgrad operand) or None,
    ``group_sizes`` the [G] sizes they were quantized with (None: one group). A weight
    (``shape`` = (G, N, K)): data [G, N, K], data_t [G, K, N] (dgrad operand) or None.
    """

    data: torch.Tensor
    scale: torch.Tensor
    data_t: torch.Tensor | None
    scale_t: torch.Tensor | None
    recipe: str
    group_sizes: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def is_weight(self) -> bool:
        return self.data.dim() == 3

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * scale in ``dtype``, in the original layout; rows past the last group are 0."""
        if self.is_weight:
            return reference_fp8.dequantize_weight(self.data, self.scale, self.recipe, dtype=dtype)
        return reference_fp8.dequantize_activation(
            self.data, self.scale, self.recipe, self.group_sizes, dtype=dtype
        )

    def dequantize_t(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The transposed copy, dequantized and put back in the original layout (x's [M, K], w's [G, N, K])."""
        if self.data_t is None:
            raise ValueError("this Fp8Tensor has no transposed copy: quantize with transpose=True")
        if self.is_weight:
            return reference_fp8.dequantize_weight(self.data_t, self.scale_t, self.recipe, dtype=dtype).mT
        return reference_fp8.dequantize_activation_t(
            self.data_t, self.scale_t, self.recipe, self.group_sizes, self.data.shape[0], dtype=dtype
        )

    def t(self) -> Fp8Tensor:
        """A weight's transpose [G, K, N] (data and data_t swap roles): the dgrad operand of
        ``m_grouped_mm_fp8``, since dx = dy @ w[g] = dy @ (w[g]^T)^T."""
        if not self.is_weight or self.data_t is None:
            raise ValueError("t() needs a weight [G, N, K] quantized with transpose=True")
        return Fp8Tensor(self.data_t, self.scale_t, self.data, self.scale, self.recipe)


def _check_high(name: str, t: torch.Tensor) -> None:
    if t.dtype not in HIGH_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32 to quantize, got {t.dtype}")


def quantize_fp8(
    x: torch.Tensor,
    recipe: fp8.Recipe,
    *,
    group_sizes: GroupSizes | None = None,
    dtype: torch.dtype = torch.float8_e4m3fn,
    transpose: bool = False,
    check: bool | None = None,
    backend: Backend = "auto",
) -> Fp8Tensor:
    """Quantizes activations x [M, K] (rows grouped by ``group_sizes``) or a weight x [G, N, K].

    One scale per block of the recipe, ``scale = amax / max(dtype)`` (current scaling; an all-zero
    block gets scale 1), data = round-to-nearest-even(x / scale). ``transpose`` also writes the
    transposed copy the other GEMM needs (wgrad for activations, dgrad for a weight) in the same
    kernel. No host sync; ``check=True`` (or MOEGEMM_CHECK=1) syncs to refuse inf/NaN inputs and
    bad sizes. Tensorwise activations get one scale per group when ``group_sizes`` is given.
    """
    fp8.check_recipe(recipe)
    _check_high("x", x)
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if x.dim() == 3:
        if group_sizes is not None:
            raise ValueError(
                "a weight [G, N, K] is grouped by its first dimension; group_sizes is for activations"
            )
        G = x.shape[0]
        sizes = None
    elif x.dim() == 2:
        sizes = None if group_sizes is None else as_group_sizes(group_sizes, None, x.device)
        G = 1 if sizes is None else sizes.shape[0]
    else:
        raise ValueError(
            f"quantize_fp8 takes activations [M, K] or a weight [G, N, K], got shape {tuple(x.shape)}"
        )
    if checks_enabled(check):
        if sizes is not None:
            check_group_sizes_values(sizes, x.shape[0])
        bad = int((~torch.isfinite(x)).sum())
        if bad:
            raise ValueError(
                f"quantize_fp8: x {tuple(x.shape)} has {bad} inf/NaN values; its scale would be inf/NaN"
            )
    backend = resolve_backend(backend, x.device)
    if x.dim() == 3 and x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()  # the kernels see a weight as [G * N, K] rows
    data_s, scale_s, data_t_s, scale_t_s = _ops_fp8.quantize(x, sizes, recipe, dtype, transpose, G, backend)
    return _from_storage(x, sizes, recipe, transpose, data_s, scale_s, data_t_s, scale_t_s)


def _from_storage(x, sizes, recipe, transpose, data_s, scale_s, data_t_s, scale_t_s) -> Fp8Tensor:
    K = x.shape[-1]
    data = data_s[..., :K]
    if x.dim() == 3:
        scale_t = (
            scale_t_s
            if recipe == "rowwise"
            else scale_s
            if recipe == "tensorwise"
            else scale_s.transpose(1, 2)
        )
        data_t = data_t_s[..., : x.shape[1]] if transpose else None
        return Fp8Tensor(data, scale_s, data_t, scale_t if transpose else None, recipe)
    scale = scale_s.T if recipe == "blockwise" else scale_s
    scale_t = (scale_s if recipe == "tensorwise" else scale_t_s) if transpose else None
    return Fp8Tensor(data, scale, data_t_s if transpose else None, scale_t, recipe, sizes)


def _check_pair(what: str, a: Fp8Tensor, b: Fp8Tensor) -> None:
    if a.recipe != b.recipe:
        raise ValueError(f"{what}: both operands must use one recipe, got {a.recipe!r} and {b.recipe!r}")
    if a.data.device != b.data.device:
        raise ValueError(f"{what}: operands on different devices: {a.data.device} and {b.data.device}")


def m_grouped_mm_fp8(
    x_q: Fp8Tensor,
    w_q: Fp8Tensor,
    group_sizes: GroupSizes,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
    check: bool | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Scaled m-grouped GEMM (fprop, and dgrad with ``w_q.t()``): ``out[rows(g)] = x[rows(g)] @ w[g]^T (+ bias[g])``.

    x_q: activations [M, K]; w_q: a weight [G, N, K] (nn.Linear layout), both from quantize_fp8 with
    one recipe. Returns out [M, N] in ``out_dtype`` (bf16/fp16/fp32), fp32 accumulation; rows past
    sum(group_sizes) are 0. Tensorwise x_q with per-group scales must have been quantized with G
    groups. ``fast_accum`` lets the tensor cores accumulate all of K (faster, less accurate, as
    torch's use_fast_accum); by default partial sums reach fp32 every 128 of K. Not differentiable.
    """
    _check_pair("m_grouped_mm_fp8", x_q, w_q)
    if x_q.is_weight or not w_q.is_weight or x_q.shape[1] != w_q.shape[2]:
        raise ValueError(
            f"m_grouped_mm_fp8 expects activations [M, K] and a weight [G, N, K] with matching K; got "
            f"{x_q.shape} and {w_q.shape}"
        )
    G, N, _ = w_q.shape
    if x_q.recipe == "tensorwise" and x_q.scale.numel() not in (1, G):
        raise ValueError(
            f"tensorwise x_q has {x_q.scale.numel()} group scales but the weight has G={G} groups"
        )
    if out_dtype not in HIGH_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if bias is not None and (tuple(bias.shape) != (G, N) or bias.device != x_q.data.device):
        raise ValueError(
            f"bias must be [G, N] = {(G, N)} on {x_q.data.device}, got {tuple(bias.shape)} on {bias.device}"
        )
    sizes = as_group_sizes(group_sizes, G, x_q.data.device)
    if checks_enabled(check):
        check_group_sizes_values(sizes, x_q.shape[0])
    backend = resolve_backend(backend, x_q.data.device)
    return _ops_fp8.m_grouped(
        x_q.data, x_q.scale, w_q.data, w_q.scale, sizes, bias, x_q.recipe, out_dtype, fast_accum, backend
    )


def k_grouped_mm_fp8(
    a_q: Fp8Tensor,
    b_q: Fp8Tensor,
    group_sizes: GroupSizes | None = None,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
    fast_accum: bool = False,
    check: bool | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Scaled k-grouped GEMM (wgrad): ``out[g] (+)= a[rows(g)]^T @ b[rows(g)]``, [G, Ka, Nb].

    a_q [M, Ka] and b_q [M, Nb]: activations quantized with ``transpose=True`` and the same
    ``group_sizes`` tensor (their transposed copies are laid out by it); ``group_sizes`` defaults to
    it. For dW of y = x @ w^T: ``k_grouped_mm_fp8(dy_q, x_q)`` gives [G, N, K]. ``out=`` and
    ``accumulate=True`` (fp32, main_grad) as in k_grouped_mm: an empty group's out[g] is untouched.
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
    if a_q.group_sizes is None or a_q.group_sizes is not b_q.group_sizes:
        raise ValueError(
            "k_grouped_mm_fp8: quantize a and b with the same group_sizes tensor (their transposed copies are "
            "laid out group by group)"
        )
    sizes = a_q.group_sizes
    if group_sizes is not None and group_sizes is not sizes:
        raise ValueError(
            "k_grouped_mm_fp8: group_sizes must be the tensor the operands were quantized with "
            "(Fp8Tensor.group_sizes), or None"
        )
    M = a_q.shape[0]
    G, K, N = sizes.shape[0], a_q.shape[1], b_q.shape[1]
    if checks_enabled(check):
        check_group_sizes_values(sizes, M)
    backend = resolve_backend(backend, a_q.data.device)
    args = (a_q.data_t, a_q.scale_t, b_q.data_t, b_q.scale_t, sizes, M, a_q.recipe, fast_accum, backend)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out=, the fp32 buffer to accumulate into")
        if out_dtype not in HIGH_DTYPES:
            raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
        return _ops_fp8.k_grouped(*args, out_dtype)
    if tuple(out.shape) != (G, K, N) or out.device != a_q.data.device:
        raise ValueError(
            f"out must be [G, Ka, Nb] = {(G, K, N)} on {a_q.data.device}, got {tuple(out.shape)} on {out.device}"
        )
    if out.dtype not in HIGH_DTYPES or (accumulate and out.dtype != torch.float32):
        raise TypeError(f"out must be float32 to accumulate (bf16/fp16 allowed otherwise), got {out.dtype}")
    check_out_buffer("k_grouped_mm_fp8", out, a=a_q.data_t, b=b_q.data_t)
    _ops_fp8.k_grouped_out(*args[:6], out, accumulate, *args[6:])
    return out
