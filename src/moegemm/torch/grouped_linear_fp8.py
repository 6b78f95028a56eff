"""GroupedLinear's FP8 path: quantize x, w and dy, and run fprop, dgrad and wgrad in FP8.

Semantics are GroupedLinear's (moegemm.torch.grouped_linear), on quantized operands::

    x_q = quantize(x, recipe, group_sizes, transpose=True)   # data: fprop; data_t: wgrad (rowwise and
                                                             # blockwise: data_t made after the fprop)
    w_q = quantize(weight, recipe, transpose=True)           # cached while the weight is unchanged
    y   = m_grouped_mm_fp8(x_q, w_q) + bias                  # bias in the epilogue, y in x's dtype
    dy_q = quantize(dy, recipe, group_sizes, dtype=grad_dtype, transpose=True)
    dx  = m_grouped_mm_fp8(dy_q, w_q.t())                    # dgrad
    dW  = k_grouped_mm_fp8(dy_q, x_q)  (or += into main_grad) # wgrad, fp32 accumulation
    dbias = column sums of dy (high precision, the BF16 kernel)

The forward saves only the transposed FP8 copies the backward reads (x's for wgrad, the weight's for
dgrad): half the bytes of the BF16 path's saved x. The master weight, bias and main_grad stay in
high precision; their gradients are ordinary autograd gradients.
"""

from __future__ import annotations

import dataclasses

import torch

from moegemm._src import fp8
from moegemm._src.torch import ops as _ops
from moegemm._src.torch import ops_fp8 as _ops_fp8

__all__ = ["Fp8Settings", "Fp8WeightCache"]


@dataclasses.dataclass(frozen=True)
class Fp8Settings:
    """recipe: "tensorwise", "rowwise" or "blockwise". grad_dtype: dy's format (float8_e5m2 is TE's
    "hybrid"). fprop_fast_accum: fprop accumulates on the tensor cores without promotion (TE's fprop
    default); dgrad and wgrad always promote to fp32 every 128 of K (TE's split accumulator)."""

    recipe: str
    grad_dtype: torch.dtype = torch.float8_e4m3fn
    fprop_fast_accum: bool = True


