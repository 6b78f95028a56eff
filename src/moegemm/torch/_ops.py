"""torch.library custom ops, fake impls and autograd (the PyTorch glue); launches are in ``_launch``.

The public, checked entry points are in ``moegemm.torch.api``; these ops assume validated inputs.
"""

from __future__ import annotations

import torch

from moegemm.torch import reference
from moegemm.torch._launch import INTERPRET, clear_launch_cache, launch_k_grouped, launch_m_grouped

__all__ = ["INTERPRET", "clear_launch_cache", "launch_k_grouped", "launch_m_grouped"]

# Every output buffer comes from here, so tests can poison it with NaN (tests/conftest.py).
empty = torch.empty


# ---------------------------------------------------------------- dispatch
#
# Under torch.compile, export or any tracing mode the custom ops below are what gets recorded (their
# fake impls give shapes). In plain eager mode the same launches run through a torch.autograd.Function
# instead: torch.library's Python dispatch costs ~55 us per call without autograd and ~125 us with it
# (measured on the CI CPU, torch 2.13), more than a small grouped GEMM takes on an H100.


# Plain tensors, and nn.Parameter (it adds no __torch_function__ behaviour): GroupedLinear passes its
# weight and bias as they are. Subclasses (DTensor, FakeTensor, ...) take the custom-op path, whose
# Python dispatch cost ~240 us per call on the H100 host when parameters went through it.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _eager(*tensors: torch.Tensor | None) -> bool:
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    for t in tensors:  # a loop, not all(<generator>): this runs several times per layer call
        if t is not None and type(t) not in _PLAIN_TENSOR_TYPES:
            return False
    return True


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def m_grouped(x, w, group_sizes, bias, backend: str, w_nk: bool = False) -> torch.Tensor:
    """out [M, N] = for g: x[rows(g)] @ w[g] (+ bias[g]) (differentiable in x, w and bias).

    w: [G, K, N], or with ``w_nk`` the [G, N, K] storage of an nn.Linear-layout weight (used as w.mT).
    """
    if not _eager(x, w, group_sizes, bias):
        return m_grouped_mm_op(x, w.mT if w_nk else w, group_sizes, bias, backend)
    if _needs_grad(x, w, bias):
        return _MGroupedFunction.apply(x, w.mT if w_nk else w, group_sizes, bias, backend)
    return _m_grouped_impl(x, w, group_sizes, bias, backend, w_nk)


