"""The PyTorch glue of the expert block (``moegemm.torch.moe``): routing metadata, forward, backward.

Ops (torch.library, with fake impls; inputs validated by ``moegemm.torch.moe``)::

    moegemm::moe_experts      (x, topk_ids, topk_weights, w13, w2) -> (out, z, gather, pos, group_sizes, row_scale)
    moegemm::moe_experts_bwd  (dout, x, topk_weights, w13, w2, z, gather, pos, group_sizes, row_scale)
                              -> (dx, dw13, dw2, dtopk_weights)

The forward's extra outputs are what the backward keeps besides x (docs/design.md, 'Fused expert block'): the fc1
pre-activation z [R, 2n] and the integer routing metadata (``Routing``); R = T * k rows, one per (token, choice).
Eager calls skip the dispatcher (its Python cost is ~55 us a call, as for the GEMM ops) and run the same forward
and backward definitions inside an autograd.Function.
"""

from __future__ import annotations

import torch

from moegemm._src import plan
from moegemm._src.moe import Routing
from moegemm._src.torch import ops as _ops
from moegemm._src.torch.launch import (
    CAPABILITIES,
    _target,
    launch_combine,
    launch_gather_rows,
    launch_k_grouped,
    launch_k_grouped_fused,
    launch_m_grouped,
    launch_m_grouped_fused,
)
from moegemm.torch import reference


def routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, E: int, expert_base: int | None = None
) -> Routing:
    """``Routing`` of topk_ids [T, k] and topk_weights [T, k] over E experts (device ops, no host sync:
    counts by scatter-add, where bincount would read the ids' maximum on the host).

    ``expert_base`` (expert parallelism): the E experts are [expert_base, expert_base + E) of a larger set and
    a choice of any other expert is absent: its row sorts after every group (rows past sum(group_sizes), which
    no launch reads or writes), its pos is -1 (the combine skips it) and its row_scale 0."""
    T, k = topk_ids.shape
    R = T * k
    flat_ids = topk_ids.reshape(-1)
    if expert_base is None:
        # int32 keys: the radix sort then takes half the passes of int64 (0.06 vs 0.10 ms for 131072 ids on the
        # H100). Clamped before the cast, which would wrap an int64 id past 2**31.
        clamped = flat_ids.clamp(0, max(E - 1, 0))
        absent = None
    else:
        local = flat_ids - expert_base
        absent = (local < 0) | (local >= E)
        clamped = local.masked_fill(absent, E)  # bin E: after every group
    flat = clamped.to(torch.int32)
    order = torch.argsort(flat, stable=True)
    bins = E if absent is None else E + 1
    group_sizes = torch.zeros(bins, dtype=torch.int32, device=flat.device)
    # scatter_add_ wants int64 indices: int64 ids serve as they are, not cast back from the int32 keys.
    group_sizes.scatter_add_(0, clamped.long(), torch.ones(R, dtype=torch.int32, device=flat.device))
    group_sizes = group_sizes[:E]
    gather = torch.div(order, max(k, 1), rounding_mode="floor").to(torch.int32)
    pos = torch.empty(R, dtype=torch.int32, device=flat.device)
    pos[order] = torch.arange(R, dtype=torch.int32, device=flat.device)
    weights = topk_weights.reshape(-1).to(torch.float32)
    weights = torch.where(torch.isfinite(weights), weights, torch.zeros_like(weights))
    if absent is not None:
        pos = pos.masked_fill(absent, -1)
        weights = weights.masked_fill(absent, 0.0)
    return Routing(gather, pos.view(T, k), group_sizes, weights[order])


# ---------------------------------------------------------------- forward and backward definitions


