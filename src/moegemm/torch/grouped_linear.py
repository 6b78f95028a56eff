"""GroupedLinear: G nn.Linear experts over contiguous row groups, one module and one autograd.Function.

Semantics, with rows(g) = [offset_g, offset_g + size_g) and offset = exclusive prefix sum of sizes::

    for g: y[rows(g)] = x[rows(g)] @ weight[g].T + bias[g]      # m_grouped_mm, bias in its epilogue
    rows past sum(sizes): y = 0
    dx[rows(g)] = dy[rows(g)] @ weight[g]                        # m_grouped_mm, weight as stored
    dweight[g] = dy[rows(g)].T @ x[rows(g)]                      # k_grouped_mm, [G, N, K] storage,
    dbias[g]   = sum(dy[rows(g)], 0)                             #   and its column sums of dy

Forward is one launch and backward two (dgrad; wgrad with dbias). Every launch reads group_sizes on
the device, so forward and backward never sync the host when group_sizes is a CUDA tensor
(CUDA-graph capturable).

With ``fp8_recipe`` the same Function runs the GEMMs on quantized operands (``moegemm.torch.api``)::

    x_q = quantize(x, recipe, group_sizes, transpose=True)   # data: fprop; data_t: wgrad (rowwise and
                                                             # blockwise: data_t made after the fprop)
    w_q = quantize(weight, recipe, transpose=True)           # cached while the weight is unchanged
    y   = m_grouped_mm(x_q, w_q) + bias                      # bias in the epilogue, y in x's dtype
    dy_q = quantize(dy, recipe, group_sizes, dtype=grad_dtype, transpose=True)
    dx  = m_grouped_mm(dy_q, w_q.t())                        # dgrad
    dW  = k_grouped_mm(dy_q, x_q)  (or += into main_grad)    # wgrad, fp32 accumulation
    dbias = column sums of dy (high precision, the BF16 kernel)

The FP8 forward saves only the transposed FP8 copies the backward reads (x's for wgrad, the weight's
for dgrad): half the bytes of the BF16 path's saved x. The master weight, bias and main_grad stay in
high precision; their gradients are ordinary autograd gradients.

torch.compile(fullgraph=True) traces the module (the autograd.Function calls only custom ops), also
with fuse_wgrad_accumulation. delay_wgrad_compute hands (x, dy) from the backward to backward_dw()
through Python state, which Dynamo cannot trace: compile it without fullgraph (one graph break).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from moegemm._src import fp8
from moegemm._src.torch import ops as _ops
from moegemm._src.torch.args import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    Backend,
    GroupSizes,
    as_group_sizes,
    check_group_sizes_values,
    check_out_buffer,
    checks_enabled,
    resolve_backend,
)

__all__ = ["Fp8WeightCache", "GroupedLinear"]


# Megatron/TE convention for fused wgrad accumulation: when the weight has ``grad_added_to_main_grad``,
# autograd still gets a (dummy) gradient so that the DDP grad hooks fire, and the flag tells them that
# main_grad already holds the gradient. One cached dummy per (shape, dtype, device), as in TE.
_DUMMY_WGRADS: dict[tuple, torch.Tensor] = {}


def _dummy_wgrad(weight: torch.Tensor, zero: bool) -> torch.Tensor:
    key = (tuple(weight.shape), weight.dtype, weight.device)
    if key not in _DUMMY_WGRADS:
        _DUMMY_WGRADS[key] = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    if zero:
        _DUMMY_WGRADS[key].zero_()
    return _DUMMY_WGRADS[key]


@dataclasses.dataclass(frozen=True)
class _Fp8Settings:
    """recipe: "tensorwise", "rowwise" or "blockwise". grad_dtype: dy's format (float8_e5m2 is TE's
    "hybrid"). fprop_fast_accum: fprop accumulates on the tensor cores without promotion (TE's fprop
    default); dgrad and wgrad always promote to fp32 every 128 of K (TE's split accumulator)."""

    recipe: str
    grad_dtype: torch.dtype = torch.float8_e4m3fn
    fprop_fast_accum: bool = True


# torch.optim steps taken in this process. A fused optimizer (``fused=True``: torch._fused_adamw_, the default
# of torchtitan's) writes the parameters without bumping their ``_version``, so the version alone would keep a
# stale FP8 copy for the rest of training (docs/design.md, 'FP8 weight cache'). Every torch.optim.Optimizer's
# step, fused or a subclass's own, runs the global post hooks.
_OPTIMIZER_STEPS = [0]


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_optimizer_step)