def k_grouped(a, b, group_sizes, out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """out [G, K, N] = for g: a[rows(g)]^T @ b[rows(g)] (differentiable in a and b)."""
    if not _eager(a, b, group_sizes):
        return k_grouped_mm_op(a, b, group_sizes, out_dtype, backend)
    if _needs_grad(a, b):
        return _KGroupedFunction.apply(a, b, group_sizes, out_dtype, backend)
    return _k_grouped_impl(a, b, group_sizes, out_dtype, backend)


def k_grouped_out(a, b, group_sizes, out, accumulate: bool, backend: str) -> None:
    """out[g] (+)= a[rows(g)]^T @ b[rows(g)] in place (not differentiable)."""
    if not _eager(a, b, group_sizes, out):
        return k_grouped_mm_out_op(a, b, group_sizes, out, accumulate, backend)
    return _k_grouped_out_impl(a, b, group_sizes, out, accumulate, backend)


def k_grouped_colsum(a, b, group_sizes, out_dtype, colsum_dtype, backend: str):
    """(out [G, K, N], colsum [G, K]): out[g] = a_g^T b_g and colsum[g] = sum(a_g, 0), one launch.

    The wgrad+bgrad of a linear layer with a = dy. Backward-only: not differentiable.
    """
    if not _eager(a, b, group_sizes):
        return k_grouped_mm_colsum_op(a, b, group_sizes, out_dtype, colsum_dtype, backend)
    return _k_grouped_colsum_impl(a, b, group_sizes, out_dtype, colsum_dtype, backend)


def k_grouped_out_colsum(a, b, group_sizes, out, accumulate: bool, colsum_dtype, backend: str) -> torch.Tensor:
    """out[g] (+)= a_g^T b_g in place and returns colsum [G, K] = sum(a_g, 0), one launch (not differentiable)."""
    if not _eager(a, b, group_sizes, out):
        return k_grouped_mm_out_colsum_op(a, b, group_sizes, out, accumulate, colsum_dtype, backend)
    return _k_grouped_out_colsum_impl(a, b, group_sizes, out, accumulate, colsum_dtype, backend)


def grouped_column_sums(t, group_sizes, out_dtype, backend: str) -> torch.Tensor:
    """[G, N]: for g: sum(t[rows(g)], 0), alone (a bias gradient without the weight's): one k-grouped
    launch over a stride-0 ones column, so no [M] buffer of ones is allocated."""
    ones = t.new_ones(1).expand(t.shape[0], 1)
    return k_grouped(ones, t, group_sizes, out_dtype, backend).squeeze(1)


def _m_grouped_impl(x, w, group_sizes, bias, backend, w_nk=False):
    if backend == "reference":
        return reference.m_grouped_mm_reference(x, w.mT if w_nk else w, group_sizes, bias)
    out = empty(x.shape[0], w.shape[1 if w_nk else 2], dtype=x.dtype, device=x.device)
    launch_m_grouped(x, w, group_sizes, out, bias, w_nk)
    return out


def _k_grouped_impl(a, b, group_sizes, out_dtype, backend):
    if backend == "reference":
        return reference.k_grouped_mm_reference(a, b, group_sizes, out_dtype=out_dtype)
    out = empty(group_sizes.shape[0], a.shape[1], b.shape[1], dtype=out_dtype, device=a.device)
    launch_k_grouped(a, b, group_sizes, out, accumulate=False)
    return out


def _k_grouped_out_impl(a, b, group_sizes, out, accumulate, backend):
    if backend == "reference":
        reference.k_grouped_mm_reference(a, b, group_sizes, out=out, accumulate=accumulate)
    else:
        launch_k_grouped(a, b, group_sizes, out, accumulate=accumulate)


def _k_grouped_colsum_impl(a, b, group_sizes, out_dtype, colsum_dtype, backend):
    if backend == "reference":
        return (
            reference.k_grouped_mm_reference(a, b, group_sizes, out_dtype=out_dtype),
            reference.grouped_column_sums(a, group_sizes, out_dtype=colsum_dtype),
        )
    out = empty(group_sizes.shape[0], a.shape[1], b.shape[1], dtype=out_dtype, device=a.device)
    colsum = empty(group_sizes.shape[0], a.shape[1], dtype=colsum_dtype, device=a.device)
    launch_k_grouped(a, b, group_sizes, out, accumulate=False, a_colsum=colsum)
    return out, colsum


def _k_grouped_out_colsum_impl(a, b, group_sizes, out, accumulate, colsum_dtype, backend):
    if backend == "reference":
        reference.k_grouped_mm_reference(a, b, group_sizes, out=out, accumulate=accumulate)
        return reference.grouped_column_sums(a, group_sizes, out_dtype=colsum_dtype)
    colsum = empty(group_sizes.shape[0], a.shape[1], dtype=colsum_dtype, device=a.device)
    launch_k_grouped(a, b, group_sizes, out, accumulate=accumulate, a_colsum=colsum)
    return colsum


def _m_grouped_grads(ctx, grad_out, mm, kmm, kmm_colsum):
    """dx = dy @ w[g]^T (m-grouped), dw[g] = x_g^T dy_g (k-grouped), dbias[g] = sum(dy_g, 0);
    mm/kmm/kmm_colsum are the eager functions or the custom ops, whichever the forward used."""
    x, w, group_sizes = ctx.saved_tensors
    need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
    grad_x = grad_w = grad_b = None
    if need_x:
        grad_x = mm(grad_out, w.mT, group_sizes, None, ctx.backend)
    # w is an nn.Linear-layout weight [G, N, K] seen as [G, K, N]: produce its gradient in that storage
    # layout (dy^T x), so no transposed copy is made when it reaches the weight. dy is then the
    # k-grouped `a` operand, whose column sums (the bias gradient) the same launch can produce.
    linear_layout = w.stride(1) == 1 and w.stride(2) != 1
    if need_w and need_b and linear_layout:
        grad_wt, grad_b = kmm_colsum(grad_out, x, group_sizes, w.dtype, ctx.bias_dtype, ctx.backend)
        grad_w = grad_wt.mT
    else:
        if need_w:
            if linear_layout:
                grad_w = kmm(grad_out, x, group_sizes, w.dtype, ctx.backend).mT
            else:
                grad_w = kmm(x, grad_out, group_sizes, w.dtype, ctx.backend)
        if need_b:  # dispatches to the custom op by itself when tracing, as kmm would be
            grad_b = grouped_column_sums(grad_out, group_sizes, ctx.bias_dtype, ctx.backend)
    return grad_x, grad_w, None, grad_b, None


def _k_grouped_grads(ctx, grad_out, mm):
    a, b, group_sizes = ctx.saved_tensors
    grad_a = grad_b = None
    # out[g] = a_g^T b_g  =>  da_g = b_g dout[g]^T,  db_g = a_g dout[g]
    if ctx.needs_input_grad[0]:
        grad_a = mm(b, grad_out.to(b.dtype).mT, group_sizes, None, ctx.backend)
    if ctx.needs_input_grad[1]:
        grad_b = mm(a, grad_out.to(a.dtype), group_sizes, None, ctx.backend)
    return grad_a, grad_b, None, None, None


class _MGroupedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_sizes, bias, backend):
        ctx.save_for_backward(x, w, group_sizes)
        ctx.backend = backend
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _m_grouped_impl(x, w, group_sizes, bias, backend)

    @staticmethod
    def backward(ctx, grad_out):
        return _m_grouped_grads(ctx, grad_out, m_grouped, k_grouped, k_grouped_colsum)