def _forward(x, topk_ids, topk_weights, w13, w2, expert_base=None):
    """(out [T, d], z [R, 2n], *Routing): fc1 with the gather prologue and SwiGLU epilogue, fc2, combine."""
    T, d = x.shape
    E, two_n, _ = w13.shape
    r = routing(topk_ids, topk_weights, E, expert_base)
    R = r.gather.shape[0]
    z = _ops.empty(R, two_n, dtype=x.dtype, device=x.device)
    h = _ops.empty(R, two_n // 2, dtype=x.dtype, device=x.device)
    # With absent rows (expert_base) nothing reads the rows past the groups: no launch writes them.
    fill = expert_base is None
    launch_m_grouped_fused(
        x, w13.mT, r.group_sizes, h, gather=r.gather, epilogue="swiglu", act=z, fill_tail=fill
    )
    y = _ops.empty(R, d, dtype=x.dtype, device=x.device)
    if fill:
        # The plain launch: TMA where the plan takes it.
        launch_m_grouped(h, w2, r.group_sizes, y, transpose_w=True)
    else:
        launch_m_grouped_fused(h, w2.mT, r.group_sizes, y, fill_tail=False)
    del h
    out = _ops.empty(T, d, dtype=x.dtype, device=x.device)
    launch_combine(y, r.pos, topk_weights.contiguous(), out)
    return out, z, *r


def _backward(dout, x, topk_weights, w13, w2, z, gather, pos, group_sizes, row_scale, absent=False):
    """(dx, dw13, dw2, dtopk_weights). fc2's dgrad carries the SwiGLU backward and the routing weights'
    gradient in its epilogue (dz, s * h and per-tile sums of dh * h); the wgrads read x's and dout's rows by
    token index (or copies in expert order: ``plan.wgrad_gathers_rows``); dx sums each token's k rows of
    dz @ w13[e]. z: the kept pre-activation, or a one-element list holding it (emptied here, so that z is freed
    after its one use when nothing else holds it). absent: the forward had absent rows (expert_base): the
    launches leave the rows past the groups alone, and wgrad copies hold the routed rows only."""
    if isinstance(z, list):
        z = z.pop()
    T, d = x.shape
    E, two_n, _ = w13.shape
    R = gather.shape[0]
    dout = dout.contiguous()
    dz = _ops.empty(R, two_n, dtype=x.dtype, device=x.device)
    hs = _ops.empty(R, two_n // 2, dtype=x.dtype, device=x.device)
    ds = launch_m_grouped_fused(
        dout,
        w2,
        group_sizes,
        dz,
        gather=gather,
        epilogue="swiglu_bwd",
        act=z,
        row_scale=row_scale,
        act_out=hs,
        fill_tail=not absent,
    )
    del z  # its one use (_setup_eager)
    gathered = plan.wgrad_gathers_rows(R, two_n // 2, d, E, _target(x.device), CAPABILITIES)

    def rows_of(t):
        """t's rows in expert order (the wgrads' copies): with absent rows, only the routed ones move."""
        if not absent:
            return t.index_select(0, gather)
        out = _ops.empty(R, t.shape[1], dtype=t.dtype, device=t.device)
        launch_gather_rows(t, gather, group_sizes, out)
        return out

    dw2 = _ops.empty(E, d, two_n // 2, dtype=w2.dtype, device=x.device)
    if gathered:
        launch_k_grouped_fused(dout, hs, group_sizes, dw2, gather_a=gather)
    else:
        launch_k_grouped(rows_of(dout), hs, group_sizes, dw2, False)
    del hs
    # dx before dw13: dx's [R, d] rows then live beside dz alone, not beside dw13 too (the backward's peak).
    dx_rows = _ops.empty(R, d, dtype=x.dtype, device=x.device)
    if absent:
        launch_m_grouped_fused(dz, w13, group_sizes, dx_rows, fill_tail=False)
    else:
        launch_m_grouped(dz, w13, group_sizes, dx_rows)
    dx = _ops.empty(T, d, dtype=x.dtype, device=x.device)
    launch_combine(dx_rows, pos, None, dx)
    del dx_rows
    dw13 = _ops.empty(E, two_n, d, dtype=w13.dtype, device=x.device)
    if gathered:
        launch_k_grouped_fused(dz, x, group_sizes, dw13, gather_b=gather)
    else:
        launch_k_grouped(dz, rows_of(x), group_sizes, dw13, False)
    del dz
    # The routing weights' gradient <dout[t], y_row>: the fc2 epilogue's per-tile sums, added in tile order.
    # An absent choice (pos -1, expert parallelism) has no row: its gradient is 0.
    dweights = (
        torch.where(pos >= 0, ds.sum(0)[pos.view(-1).long().clamp(min=0)].view(pos.shape), 0.0)
        if R
        else x.new_zeros(pos.shape, dtype=torch.float32)
    )
    # A non-finite weight counts as the constant 0 in the forward, so its gradient is 0 (as the reference twin's).
    dweights = torch.where(torch.isfinite(topk_weights), dweights, 0.0)
    return dx, dw13, dw2, dweights.to(topk_weights.dtype)


# ---------------------------------------------------------------- custom ops (what tracing records)


@torch.library.custom_op("moegemm::moe_experts", mutates_args=())
def moe_experts_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_base: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(x, topk_ids, topk_weights, w13, w2, expert_base)


@moe_experts_op.register_fake
def _(x, topk_ids, topk_weights, w13, w2, expert_base=None):
    T, d = x.shape
    R = T * topk_ids.shape[1]
    index = dict(dtype=torch.int32)
    return (
        x.new_empty(T, d),
        x.new_empty(R, w13.shape[1]),
        x.new_empty(R, **index),
        x.new_empty(topk_ids.shape, **index),
        x.new_empty(w13.shape[0], **index),
        x.new_empty(R, dtype=torch.float32),
    )


@torch.library.custom_op("moegemm::moe_experts_bwd", mutates_args=())
def moe_experts_bwd_op(
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    z: torch.Tensor,
    gather: torch.Tensor,
    pos: torch.Tensor,
    group_sizes: torch.Tensor,
    row_scale: torch.Tensor,
    absent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, x, topk_weights, w13, w2, z, gather, pos, group_sizes, row_scale, absent)


@moe_experts_bwd_op.register_fake
def _(dout, x, topk_weights, w13, w2, z, gather, pos, group_sizes, row_scale, absent=False):
    return (
        x.new_empty(x.shape),
        w13.new_empty(w13.shape),
        w2.new_empty(w2.shape),
        topk_weights.new_empty(pos.shape),
    )


def _setup(ctx, inputs, output):
    x, _, topk_weights, w13, w2 = inputs[:5]
    _, z, gather, pos, group_sizes, row_scale = output
    ctx.save_for_backward(x, topk_weights, w13, w2, z, gather, pos, group_sizes, row_scale)
    ctx.z_box = None
    ctx.absent = len(inputs) > 5 and inputs[5] is not None
    ctx.mark_non_differentiable(*output[1:])


def _setup_eager(ctx, inputs, output):
    """``_setup`` for eager calls, except that z (the block's largest kept tensor, [R, 2n]) is held by the context
    alone, so the backward frees it after fc2's dgrad, its one use, instead of when the whole backward returns:
    the peak of a backward that then writes dx, dw13 and dw2 drops by z's size."""
    x, _, topk_weights, w13, w2 = inputs[:5]
    _, z, gather, pos, group_sizes, row_scale = output
    ctx.save_for_backward(x, topk_weights, w13, w2, gather, pos, group_sizes, row_scale)
    ctx.z_box = [z]
    ctx.absent = len(inputs) > 5 and inputs[5] is not None
    ctx.mark_non_differentiable(*output[1:])


def _backward_from_ctx(ctx, dout, *_):
    if ctx.z_box is None:
        x, topk_weights, w13, w2, z, gather, pos, group_sizes, row_scale = ctx.saved_tensors
        box = [z]
        del z
    else:
        if not ctx.z_box:
            raise RuntimeError(
                "moe_experts: its backward ran twice (retain_graph=True); the fc1 pre-activation is freed by the "
                "first one. Run the block again for a second backward."
            )
        x, topk_weights, w13, w2, gather, pos, group_sizes, row_scale = ctx.saved_tensors
        box = [ctx.z_box.pop()]
    rest = (gather, pos, group_sizes, row_scale)
    if _ops._eager(dout, x, topk_weights, w13, w2, box[0], *rest):
        dx, dw13, dw2, dweights = _backward(dout, x, topk_weights, w13, w2, box, *rest, ctx.absent)
    else:
        dx, dw13, dw2, dweights = moe_experts_bwd_op(
            dout, x, topk_weights, w13, w2, box.pop(), *rest, ctx.absent
        )
    return dx, None, dweights, dw13, dw2, None


moe_experts_op.register_autograd(_backward_from_ctx, setup_context=_setup)


class _MoEFunction(torch.autograd.Function):
    """Eager twin of moegemm::moe_experts's autograd: the same backward; its setup_context lets the backward free
    z early (``_setup_eager``)."""

    @staticmethod
    def forward(x, topk_ids, topk_weights, w13, w2, expert_base=None):
        return _forward(x, topk_ids, topk_weights, w13, w2, expert_base)

    setup_context = staticmethod(_setup_eager)
    backward = staticmethod(_backward_from_ctx)


def moe_experts(
    x, topk_ids, topk_weights, w13, w2, backend: str, expert_base: int | None = None
) -> torch.Tensor:
    """The block's out [T, d] (``moegemm.torch.moe.moe_experts``), differentiable in x, topk_weights, w13, w2.
    ``expert_base``: w13 and w2 hold experts [expert_base, expert_base + E) of a larger set and choices of other
    experts are absent (``routing``); the expert-parallel path's local step."""
    if backend == "reference":
        return reference.moe_experts_reference(x, topk_ids, topk_weights, w13, w2, expert_base=expert_base)
    args = (x, topk_ids, topk_weights, w13, w2, expert_base)
    if not _ops._eager(x, topk_ids, topk_weights, w13, w2):
        return moe_experts_op(*args)[0]
    if _ops._needs_grad(x, topk_weights, w13, w2):
        return _MoEFunction.apply(*args)[0]
    return _forward(*args)[0]