class Fp8WeightCache:
    """A weight's quantized copy (``quantize_weight_views``: e4m3 data, scale and the dgrad copy), reused while
    the weight is unchanged.

    Valid while no torch.optim optimizer has stepped since it was made (fused optimizers leave ``_version``
    alone), and ``weight._version`` (bumped by in-place updates: copy_, zero_, unfused optimizers) and its
    storage are those it was made from: micro-batches of one optimizer step share one copy. An update outside
    both (writes through ``.data``, a kernel of one's own) needs ``refresh`` or ``clear``. ``refresh`` forces a
    new one (TE's ``is_first_microbatch=True``); ``reuse`` takes the cached copy without the check
    (``is_first_microbatch=False``).
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.storage: tuple[torch.Tensor, ...] | None = None

    def get(
        self, weight: torch.Tensor, recipe: str, backend: str, *, refresh: bool = False, reuse: bool = False
    ):
        key = (weight._version, _OPTIMIZER_STEPS[0], weight.data_ptr(), weight.device, recipe, backend)
        if reuse and self.storage is not None:
            return self.storage
        if refresh or self.key != key or self.storage is None:
            self.storage = _ops.quantize_weight_views(weight, recipe, backend)
            self.key = key
        return self.storage

    def clear(self) -> None:
        self.key = self.storage = None


def _quantize_weight(weight: torch.Tensor, settings: _Fp8Settings, backend: str):
    """(data, scale, data_t, scale_t) of a [G, N, K] weight in e4m3, as views (see moegemm._src.fp8)."""
    return _ops.quantize_weight_views(weight, settings.recipe, backend)


def _quantize_activation(
    t,
    group_sizes,
    settings: _Fp8Settings,
    dtype,
    transpose: bool,
    backend: str,
    data: bool = True,
    colsum_dtype: torch.dtype | None = None,
):
    """(data, scale, data_t, scale_t, colsum) of activations t; data=False (rowwise, blockwise): the
    transposed copy alone, data and scale None. colsum: t's per-group column sums in ``colsum_dtype`` (dy's
    bias gradient, from the quantize's own read of dy where it has one; not differentiable, as FP8 dW is not),
    else None."""
    return _ops.quantize_activation_views(
        t, group_sizes, settings.recipe, dtype, transpose, backend, data, colsum_dtype=colsum_dtype
    )


class _State:
    """delay_wgrad_compute: what the backward leaves for backward_dw() (x, dy, group_sizes, main_grad, ...)."""

    def __init__(self) -> None:
        self.pending: tuple | None = None  # (weight-gradient function, its arguments, need_w)


class _GroupedLinearFunction(torch.autograd.Function):
    """y = GroupedLinear(x) with its backward; see the module docstring for the formulas.

    ``out`` (the caller's buffer, or None) is the first input on purpose. When a Function marks a
    *view* dirty, autograd rebases the view's base on a CopySlices node, which hands the gradient of
    the Function's first input to the base and the rest to the other inputs
    (torch/csrc/autograd/functions/tensor.cpp, CopySlices::apply_impl). With x first, x's gradient
    went to the buffer and x got none. The old contents of out are overwritten, so their gradient,
    the first one returned, is zero: a real (expanded, allocation-free) zero, since CopySlices
    drops the whole base's gradient, not only the slice's, when it gets None.

    ``delay_state`` is the module's _State with delay_wgrad_compute (the backward leaves the weight
    gradient there for backward_dw), else None; ``fp8`` is None, or (settings, the quantized weight)
    with fp8_recipe, which runs the FP8 steps of the module docstring.
    """

    @staticmethod
    def forward(ctx, out, x, weight, bias, group_sizes, main_grad, dummy_wgrad, backend, delay_state, fp8):
        if fp8 is not None:  # (settings, the quantized weight)
            return _fp8_forward(
                ctx, out, x, weight, bias, group_sizes, main_grad, dummy_wgrad, backend, delay_state, *fp8
            )
        if out is None:
            y = _ops.m_grouped(x, weight, group_sizes, bias, backend, transpose_w=True)
        else:
            _ops.m_grouped_out(x, weight, group_sizes, bias, out, backend, transpose_w=True)
            ctx.mark_dirty(out)
            y = out
        need_x, need_w, need_b = ctx.needs_input_grad[1:4]
        # Save only what the requested gradients read: x for wgrad, the weight for dgrad.
        ctx.save_for_backward(x if need_w else None, weight if need_x else None, group_sizes)
        # Not a saved tensor: backward mutates it, and so do other micro-batches' backwards in between.
        # main_grad is given only with fuse_wgrad_accumulation.
        ctx.main_grad, ctx.dummy_wgrad = main_grad, dummy_wgrad
        bias_dtype = bias.dtype if bias is not None and need_b else None
        ctx.meta = (backend, delay_state, bias_dtype, weight.dtype, None)
        return y

    @staticmethod
    def backward(ctx, dy):
        backend, delay_state, bias_dtype, w_dtype, fp8_meta = ctx.meta
        if fp8_meta is not None:
            return _fp8_backward(ctx, dy)
        x, weight, group_sizes = ctx.saved_tensors
        need_w = ctx.needs_input_grad[2]
        # dx[rows(g)] = dy[rows(g)] @ W[g]: the stored [G, N, K] weight is already the [G, K', N'] operand.
        dx = _ops.m_grouped(dy, weight, group_sizes, None, backend) if ctx.needs_input_grad[1] else None
        wgrad = (x, dy, group_sizes, ctx.main_grad, need_w, bias_dtype, w_dtype, backend)
        if delay_state is not None and (need_w or bias_dtype is not None):
            if delay_state.pending is not None:
                raise RuntimeError(
                    "GroupedLinear(delay_wgrad_compute=True): a second backward ran before backward_dw() "
                    "consumed the first one's weight gradient"
                )
            delay_state.pending = (_weight_grads, wgrad, need_w)
            return _overwritten_grad(ctx, dy), dx, *[None] * 8
        dw, db = _weight_grads(*wgrad)
        if need_w and ctx.main_grad is not None and ctx.dummy_wgrad is not None:
            # A fresh alias of the cached dummy, so AccumulateGrad takes it instead of cloning it.
            dw = ctx.dummy_wgrad.detach()
        return _overwritten_grad(ctx, dy), dx, dw, db, *[None] * 6


def _overwritten_grad(ctx, dy: torch.Tensor) -> torch.Tensor | None:
    """The gradient of out='s old contents: zero, since the forward overwrote every element."""
    return dy.new_zeros(()).expand(dy.shape) if ctx.needs_input_grad[0] else None