class _KGroupedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_sizes, out_dtype, backend):
        ctx.save_for_backward(a, b, group_sizes)
        ctx.backend = backend
        return _k_grouped_impl(a, b, group_sizes, out_dtype, backend)

    @staticmethod
    def backward(ctx, grad_out):
        return _k_grouped_grads(ctx, grad_out, m_grouped)


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("moegemm::m_grouped_mm", mutates_args=())
def m_grouped_mm_op(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, bias: torch.Tensor | None, backend: str
) -> torch.Tensor:
    return _m_grouped_impl(x, w, group_sizes, bias, backend)


@m_grouped_mm_op.register_fake
def _(x, w, group_sizes, bias, backend):
    return x.new_empty(x.shape[0], w.shape[2])


def _setup_m(ctx, inputs, output):
    x, w, group_sizes, bias, backend = inputs
    ctx.save_for_backward(x, w, group_sizes)
    ctx.backend = backend
    ctx.bias_dtype = None if bias is None else bias.dtype


m_grouped_mm_op.register_autograd(
    lambda ctx, grad_out: _m_grouped_grads(ctx, grad_out, m_grouped_mm_op, k_grouped_mm_op, k_grouped_mm_colsum_op),
    setup_context=_setup_m,
)


@torch.library.custom_op("moegemm::k_grouped_mm", mutates_args=())
def k_grouped_mm_op(
    a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, out_dtype: torch.dtype, backend: str
) -> torch.Tensor:
    return _k_grouped_impl(a, b, group_sizes, out_dtype, backend)


@k_grouped_mm_op.register_fake
def _(a, b, group_sizes, out_dtype, backend):
    return a.new_empty(group_sizes.shape[0], a.shape[1], b.shape[1], dtype=out_dtype)


def _setup_k(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.backend = inputs[-1]


k_grouped_mm_op.register_autograd(
    lambda ctx, grad_out: _k_grouped_grads(ctx, grad_out, m_grouped_mm_op), setup_context=_setup_k
)


@torch.library.custom_op("moegemm::k_grouped_mm_out", mutates_args=("out",))
def k_grouped_mm_out_op(
    a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, out: torch.Tensor, accumulate: bool,
    backend: str,
) -> None:  # fmt: skip
    _k_grouped_out_impl(a, b, group_sizes, out, accumulate, backend)


@k_grouped_mm_out_op.register_fake
def _(a, b, group_sizes, out, accumulate, backend):
    return None


@torch.library.custom_op("moegemm::k_grouped_mm_colsum", mutates_args=())
def k_grouped_mm_colsum_op(
    a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, out_dtype: torch.dtype,
    colsum_dtype: torch.dtype, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _k_grouped_colsum_impl(a, b, group_sizes, out_dtype, colsum_dtype, backend)


@k_grouped_mm_colsum_op.register_fake
def _(a, b, group_sizes, out_dtype, colsum_dtype, backend):
    G = group_sizes.shape[0]
    return a.new_empty(G, a.shape[1], b.shape[1], dtype=out_dtype), a.new_empty(G, a.shape[1], dtype=colsum_dtype)


@torch.library.custom_op("moegemm::k_grouped_mm_out_colsum", mutates_args=("out",))
def k_grouped_mm_out_colsum_op(
    a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, out: torch.Tensor, accumulate: bool,
    colsum_dtype: torch.dtype, backend: str,
) -> torch.Tensor:  # fmt: skip
    return _k_grouped_out_colsum_impl(a, b, group_sizes, out, accumulate, colsum_dtype, backend)


@k_grouped_mm_out_colsum_op.register_fake
def _(a, b, group_sizes, out, accumulate, colsum_dtype, backend):
    return a.new_empty(group_sizes.shape[0], a.shape[1], dtype=colsum_dtype)
