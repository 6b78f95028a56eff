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

from moegemm._src import fp8, plan
from moegemm._src.moe import Routing
from moegemm._src.torch import ops as _ops
from moegemm._src.torch import reference as _ref
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
from moegemm._src.torch.launch_fp8 import (
    fp8_epilogue_split,
    launch_m_grouped_fp8,
    launch_swiglu,
    launch_swiglu_bwd,
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
    return dx, dw13, dw2, _routing_weight_grad(ds, pos, topk_weights)


def _routing_weight_grad(ds, pos, topk_weights):
    """The routing weights' gradient <dout[t], y_row> [T, k]: the fc2 dgrad's per-tile sums ds [*, R], added in tile
    order. An absent choice (pos -1, expert parallelism) has no row: its gradient is 0; a non-finite weight counts as
    the constant 0 in the forward, so its gradient is 0 (as the reference twin's)."""
    if ds.shape[1] == 0:
        return topk_weights.new_zeros(pos.shape)
    dweights = torch.where(pos >= 0, ds.sum(0)[pos.view(-1).long().clamp(min=0)].view(pos.shape), 0.0)
    dweights = torch.where(torch.isfinite(topk_weights), dweights, 0.0)
    return dweights.to(topk_weights.dtype)


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
def _moe_experts_fake(x, topk_ids, topk_weights, w13, w2, expert_base=None):
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


# ---------------------------------------------------------------- FP8 (docs/design.md, 'FP8 expert block')

E4M3 = torch.float8_e4m3fn


def _fp8_gemm(x_q, sx, w_q, sw, group_sizes, recipe, fast_accum, backend, gather, epilogue, dtype, z=None,
              row_scale=None):  # fmt: skip
    """The FP8 m-grouped product x_q[gather] @ w_q[g]^T (x_q [Mx, K], gather [R], w_q [G, N, K]) with a SwiGLU
    epilogue, its outputs in ``dtype``: "swiglu" -> (z [R, N], h [R, N / 2]); "swiglu_bwd" (the product is dh, z
    and row_scale given) -> (dz [R, 2N], s * h [R, N], ds [*, R] fp32, summed over its first axis, and ``_amaxes``).
    One fused launch (``launch_m_grouped_fp8``), the split form (``plan.fp8_epilogue_split``), or the twin."""
    R, N = gather.shape[0], w_q.shape[1]
    device = x_q.device
    if backend == "reference":
        xd = _ref.dequantize_activation(x_q, sx, recipe, None)[gather.long()]
        wd = _ref.dequantize_weight(w_q, sw, recipe)
        acc = reference.m_grouped_mm_reference(
            xd, wd.mT, group_sizes, None, out_dtype=torch.float32, compute_dtype=torch.float32
        )
        if epilogue == "swiglu":
            return _ref.swiglu_epilogue(acc, dtype)
        dz, hs, ds = _ref.swiglu_bwd_epilogue(acc, z, row_scale)
        return dz, hs, ds, _amaxes(dz, hs, recipe)
    if not fp8_epilogue_split(x_q, w_q, R, recipe, fast_accum, epilogue):
        if epilogue == "swiglu":
            z = _ops.empty(R, N, dtype=dtype, device=device)
            h = _ops.empty(R, N // 2, dtype=dtype, device=device)
            launch_m_grouped_fp8(
                x_q,
                sx,
                w_q,
                sw,
                group_sizes,
                h,
                None,
                recipe,
                fast_accum,
                gather=gather,
                epilogue=epilogue,
                act=z,
            )
            return z, h
        dz = _ops.empty(R, 2 * N, dtype=dtype, device=device)
        hs = _ops.empty(R, N, dtype=dtype, device=device)
        ds = launch_m_grouped_fp8(
            x_q, sx, w_q, sw, group_sizes, dz, None, recipe, fast_accum, gather=gather, epilogue=epilogue, act=z,
            row_scale=row_scale, act_out=hs,
        )  # fmt: skip
        return dz, hs, ds, _amaxes(dz, hs, recipe)
    # The split form: x's gathered FP8 rows (whole 16-byte storage rows) and their scales copied into expert order,
    # the plain launch (the warp-specialized kernel), the SwiGLU row kernel. The copy is freed before the row
    # kernel's outputs exist, and dh lives in s * h's buffer (the row kernel reads each tile of dh before it writes
    # that tile of s * h), so the peak stays the fused form's.
    K = x_q.shape[1]
    xg = _storage_rows(x_q).index_select(0, gather).view(x_q.dtype)[:, :K]
    if recipe == "rowwise":
        sx = sx.index_select(0, gather)
    elif recipe == "blockwise":
        sx = sx.T.index_select(1, gather).T  # stays M-major, as the kernels read a tile's row scales
    if epilogue == "swiglu":
        z = _ops.empty(R, N, dtype=dtype, device=device)
        launch_m_grouped_fp8(xg, sx, w_q, sw, group_sizes, z, None, recipe, fast_accum)
        del xg, sx
        h = _ops.empty(R, N // 2, dtype=dtype, device=device)
        launch_swiglu(z, h)
        return z, h
    hs = _ops.empty(R, N, dtype=dtype, device=device)
    launch_m_grouped_fp8(xg, sx, w_q, sw, group_sizes, hs, None, recipe, fast_accum)
    del xg, sx
    dz = _ops.empty(R, 2 * N, dtype=dtype, device=device)
    amax = torch.zeros(2, dtype=torch.float32, device=device) if recipe == "tensorwise" else None
    ds = launch_swiglu_bwd(hs, z, row_scale, dz, hs, amax)
    return dz, hs, ds, (None, None) if amax is None else (amax[:1], amax[1:])


def _amaxes(dz: torch.Tensor, hs: torch.Tensor, recipe: str) -> tuple:
    """Tensorwise: ([1] max |dz|, [1] max |hs|) fp32, what the split form's row kernel finds (one scale for each
    tensor, not one per group); (None, None) for the other recipes."""
    if recipe != "tensorwise":
        return None, None
    return tuple(
        t.abs().amax().float().reshape(1) if t.numel() else t.new_zeros(1, dtype=torch.float32)
        for t in (dz, hs)
    )


def _storage_rows(q: torch.Tensor) -> torch.Tensor:
    """The whole storage rows of an FP8 data view q [M, K] (rows padded to 16 bytes: ``fp8.padded``) as uint8."""
    return q.view(torch.uint8).as_strided((q.shape[0], q.stride(0)), (q.stride(0), 1))


def _combine(rows, pos, weight, out_dtype, backend):
    if backend == "reference":
        return _ref.combine(rows, pos, weight, out_dtype)
    out = _ops.empty(pos.shape[0], rows.shape[1], dtype=out_dtype, device=rows.device)
    launch_combine(rows, pos, weight, out)
    return out


def _rows_t(src, src_q, src_scale, gather, group_sizes, recipe, backend):
    """(data_t, scale_t) of the rows src[gather] in group_sizes' groups (a wgrad operand, ``_ops.quantize_gathered_t``).
    Tensorwise moves the bytes of src's token-order FP8 copy src_q [T, *] (scale src_scale [1]); the other
    recipes requantize src."""
    if recipe != "tensorwise":
        return _ops.quantize_gathered_t(src, gather, group_sizes, recipe, E4M3, backend)
    return _ops.gathered_t_bytes(src_q, gather, group_sizes, backend), src_scale.expand(group_sizes.shape[0])


def _fp8_forward(x, topk_ids, topk_weights, w13_q, w2_q, recipe, backend):
    """(out [T, d], z [R, 2n], *Routing, x_q, sx). w13_q, w2_q: (data, scale, data_t, scale_t) of each weight
    (``_ops.quantize_weight_views``). x is quantized once per token (fc1 gathers its rows and row scales), h per
    expert group; fc1 and fc2 take fast accumulation where the recipe has it (tensorwise, rowwise), as
    GroupedLinear's fprop does. x_q [T, padded d] and sx [1]: tensorwise's FP8 x (storage rows) and scale, which
    the backward's wgrad reads in place of x (0-element for the other recipes, whose wgrad requantizes x)."""
    T, d = x.shape
    E, two_n, _ = w13_q[0].shape
    r = routing(topk_ids, topk_weights, E)
    x_s, sx_s, _, _, _ = _ops.quantize(x, None, recipe, E4M3, False, 1, backend)  # token-order storage
    x_q, sx = x_s[:, :d], (sx_s.T if recipe == "blockwise" else sx_s)
    z, h = _fp8_gemm(
        x_q, sx, w13_q[0], w13_q[1], r.group_sizes, recipe, True, backend, r.gather, "swiglu", x.dtype
    )
    if recipe == "tensorwise":
        kept = (x_s, sx_s)
    else:
        kept = (x.new_empty(0, dtype=E4M3), x.new_empty(0, dtype=torch.float32))
    del x_s, sx_s, x_q, sx
    h_q, sh, _, _, _ = _ops.quantize_activation_views(h, r.group_sizes, recipe, E4M3, False, backend)
    del h
    y = _ops.m_grouped_fp8(h_q, sh, w2_q[0], w2_q[1], r.group_sizes, None, recipe, x.dtype, True, backend)
    del h_q, sh
    out = _combine(y, r.pos, topk_weights.contiguous(), x.dtype, backend)
    return out, z, *r, *kept


def _fp8_backward(dout, x, x_q, sx, topk_weights, z, gather, pos, group_sizes, row_scale, w13_t, sw13_t, w2_t,
                  sw2_t, recipe, backend, w_dtype):  # fmt: skip
    """(dx, dw13, dw2, dtopk_weights) of the FP8 block; w13_t [E, d, 2n], w2_t [E, n, d]: the weights' dgrad copies
    and their scales. dout is quantized once per token (fc2's dgrad gathers it, with the SwiGLU backward in its
    epilogue); the wgrads read transposed copies of dout's and x's rows in expert order, of s * h and of dz (dz's
    data and copy from one read). Every backward GEMM promotes (TE's split accumulator); dW leaves in w_dtype.
    x: the block's input (rowwise, blockwise; 0-element for tensorwise), x_q and sx: tensorwise's FP8 x and scale
    (``_fp8_forward``). z: the kept pre-activation, or a one-element list holding it (emptied here: ``_backward``)."""
    if isinstance(z, list):
        z = z.pop()
    _, n, _ = w2_t.shape
    R = gather.shape[0]
    dout = dout.contiguous()
    d_q, sd, _, _, _ = _ops.quantize_activation_views(dout, None, recipe, E4M3, False, backend)
    dz, hs, ds, (dz_amax, hs_amax) = _fp8_gemm(
        d_q,
        sd,
        w2_t,
        sw2_t,
        group_sizes,
        recipe,
        False,
        backend,
        gather,
        "swiglu_bwd",
        dout.dtype,
        z,
        row_scale,
    )
    del z
    # The wgrads' copies of dout's and x's rows in expert order are read through gather by the quantize kernels
    # (no [R, d] copies): tensorwise moves the FP8 bytes of the token-order copies, the others requantize.
    dout_t, sdout_t = _rows_t(dout, d_q, sd, gather, group_sizes, recipe, backend)
    del d_q, sd
    # Tensorwise has no transposed-copy-only quantize (its copy shares the data's group scale): it writes both.
    data = recipe == "tensorwise"
    # Tensorwise scales dz and s * h by their amax, which the SwiGLU backward found as it wrote them.
    _, _, hs_t, shs_t, _ = _ops.quantize_activation_views(
        hs, group_sizes, recipe, E4M3, True, backend, data, hs_amax
    )
    del hs
    dw2 = _ops.k_grouped_fp8(dout_t, sdout_t, hs_t, shs_t, group_sizes, R, recipe, False, backend, w_dtype)
    del dout_t, sdout_t, hs_t, shs_t
    dz_q, sdz, dz_t, sdz_t, _ = _ops.quantize_activation_views(
        dz, group_sizes, recipe, E4M3, True, backend, amax=dz_amax
    )
    del dz
    dx_rows = _ops.m_grouped_fp8(
        dz_q, sdz, w13_t, sw13_t, group_sizes, None, recipe, dout.dtype, False, backend
    )
    del dz_q, sdz
    dx = _combine(dx_rows, pos, None, dout.dtype, backend)
    del dx_rows
    x_q = x_q[:, : dout.shape[1]] if recipe == "tensorwise" else x_q  # storage rows: the values' columns
    x_t, sx_t = _rows_t(x, x_q, sx, gather, group_sizes, recipe, backend)
    dw13 = _ops.k_grouped_fp8(dz_t, sdz_t, x_t, sx_t, group_sizes, R, recipe, False, backend, w_dtype)
    del dz_t, sdz_t, x_t, sx_t
    return dx, dw13, dw2, _routing_weight_grad(ds, pos, topk_weights)


@torch.library.custom_op("moegemm::moe_experts_fp8", mutates_args=())
def moe_experts_fp8_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_q: list[torch.Tensor],
    w2_q: list[torch.Tensor],
    recipe: str,
    backend: str,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """w13, w2: the high-precision weights (their gradients' shapes and dtype; not read); w13_q, w2_q: their
    quantized views (data, scale, data_t, scale_t)."""
    return _fp8_forward(x, topk_ids, topk_weights, w13_q, w2_q, recipe, backend)


@moe_experts_fp8_op.register_fake
def _(x, topk_ids, topk_weights, w13, w2, w13_q, w2_q, recipe, backend):
    T, d = x.shape
    kept = (T, fp8.padded(d)) if recipe == "tensorwise" else (0,)
    return (
        *_moe_experts_fake(x, topk_ids, topk_weights, w13, w2),  # the BF16 op's outputs
        x.new_empty(kept, dtype=E4M3),
        x.new_empty((1,) if recipe == "tensorwise" else (0,), dtype=torch.float32),
    )


@torch.library.custom_op("moegemm::moe_experts_fp8_bwd", mutates_args=())
def moe_experts_fp8_bwd_op(
    dout: torch.Tensor,
    x: torch.Tensor,
    x_q: torch.Tensor,
    sx: torch.Tensor,
    topk_weights: torch.Tensor,
    z: torch.Tensor,
    gather: torch.Tensor,
    pos: torch.Tensor,
    group_sizes: torch.Tensor,
    row_scale: torch.Tensor,
    w13_t: torch.Tensor,
    sw13_t: torch.Tensor,
    w2_t: torch.Tensor,
    sw2_t: torch.Tensor,
    recipe: str,
    backend: str,
    w_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fp8_backward(
        dout, x, x_q, sx, topk_weights, z, gather, pos, group_sizes, row_scale, w13_t, sw13_t, w2_t, sw2_t, recipe,
        backend, w_dtype,
    )  # fmt: skip


@moe_experts_fp8_bwd_op.register_fake
def _(dout, x, x_q, sx, topk_weights, z, gather, pos, group_sizes, row_scale, w13_t, sw13_t, w2_t, sw2_t, recipe,
      backend, w_dtype):  # fmt: skip
    E, d, two_n = w13_t.shape
    return (
        dout.new_empty(dout.shape),
        x.new_empty((E, two_n, d), dtype=w_dtype),
        x.new_empty((E, d, two_n // 2), dtype=w_dtype),
        topk_weights.new_empty(pos.shape),
    )


def _fp8_setup(ctx, inputs, output, eager=False):
    """Saves what ``_fp8_backward`` reads (the weights' dgrad copies, not the weights); z as a saved tensor, or
    (eager) in a box the backward empties after its one use, as ``_setup_eager``."""
    x, _, topk_weights, w13, _, w13_q, w2_q, recipe, backend = inputs
    _, z, gather, pos, group_sizes, row_scale, x_q, sx = output
    dgrad = (w13_q[2], w13_q[3], w2_q[2], w2_q[3])
    # Tensorwise's wgrad reads x's FP8 copy, the others x itself: one of them is kept.
    kept = (x.new_empty(0, x.shape[1]), x_q, sx) if recipe == "tensorwise" else (x, x_q, sx)
    ctx.save_for_backward(
        *kept, topk_weights, gather, pos, group_sizes, row_scale, *dgrad, *(() if eager else (z,))
    )
    ctx.z_box = [z] if eager else None
    ctx.fp8 = (recipe, backend, w13.dtype)
    ctx.mark_non_differentiable(*output[1:])


def _fp8_backward_from_ctx(ctx, dout, *_):
    x, x_q, sx, topk_weights, gather, pos, group_sizes, row_scale, *rest = ctx.saved_tensors
    if ctx.z_box is None:
        box = [rest.pop()]
    elif not ctx.z_box:
        raise RuntimeError(
            "moe_experts: its backward ran twice (retain_graph=True); the fc1 pre-activation is freed by the "
            "first one. Run the block again for a second backward."
        )
    else:
        box = [ctx.z_box.pop()]
    recipe, backend, w_dtype = ctx.fp8
    args = (
        x,
        x_q,
        sx,
        topk_weights,
        box,
        gather,
        pos,
        group_sizes,
        row_scale,
        *rest,
        recipe,
        backend,
        w_dtype,
    )
    if _ops._eager(dout, x, x_q, sx, topk_weights, box[0], gather, pos, group_sizes, row_scale, *rest):
        dx, dw13, dw2, dweights = _fp8_backward(dout, *args)
    else:
        dx, dw13, dw2, dweights = moe_experts_fp8_bwd_op(dout, *args[:4], box.pop(), *args[5:])
    # The custom op's list inputs take a list of gradients each; the autograd.Function's one None.
    quantized = (None, None) if ctx.z_box is not None else ([None] * 4, [None] * 4)
    return dx, None, dweights, dw13, dw2, *quantized, None, None


moe_experts_fp8_op.register_autograd(_fp8_backward_from_ctx, setup_context=_fp8_setup)


class _MoEFp8Function(torch.autograd.Function):
    """Eager twin of moegemm::moe_experts_fp8's autograd (the same forward and backward; z in a box)."""

    @staticmethod
    def forward(x, topk_ids, topk_weights, w13, w2, w13_q, w2_q, recipe, backend):
        return _fp8_forward(x, topk_ids, topk_weights, w13_q, w2_q, recipe, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _fp8_setup(ctx, inputs, output, eager=True)

    backward = staticmethod(_fp8_backward_from_ctx)


def moe_experts_fp8(
    x, topk_ids, topk_weights, w13, w2, recipe: str, backend: str, caches=None
) -> torch.Tensor:
    """The FP8 block's out [T, d] (``moegemm.torch.moe.moe_experts`` with ``fp8_recipe``), differentiable in x,
    topk_weights, w13 and w2; ``backend`` "reference" runs every launch's twin (the CPU fallback). caches: a pair
    of ``Fp8WeightCache`` for w13 and w2 (their quantized copies reused while the weights are unchanged), or None
    (both quantized in this call)."""
    if caches is None:
        w13_q = _ops.quantize_weight_views(w13, recipe, backend)
        w2_q = _ops.quantize_weight_views(w2, recipe, backend)
    else:
        w13_q = caches[0].get(w13, recipe, backend)
        w2_q = caches[1].get(w2, recipe, backend)
    args = (x, topk_ids, topk_weights, w13, w2, list(w13_q), list(w2_q), recipe, backend)
    if not _ops._eager(x, topk_ids, topk_weights, w13, w2):
        return moe_experts_fp8_op(*args)[0]
    if _ops._needs_grad(x, topk_weights, w13, w2):
        return _MoEFp8Function.apply(*args)[0]
    return _fp8_forward(x, topk_ids, topk_weights, w13_q, w2_q, recipe, backend)[0]


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