class Fp8WeightCache:
    """The weight's quantized copy, reused while the weight is unchanged.

    Valid while ``weight._version`` (bumped by every in-place update: optimizer steps, copy_, zero_)
    and its storage are those it was made from, so a stale copy is never used. ``refresh`` forces a
    new one (TE's ``is_first_microbatch=True``); ``reuse`` takes the cached copy without the check
    (``is_first_microbatch=False``).
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.storage: tuple[torch.Tensor, ...] | None = None

    def get(self, weight: torch.Tensor, settings: Fp8Settings, backend: str, *, refresh: bool, reuse: bool):
        key = (weight._version, weight.data_ptr(), weight.device, settings.recipe, backend)
        if reuse and self.storage is not None:
            return self.storage
        if refresh or self.key != key or self.storage is None:
            self.storage = quantize_weight(weight, settings, backend)
            self.key = key
        return self.storage

    def clear(self) -> None:
        self.key = self.storage = None


def quantize_weight(weight: torch.Tensor, settings: Fp8Settings, backend: str):
    """(data, scale, data_t, scale_t) of a [G, N, K] weight in e4m3, as views (see moegemm._src.fp8)."""
    with torch.no_grad():
        G, N, K = weight.shape
        data_s, scale_s, data_t_s, scale_t_s = _ops_fp8.quantize(
            weight.detach(), None, settings.recipe, torch.float8_e4m3fn, True, G, backend
        )
    recipe = settings.recipe
    scale_t = (
        scale_t_s if recipe == "rowwise" else scale_s if recipe == "tensorwise" else scale_s.transpose(1, 2)
    )
    return data_s[..., :K], scale_s, data_t_s[..., :N], scale_t


def _quantize_activation(
    t, group_sizes, settings: Fp8Settings, dtype, transpose: bool, backend: str, data: bool = True
):
    """(data, scale, data_t, scale_t) of activations t; data=False (rowwise, blockwise): the
    transposed copy alone, data and scale None."""
    G = group_sizes.shape[0]
    data_s, scale_s, data_t_s, scale_t_s = _ops_fp8.quantize(
        t, group_sizes, settings.recipe, dtype, transpose, G, backend, data
    )
    scale_t = scale_s if settings.recipe == "tensorwise" else scale_t_s
    if not data:
        return None, None, data_t_s, scale_t
    scale = scale_s.T if settings.recipe == "blockwise" else scale_s
    return data_s[:, : t.shape[1]], scale, data_t_s, scale_t


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """GroupedLinear in FP8 (the module docstring above). Inputs as _GroupedLinearFunction's, plus
    the settings and the quantized weight (data, scale, data_t, scale_t); ``out`` comes first for the
    same reason (autograd's CopySlices hands the first input's gradient to a view's base)."""

    @staticmethod
    def forward(
        ctx, out, x, weight, bias, group_sizes, main_grad, dummy_wgrad, backend, delay, state, settings, w_q
    ):
        need_x, need_w, need_b = ctx.needs_input_grad[1:4]
        recipe = settings.recipe
        # Rowwise and blockwise make x's transposed copy (what the backward keeps) after the GEMM, once
        # x's FP8 data is freed, so the two never coexist with y: the forward's peak holds one FP8 copy
        # of x. Tensorwise quantizes both in one call (its copy shares the group scales of one amax pass).
        split = need_w and recipe != "tensorwise"
        x_data, x_scale, x_t, x_scale_t = _quantize_activation(
            x, group_sizes, settings, torch.float8_e4m3fn, need_w and not split, backend
        )
        w_data, w_scale, w_t, w_scale_t = w_q
        y = _ops_fp8.m_grouped(
            x_data,
            x_scale,
            w_data,
            w_scale,
            group_sizes,
            bias,
            recipe,
            x.dtype,
            settings.fprop_fast_accum,
            backend,
        )
        del x_data, x_scale
        if split:
            _, _, x_t, x_scale_t = _quantize_activation(
                x, group_sizes, settings, torch.float8_e4m3fn, True, backend, data=False
            )
        if out is not None:
            # The FP8 kernel has no out= form yet: one [M, N] temporary, copied.
            y = out.copy_(y)
            ctx.mark_dirty(out)
        ctx.save_for_backward(
            x_t if need_w else None,
            x_scale_t if need_w else None,
            w_t if need_x else None,
            w_scale_t if need_x else None,
            group_sizes,
        )
        ctx.main_grad, ctx.dummy_wgrad = main_grad, dummy_wgrad
        bias_dtype = bias.dtype if bias is not None and need_b else None
        ctx.meta = (backend, delay, state, bias_dtype, weight.dtype, x.dtype, x.shape[0], settings)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_t, x_scale_t, w_t, w_scale_t, group_sizes = ctx.saved_tensors
        backend, delay, state, bias_dtype, w_dtype, x_dtype, M, settings = ctx.meta
        need_x, need_w = ctx.needs_input_grad[1:3]
        dy = dy.contiguous()
        dy_data, dy_scale, dy_t, dy_scale_t = _quantize_activation(
            dy, group_sizes, settings, settings.grad_dtype, need_w, backend
        )
        wgrad = [
            dy,
            dy_t,
            dy_scale_t,
            x_t,
            x_scale_t,
            group_sizes,
            M,
            ctx.main_grad,
            need_w,
            bias_dtype,
            w_dtype,
            settings.recipe,
            backend,
        ]
        del dy_t, dy_scale_t
        dw = db = None
        delayed = delay and (need_w or bias_dtype is not None)
        if delayed:
            if state.pending is not None:
                raise RuntimeError(
                    "GroupedLinear(delay_wgrad_compute=True): a second backward ran before backward_dw() "
                    "consumed the first one's weight gradient"
                )
            state.pending = (weight_grads_fp8, tuple(wgrad), need_w)
        else:
            # The wgrad runs first so that dy's transposed copy is freed before dgrad allocates dx: the
            # step's peak holds one of dy's two FP8 copies, not both.
            dw, db = weight_grads_fp8(*wgrad)
            if need_w and ctx.main_grad is not None and ctx.dummy_wgrad is not None:
                dw = ctx.dummy_wgrad.detach()
        wgrad.clear()
        dx = None
        if need_x:
            dx = _ops_fp8.m_grouped(
                dy_data, dy_scale, w_t, w_scale_t, group_sizes, None, settings.recipe, x_dtype, False, backend
            )
        if delayed:
            return _overwritten(ctx, dy), dx, *[None] * 10
        return _overwritten(ctx, dy), dx, dw, db, *[None] * 8


def _overwritten(ctx, dy):
    return dy.new_zeros(()).expand(dy.shape) if ctx.needs_input_grad[0] else None


def weight_grads_fp8(
    dy,
    dy_t,
    dy_scale_t,
    x_t,
    x_scale_t,
    group_sizes,
    M,
    main_grad,
    need_w,
    bias_dtype,
    w_dtype,
    recipe,
    backend,
):
    """(dW [G, N, K] or None when accumulated into main_grad, dbias or None) from the FP8 copies."""
    db = None if bias_dtype is None else _ops.grouped_column_sums(dy, group_sizes, bias_dtype, backend)
    if not need_w:
        return None, db
    if main_grad is not None:
        _ops_fp8.k_grouped_out(
            dy_t, dy_scale_t, x_t, x_scale_t, group_sizes, M, main_grad, True, recipe, False, backend
        )
        return None, db
    dw = _ops_fp8.k_grouped(dy_t, dy_scale_t, x_t, x_scale_t, group_sizes, M, recipe, False, backend, w_dtype)
    return dw, db


def check_recipe(recipe: str | None) -> str | None:
    return None if recipe is None else fp8.check_recipe(recipe)
