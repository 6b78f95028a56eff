"""``Fp8Tensor``: a tensor quantized by ``moegemm.torch.quantize_fp8`` (layouts in ``moegemm._src.fp8``)."""

from __future__ import annotations

import dataclasses

import torch

from moegemm._src.torch import reference as _ref


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """A quantized tensor: ``data * scale`` approximates it; the recipe travels with it.

    Activations (``shape`` = (M, K)): data [M, K], data_t [K, M_t] (the wgrad operand, laid out group by
    group) or None, ``group_sizes`` the [G] sizes they were quantized with (None: one group). A weight
    (``shape`` = (G, N, K), the nn.Linear layout: quantized along its last dimension, the reduction of
    ``m_grouped_mm``): data [G, N, K], data_t [G, K, N] (the dgrad operand) or None.

    ``m_grouped_mm(x_q, w_q, gs)`` computes ``x[rows(g)] @ w[g]^T`` (as a high-precision call given
    ``w.mT``); ``w_q.t()`` is the dgrad operand, ``k_grouped_mm(dy_q, x_q, gs)`` the wgrad.
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
    def dtype(self) -> torch.dtype:
        """The FP8 format of data (float8_e4m3fn or float8_e5m2)."""
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_weight(self) -> bool:
        return self.data.dim() == 3

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * scale in ``dtype``, in the original layout; rows past the last group are 0."""
        if self.is_weight:
            return _ref.dequantize_weight(self.data, self.scale, self.recipe, dtype=dtype)
        return _ref.dequantize_activation(self.data, self.scale, self.recipe, self.group_sizes, dtype=dtype)

    def dequantize_t(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The transposed copy, dequantized and put back in the original layout (x's [M, K], w's [G, N, K])."""
        if self.data_t is None:
            raise ValueError("this Fp8Tensor has no transposed copy: quantize with transpose=True")
        if self.is_weight:
            return _ref.dequantize_weight(self.data_t, self.scale_t, self.recipe, dtype=dtype).mT
        return _ref.dequantize_activation_t(
            self.data_t, self.scale_t, self.recipe, self.group_sizes, self.data.shape[0], dtype=dtype
        )

    def t(self) -> Fp8Tensor:
        """A weight's transpose [G, K, N] (data and data_t swap roles): the dgrad operand of
        ``m_grouped_mm``, since dx = dy @ w[g] = dy @ (w[g]^T)^T."""
        if not self.is_weight or self.data_t is None:
            raise ValueError("t() needs a weight [G, N, K] quantized with transpose=True")
        return Fp8Tensor(self.data_t, self.scale_t, self.data, self.scale, self.recipe)


def from_storage(x, sizes, recipe, transpose, data_s, scale_s, data_t_s, scale_t_s) -> Fp8Tensor:
    """The Fp8Tensor of x from the quantize op's four storage tensors (``moegemm._src.torch.ops``): views
    without the 16-byte row padding, a blockwise activation scale back to [M, cdiv(K, 128)]."""
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


def check_pair(op: str, a: tuple[str, object], b: tuple[str, object]) -> None:
    """Both operands Fp8Tensor with one recipe on one device; a mix with a plain tensor names both."""
    (name_a, ta), (name_b, tb) = a, b
    if not (isinstance(ta, Fp8Tensor) and isinstance(tb, Fp8Tensor)):
        raise TypeError(
            f"{op}: {name_a} is {_describe(ta)} but {name_b} is {_describe(tb)}; pass both quantized "
            f"(quantize_fp8, one recipe) or both in high precision"
        )
    if ta.recipe != tb.recipe:
        raise ValueError(f"{op}: both operands must use one recipe, got {ta.recipe!r} and {tb.recipe!r}")
    if ta.device != tb.device:
        raise ValueError(f"{op}: operands on different devices: {ta.device} and {tb.device}")


def _describe(t: object) -> str:
    if isinstance(t, Fp8Tensor):
        return f"an Fp8Tensor ({t.recipe}, {t.dtype}, shape {t.shape})"
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor"
    return f"a {type(t).__name__}"