def _weight_grads(x, dy, group_sizes, main_grad, need_w, bias_dtype, w_dtype, backend):
    """(dW in the weight's [G, N, K] layout, or None when accumulated into main_grad; dbias or None)."""
    return _ops.weight_grads(
        x,
        dy,
        group_sizes,
        backend,
        w_dtype=w_dtype,
        need_w=need_w,
        bias_dtype=bias_dtype,
        main_grad=main_grad,
    )


def _fp8_forward(
    ctx, out, x, weight, bias, group_sizes, main_grad, dummy_wgrad, backend, delay_state, settings, w_q
):
    """_GroupedLinearFunction.forward with fp8_recipe (the module docstring's FP8 steps)."""
    need_x, need_w, need_b = ctx.needs_input_grad[1:4]
    recipe = settings.recipe
    # Rowwise and blockwise make x's transposed copy (what the backward keeps) after the GEMM, once
    # x's FP8 data is freed, so the two never coexist with y: the forward's peak holds one FP8 copy
    # of x. Tensorwise quantizes both in one call (its copy shares the group scales of one amax pass).
    # Blockwise stays split though one read could write both: that held x's two FP8 copies and y at once,
    # +18 MB of peak on dsv3-ep8-fc1 (docs/design.md, 'Quantize').
    split = need_w and recipe != "tensorwise"
    x_data, x_scale, x_t, x_scale_t, _ = _quantize_activation(
        x, group_sizes, settings, torch.float8_e4m3fn, need_w and not split, backend
    )
    w_data, w_scale, w_t, w_scale_t = w_q
    y = _ops.m_grouped_fp8(
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
        _, _, x_t, x_scale_t, _ = _quantize_activation(
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
    ctx.meta = (backend, delay_state, bias_dtype, weight.dtype, (x.dtype, x.shape[0], settings))
    return y


def _fp8_backward(ctx, dy):
    """_GroupedLinearFunction.backward with fp8_recipe."""
    x_t, x_scale_t, w_t, w_scale_t, group_sizes = ctx.saved_tensors
    backend, delay_state, bias_dtype, w_dtype, (x_dtype, M, settings) = ctx.meta
    need_x, need_w = ctx.needs_input_grad[1:3]
    dy = dy.contiguous()
    dy_data, dy_scale, dy_t, dy_scale_t, db = _quantize_activation(
        dy, group_sizes, settings, settings.grad_dtype, need_w, backend, colsum_dtype=bias_dtype
    )
    wgrad = [
        db,
        dy_t,
        dy_scale_t,
        x_t,
        x_scale_t,
        group_sizes,
        M,
        ctx.main_grad,
        need_w,
        w_dtype,
        settings.recipe,
        backend,
    ]
    del dy_t, dy_scale_t, db
    dw = db = None
    delayed = delay_state is not None and (need_w or bias_dtype is not None)
    if delayed:
        if delay_state.pending is not None:
            raise RuntimeError(
                "GroupedLinear(delay_wgrad_compute=True): a second backward ran before backward_dw() "
                "consumed the first one's weight gradient"
            )
        delay_state.pending = (_weight_grads_fp8, tuple(wgrad), need_w)
    else:
        # The wgrad runs first so that dy's transposed copy is freed before dgrad allocates dx: the
        # step's peak holds one of dy's two FP8 copies, not both.
        dw, db = _weight_grads_fp8(*wgrad)
        if need_w and ctx.main_grad is not None and ctx.dummy_wgrad is not None:
            dw = ctx.dummy_wgrad.detach()
    wgrad.clear()
    dx = None
    if need_x:
        dx = _ops.m_grouped_fp8(
            dy_data, dy_scale, w_t, w_scale_t, group_sizes, None, settings.recipe, x_dtype, False, backend
        )
    if delayed:
        return _overwritten_grad(ctx, dy), dx, *[None] * 8
    return _overwritten_grad(ctx, dy), dx, dw, db, *[None] * 6


def _weight_grads_fp8(
    db,
    dy_t,
    dy_scale_t,
    x_t,
    x_scale_t,
    group_sizes,
    M,
    main_grad,
    need_w,
    w_dtype,
    recipe,
    backend,
):
    """(dW [G, N, K] or None when accumulated into main_grad, dbias) from the FP8 copies; dbias ``db`` (or None)
    came from dy's quantize."""
    if not need_w:
        return None, db
    if main_grad is not None:
        _ops.k_grouped_fp8_out(
            dy_t, dy_scale_t, x_t, x_scale_t, group_sizes, M, main_grad, True, recipe, False, backend
        )
        return None, db
    dw = _ops.k_grouped_fp8(dy_t, dy_scale_t, x_t, x_scale_t, group_sizes, M, recipe, False, backend, w_dtype)
    return dw, db


class GroupedLinear(nn.Module):
    """G experts, each an nn.Linear(in_features, out_features), applied to contiguous row groups.

    Parameters: ``weight`` [G, out_features, in_features] and ``bias`` [G, out_features] (or None),
    in ``dtype`` (bf16/fp16/fp32). ``forward(x, group_sizes)``::

        for g: y[rows(g)] = x[rows(g)] @ weight[g].T + bias[g];  y[sum(group_sizes):] = 0

    Args:
        num_groups, in_features, out_features: G, K, N.
        bias: learn a per-expert additive bias.
        dtype, device: of the parameters.
        fuse_wgrad_accumulation: accumulate the weight gradient in fp32 into ``weight.main_grad``
            ([G, N, K] float32, allocated by the caller, Megatron convention) instead of producing
            ``weight.grad``. As in TransformerEngine, if the weight has ``grad_added_to_main_grad``
            that flag is set True and autograd receives a cached dummy gradient (zeroed when
            ``weight.zero_out_wgrad`` is set); otherwise the weight gets no ``.grad``.
        delay_wgrad_compute: backward computes dx only and keeps (x, dy, group_sizes); call
            ``backward_dw()`` once after each backward to compute the weight and bias gradients
            (zero-bubble pipeline schedules). The next forward raises if it was not called.
        init_method: called as ``init_method(weight[g])`` on each expert's [N, K] weight (the bias is
            then zeroed, as in TE); default: nn.Linear's init, U(-1/sqrt(K), 1/sqrt(K)) for both.
        backend: "auto", "triton" or "reference" (see ``moegemm.torch.api``).
        fp8_recipe: None (high precision), or "tensorwise", "rowwise" or "blockwise": forward and
            backward GEMMs in FP8 with current scaling (the module docstring's FP8 steps). The
            weight's quantized copy is cached while the weight is unchanged (its version counter);
            ``forward(..., is_first_microbatch=...)`` overrides that as in TransformerEngine.
        fp8_grad_dtype: dy's FP8 format; float8_e5m2 is TE's "hybrid" recipe.
        fp8_fprop_fast_accum: fprop accumulates without fp32 promotion (faster; TE's fprop default).

    A state dict in per-expert layout (``weight0`` .. ``weight{G-1}``, ``bias0`` ..) loads too.
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        init_method: Callable[[torch.Tensor], object] | None = None,
        backend: Backend = "auto",
        fp8_recipe: str | None = None,
        fp8_grad_dtype: torch.dtype = torch.float8_e4m3fn,
        fp8_fprop_fast_accum: bool = True,
    ) -> None:
        super().__init__()
        if num_groups < 1 or in_features < 0 or out_features < 0:
            raise ValueError(
                f"GroupedLinear needs num_groups >= 1 and non-negative features; got num_groups={num_groups}, "
                f"in_features={in_features}, out_features={out_features}"
            )
        factory = {"dtype": dtype, "device": device}
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.delay_wgrad_compute = delay_wgrad_compute
        self.init_method = init_method
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        if self.weight.dtype not in FLOAT_DTYPES:
            raise TypeError(f"GroupedLinear parameters must be bfloat16, float16 or float32, got {dtype}")
        if bias:
            self.bias = nn.Parameter(torch.empty(num_groups, out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self._state = _State()
        self.fp8 = None
        if fp8_recipe is not None:
            fp8.check_recipe(fp8_recipe)
            if fp8_grad_dtype not in FP8_DTYPES:
                raise TypeError(f"fp8_grad_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_grad_dtype}")
            self.fp8 = _Fp8Settings(fp8_recipe, fp8_grad_dtype, fp8_fprop_fast_accum)
        self._fp8_weight = Fp8WeightCache()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.init_method is not None:
                for g in range(self.num_groups):
                    self.init_method(self.weight[g])
                if self.bias is not None:
                    self.bias.zero_()
                return
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, "
            f"delay_wgrad_compute={self.delay_wgrad_compute}"
            + ("" if self.fp8 is None else f", fp8_recipe={self.fp8.recipe!r}")
        )

    def forward(
        self,
        x: torch.Tensor,
        group_sizes: GroupSizes,
        *,
        out: torch.Tensor | None = None,
        check: bool | None = None,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        """x [M, in_features] -> y [M, out_features] in the parameters' dtype.

        group_sizes [G] int32/int64: a CUDA tensor (no host sync anywhere, capturable), a CPU tensor
        or a list. Rows at or past sum(group_sizes) come out 0 and get a zero gradient.
        ``out=`` [M, out_features] receives the result in place (any strides: a view into a larger
        buffer works) and is returned; gradients flow to x, the parameters and, for a view, the
        base's other elements as usual. It must not share memory with x or the parameters; in grad
        mode, autograd refuses a leaf that requires grad. Under torch.compile the result is copied
        into out (one temporary). ``check=True`` (or MOEGEMM_CHECK=1)
        syncs to validate that sizes are >= 0 and sum exactly to M.
        With ``fp8_recipe``: ``is_first_microbatch`` True re-quantizes the weight, False reuses the cached
        copy unchecked, None (default) re-quantizes only when the weight changed.
        """
        weight = self.weight  # nn.Module attribute lookups of parameters cost ~1 us each: look up once
        G, N, K = weight.shape
        if x.dim() != 2 or x.shape[1] != K:
            raise ValueError(f"GroupedLinear expects x [M, in_features={K}], got x of shape {tuple(x.shape)}")
        if x.dtype != weight.dtype:
            raise TypeError(f"x is {x.dtype} but GroupedLinear's parameters are {weight.dtype}")
        if x.device != weight.device:
            raise ValueError(f"x is on {x.device} but GroupedLinear's parameters are on {weight.device}")
        group_sizes = as_group_sizes(group_sizes, G, x.device)
        M = x.shape[0]
        if checks_enabled(check):
            check_group_sizes_values(group_sizes, M)
            total = int(group_sizes.sum())
            if total != M:
                raise ValueError(
                    f"sum(group_sizes) = {total} but x has M = {M} rows (check=True asks for equality); "
                    f"sizes={group_sizes.tolist()}"
                )
        if out is not None:
            if tuple(out.shape) != (M, N) or out.dtype != x.dtype or out.device != x.device:
                raise ValueError(
                    f"out must be a {x.dtype} tensor of shape {(M, N)} on {x.device}, got {out.dtype} "
                    f"{tuple(out.shape)} on {out.device}"
                )
            check_out_buffer(
                "GroupedLinear", out, x=x, weight=weight, bias=self.bias, group_sizes=group_sizes
            )
        if self.fp8 is not None and is_first_microbatch is False and self._fp8_weight.storage is None:
            raise RuntimeError(
                "is_first_microbatch=False needs a cached FP8 weight: no forward has quantized it yet"
            )
        if out is not None and torch.compiler.is_compiling():
            # Dynamo rebuilds an autograd.Function with its inputs in first-use order, which undoes the
            # out-first rule of _GroupedLinearFunction: under compile, out= is an ordinary copy_,
            # which autograd and AOTAutograd record as usual (one [M, N] temporary).
            return out.copy_(self.forward(x, group_sizes, check=check))
        delay, state = self.delay_wgrad_compute, self._state
        # The state that receives the weight gradient when it is delayed (one Function argument for both:
        # Function.apply's Python cost grows with its argument count).
        delay_state = state if delay else None
        if delay and state.pending is not None:
            raise RuntimeError(
                "GroupedLinear(delay_wgrad_compute=True): call backward_dw() after each backward, before the "
                "next forward; the previous backward's weight gradient is still pending"
            )
        main_grad = dummy_wgrad = None
        if self.fuse_wgrad_accumulation and weight.requires_grad and torch.is_grad_enabled():
            main_grad = self._main_grad()
            if not delay:
                dummy_wgrad = self._mark_grad_added_to_main_grad()
        backend = resolve_backend(self.backend, x.device)
        if self.fp8 is not None:
            if torch.compiler.is_compiling():  # no Python-side cache in a traced graph
                w_q = _quantize_weight(weight, self.fp8, backend)
            else:
                w_q = self._fp8_weight.get(
                    weight,
                    self.fp8.recipe,
                    backend,
                    refresh=is_first_microbatch is True,
                    reuse=is_first_microbatch is False,
                )
            return _GroupedLinearFunction.apply(
                out,
                x,
                weight,
                self.bias,
                group_sizes,
                main_grad,
                dummy_wgrad,
                backend,
                delay_state,
                (self.fp8, w_q),
            )
        return _GroupedLinearFunction.apply(
            out, x, weight, self.bias, group_sizes, main_grad, dummy_wgrad, backend, delay_state, None
        )

    def _mark_grad_added_to_main_grad(self) -> torch.Tensor | None:
        """TE/Megatron: with ``weight.grad_added_to_main_grad`` present, set it and return the dummy
        gradient the backward hands to autograd. Done when the graph is recorded rather than in the
        backward (TE), so that torch.compile traces it; Megatron resets the flag before each step."""
        if not hasattr(self.weight, "grad_added_to_main_grad"):
            return None
        self.weight.grad_added_to_main_grad = True
        return _dummy_wgrad(self.weight, zero=getattr(self.weight, "zero_out_wgrad", False))

    def _main_grad(self) -> torch.Tensor:
        main_grad = getattr(self.weight, "main_grad", None)
        shape = tuple(self.weight.shape)
        if main_grad is None:
            raise RuntimeError(
                f"fuse_wgrad_accumulation=True needs weight.main_grad, a float32 tensor of shape {shape} "
                f"allocated by the caller (Megatron convention); the weight has none"
            )
        if (
            tuple(main_grad.shape) != shape
            or main_grad.dtype != torch.float32
            or main_grad.device != self.weight.device
        ):
            raise ValueError(
                f"weight.main_grad must be float32 of shape {shape} on {self.weight.device}; got "
                f"{main_grad.dtype} of shape {tuple(main_grad.shape)} on {main_grad.device}"
            )
        return main_grad

    @torch.no_grad()
    def backward_dw(self) -> None:
        """Computes the delayed weight and bias gradients of the last backward (delay_wgrad_compute).

        weight.grad (+)= dW, or weight.main_grad += dW with fuse_wgrad_accumulation; bias.grad (+)= dbias.
        """
        if not self.delay_wgrad_compute:
            raise RuntimeError("backward_dw() is only for GroupedLinear(delay_wgrad_compute=True)")
        if self._state.pending is None:
            raise RuntimeError(
                "backward_dw() has no pending weight gradient: it runs once after each backward "
                "(called twice, or before any backward)"
            )
        (weight_grads, args, need_w), self._state.pending = self._state.pending, None
        dw, db = weight_grads(*args)
        if dw is not None:
            _accumulate_grad(self.weight, dw)
        elif need_w and hasattr(self.weight, "grad_added_to_main_grad"):  # accumulated into main_grad
            self.weight.grad_added_to_main_grad = True
        if db is not None:
            _accumulate_grad(self.bias, db)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        # Per-expert layout (TE's GroupedLinear, a ModuleList of nn.Linear flattened): weight0..weight{G-1}.
        for name in ("weight", "bias"):
            keys = [f"{prefix}{name}{g}" for g in range(self.num_groups)]
            present = [k for k in keys if k in state_dict]
            if not present or f"{prefix}{name}" in state_dict:
                continue
            if len(present) != len(keys):
                error_msgs.append(
                    f"per-expert state dict for {prefix}{name}: has {len(present)} of the "
                    f"{self.num_groups} entries {name}0..{name}{self.num_groups - 1}; missing "
                    f"{[k for k in keys if k not in state_dict][:8]}"
                )
                continue
            state_dict[f"{prefix}{name}"] = torch.stack([state_dict.pop(k) for k in keys])
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def _accumulate_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
