"""Expert parallelism (EP) for the PyTorch expert block over torch.distributed (docs/design.md, 'Expert parallelism').

Megatron's "allgather" token dispatcher. Rank r of an EP group of size P holds experts [r*E_l, (r+1)*E_l)
(w13 [E_l, 2n, d], w2 [E_l, d, n]) and its own tokens x [T_r, d], topk_ids [T_r, k] (GLOBAL ids), topk_weights
[T_r, k]. With B the per-rank row bound (T_r, or the declared ``max_tokens_per_rank``)::

    x_all, ids_all, w_all = all_gather(pad(x, B)), all_gather(pad(ids, B, -1)), all_gather(pad(w, B, 0))  # [P*B, .]
    out_partial = moe_experts(x_all, ids_all, w_all, w13, w2, expert_base=r*E_l)                    # [P*B, d]
    out = reduce_scatter(out_partial)[:T_r]                                                             # [T_r, d]

Tokens are not permuted: fc1 reads the gathered rows by index (the kernels' gather prologue), so the dispatch
writes straight into the layout fc1 reads, and the combine reads fc2's combined rows in place. Every shape is
static (P*B rows), so there are no split sizes, no host sync, no dropped token, and the path is CUDA-graph safe.
Backward: all_gather's adjoint is reduce_scatter and vice versa (dx, dtopk_weights reduce-scattered); the weight
gradients are local. ``chunks > 1`` pipelines row chunks: chunk i+1's all_gather and chunk i-1's reduce_scatter
run (async) under chunk i's expert GEMMs, forward and backward.

Errors: the config each rank sees alike (``chunks``, the weights' shapes) raises identically everywhere before any
collective. What only the group knows (E_l, d, n, k, B, dtypes on other ranks; a bad input on one rank) is checked in
check mode (``check=True`` / MOEGEMM_CHECK=1) by one metadata all_gather first, raising on every rank with the
values; without it a mismatch across ranks is undefined, as it is for NCCL's collectives. Every rank must also
agree on whether x and topk_weights require grad (the backward's collectives follow it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from moegemm._src.torch.launch import reserved_sms

# SMs the chunked pipeline's expert launches leave to NCCL's kernels (docs/design.md, 'Expert parallelism'): a
# persistent GEMM sized to every SM waits for the SMs a concurrent collective holds.
OVERLAP_SMS = 24

__all__ = [
    "TokenDispatcher",
    "TorchtitanTokenDispatcher",
    "check_consistent",
    "local_experts",
    "moe_experts_ep",
]

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _local():
    """moegemm._src.torch.moe, imported on first use: it imports moegemm.torch, whose __init__ imports this
    module's dispatchers (a top-level import would make importing this module first a cycle)."""
    from moegemm._src.torch import moe

    return moe


def _group_size_rank(group) -> tuple[int, int]:
    if group is None:  # no EP: a group of one, the collectives are identities
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _gather_start(t: torch.Tensor, group):
    """(out [P*rows, ...] rank-major, work or None): the async all_gather of t [rows, ...]."""
    if group is None:
        return t, None
    out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
    return out, _all_gather(out, t.contiguous(), group=group, async_op=True)


def _scatter_start(t: torch.Tensor, group):
    """(out [rows/P, ...], work or None): the async reduce_scatter (sum) of t [rows, ...], rank r's share being rows
    [r*rows/P, (r+1)*rows/P)."""
    if group is None:
        return t, None
    out = t.new_empty((t.shape[0] // dist.get_world_size(group), *t.shape[1:]))
    return out, _reduce_scatter(out, t.contiguous(), group=group, async_op=True)


def _wait(pair):
    out, work = pair
    if work is not None:
        work.wait()  # on NCCL: the current stream waits for the collective's; the host does not
    return out


class _AllGather(torch.autograd.Function):
    """all_gather over rows; its backward is the reduce_scatter of the gradient."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return _wait(_gather_start(t, group))

    @staticmethod
    def backward(ctx, grad):
        return _wait(_scatter_start(grad, ctx.group)), None


class _ReduceScatter(torch.autograd.Function):
    """reduce_scatter (sum) over rows; its backward is the all_gather of the gradient."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return _wait(_scatter_start(t, group))

    @staticmethod
    def backward(ctx, grad):
        return _wait(_gather_start(grad, ctx.group)), None


def _pad_rows(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


class TokenDispatcher:
    """The allgather dispatcher of an EP group (module docstring). Rank r holds experts
    [expert_base, expert_base + num_local_experts), expert_base = r * num_local_experts.

    ``dispatch(x [T, d], topk_ids [T, k], topk_weights [T, k]) -> (x_all [P*B, d], ids_all [P*B, k] int32,
    weights_all [P*B, k])``: every rank's rows, rank-major, each rank's padded to B (padding ids -1: absent).
    ``combine(out_partial [P*B, d]) -> out [T, d]``: the sum over ranks of their partial outputs for this rank's
    rows. Both differentiable (the adjoint collectives) and free of host syncs. ``dispatch`` keeps T for
    ``combine`` (pass ``num_tokens`` to combine a dispatch other than the last one)::

        x_all, ids_all, w_all = disp.dispatch(x, ids, w)
        out = disp.combine(local_step(x_all, ids_all, w_all))   # local_step: moe_experts(..., expert_base=)

    ``group``: a ProcessGroup, or None for no EP (P = 1, no collective). ``max_tokens_per_rank`` (B): the row
    bound every rank declares alike, so that ranks may pass different T <= B; None: B = T, and every rank must
    pass the same T. Ids outside [0, P*num_local_experts) are clamped into it, as the single-process block does.
    torchtitan's contract: ``TorchtitanTokenDispatcher``.
    """

    def __init__(self, group, num_local_experts: int, *, max_tokens_per_rank: int | None = None):
        if max_tokens_per_rank is not None and max_tokens_per_rank < 0:
            raise ValueError(f"TokenDispatcher: max_tokens_per_rank must be >= 0, got {max_tokens_per_rank}")
        self.group = group
        self.size, self.rank = _group_size_rank(group)
        self.num_local_experts = num_local_experts
        self.num_experts = self.size * num_local_experts
        self.expert_base = self.rank * num_local_experts
        self.max_tokens_per_rank = max_tokens_per_rank
        self._num_tokens: int | None = None

    def bound(self, num_tokens: int) -> int:
        """B, the rows each rank sends; raises unless num_tokens <= max_tokens_per_rank."""
        B = self.max_tokens_per_rank
        if B is None:
            return num_tokens
        if num_tokens > B:
            raise ValueError(
                f"TokenDispatcher: rank {self.rank} has {num_tokens} tokens, more than max_tokens_per_rank={B}"
            )
        return B

    def pad(self, x, topk_ids, topk_weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rows padded to B: x [B, d], ids [B, k] int32 (clamped, padding -1), weights [B, k] (0)."""
        B = self.bound(x.shape[0])
        # Clamped before the int32 cast (an int64 id past 2**31 would wrap), into the global range: the
        # single-process block's clamp, so that EP computes what it computes.
        ids = topk_ids.clamp(0, max(self.num_experts - 1, 0)).to(torch.int32)
        return _pad_rows(x, B, 0), _pad_rows(ids, B, -1), _pad_rows(topk_weights, B, 0)

    def dispatch(self, x, topk_ids, topk_weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._num_tokens = x.shape[0]
        x, ids, weights = self.pad(x, topk_ids, topk_weights)
        x_all = _AllGather.apply(x, self.group)
        ids_all = _wait(_gather_start(ids, self.group))
        weights_all = _AllGather.apply(weights, self.group)
        return x_all, ids_all, weights_all

    def combine(self, out_partial: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
        T = self._num_tokens if num_tokens is None else num_tokens
        if T is None:
            raise RuntimeError("TokenDispatcher.combine: no dispatch to combine (pass num_tokens)")
        return _ReduceScatter.apply(out_partial, self.group)[:T]


@dataclasses.dataclass(frozen=True)
class TorchtitanDispatchMetadata:
    """What ``TorchtitanTokenDispatcher.combine`` needs: pos [P*B, k] int32 (the routed row of each gathered
    (token, choice), -1 where absent: another rank's expert or a padding row) and weights [P*B, k]."""

    pos: torch.Tensor
    weights: torch.Tensor


class TorchtitanTokenDispatcher:
    """``TokenDispatcher`` behind torchtitan's token-dispatcher contract (torchtitan
    ``torchtitan/models/common/token_dispatcher.py``, ``BaseEPTokenDispatcher``, commit b5bcd76)::

        wire_meshes(*, ep_mesh)        ep_mesh: a DeviceMesh (its group) or ProcessGroup, None for EP = 1
        dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
            -> (routed_input_RD, num_tokens_per_local_expert_e, metadata)
        combine(routed_output_RD, metadata, x_TD) -> out_TD

    routed_input_RD [R = P*B*k, d]: the gathered rows in local-expert order (a copy, as torchtitan's experts
    read contiguous rows); its first sum(num_tokens_per_local_expert_e) rows are the routed ones, the rest
    (other ranks' experts) are never read back. ``num_tokens_per_local_expert_e`` [E_l] int32 stays on the
    device (torchtitan's GroupedExperts takes it as grouped_mm offsets): R is static, so no host sync.
    ``combine`` weights the routed rows by their scores (torchtitan's experts return unweighted rows), sums each
    token's k rows in a fixed order (deterministic) and reduce-scatters. ``num_local_tokens_per_expert_E`` is not
    needed (the all_gather sends tokens, not counts). Plug in as ``RoutedExperts.token_dispatcher``; moegemm's own
    block (``moe_experts(ep_group=)``) skips the copy and this class: its fc1 reads the gathered rows by index.
    """

    def __init__(self, num_experts: int, top_k: int, *, ep_mesh=None, max_tokens_per_rank: int | None = None):
        self.num_experts = num_experts
        self.top_k = top_k
        self.max_tokens_per_rank = max_tokens_per_rank
        self.wire_meshes(ep_mesh=ep_mesh)

    def wire_meshes(self, *, ep_mesh) -> None:
        group = ep_mesh.get_group() if hasattr(ep_mesh, "get_group") else ep_mesh
        P, _ = _group_size_rank(group)
        if self.num_experts % P:
            raise ValueError(
                f"TorchtitanTokenDispatcher: the EP group size {P} does not divide num_experts={self.num_experts}"
            )
        self.dispatcher = TokenDispatcher(
            group, self.num_experts // P, max_tokens_per_rank=self.max_tokens_per_rank
        )

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E=None):
        del num_local_tokens_per_expert_E
        disp = self.dispatcher
        x_all, ids_all, weights_all = disp.dispatch(x_TD, topk_expert_ids_TK, topk_scores_TK)
        r = _local().routing(ids_all, weights_all, disp.num_local_experts, disp.expert_base)
        routed_input_RD = x_all.index_select(0, r.gather.long())
        return routed_input_RD, r.group_sizes, TorchtitanDispatchMetadata(r.pos, weights_all)

    def combine(self, routed_output_RD, metadata: TorchtitanDispatchMetadata, x_TD) -> torch.Tensor:
        pos = metadata.pos.long()
        rows = routed_output_RD.index_select(0, pos.clamp(min=0).view(-1)).view(*pos.shape, -1)
        # Masked before the product: the rows past the routed ones are whatever the experts left there.
        rows = torch.where((pos >= 0).unsqueeze(-1), rows.float(), 0.0)
        weights = metadata.weights.float()
        weights = torch.where(torch.isfinite(weights), weights, 0.0)
        out_partial = (rows * weights.unsqueeze(-1)).sum(1).to(routed_output_RD.dtype)
        return self.dispatcher.combine(out_partial, x_TD.shape[0])


def check_consistent(group, what: str, fields: dict, error: BaseException | None = None) -> None:
    """Check mode's one metadata exchange (syncs the host): every rank sends ``fields`` and its local input
    error, if any; every rank raises ValueError naming the failing ranks' errors, or each field whose values
    differ with the value per rank. Call it on every rank before the first data collective (then no rank
    waits in a collective that another left by raising)."""
    if group is None:
        if error is not None:
            raise error
        return
    rows: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(
        rows, (fields, None if error is None else f"{type(error).__name__}: {error}"), group=group
    )
    failed = [(r, e) for r, (_, e) in enumerate(rows) if e is not None]
    if failed:
        msg = f"{what}: bad input on rank(s) {[r for r, _ in failed]}: " + "; ".join(
            f"rank {r}: {e}" for r, e in failed
        )
        raise ValueError(msg) from error
    differ = {k: [row[0][k] for row in rows] for k in fields if len({str(row[0][k]) for row in rows}) > 1}
    if differ:
        detail = "; ".join(f"{k} per rank = {v}" for k, v in differ.items())
        raise ValueError(f"{what}: the {len(rows)} ranks of the EP group disagree: {detail}")


def local_experts(group, num_experts: int, dim: int, hidden_dim: int, top_k: int, dtype) -> int:
    """E/P, the experts this rank holds, for ``MoE(ep_group=)``: raises ValueError unless P divides E (the same
    on every rank when E is), then checks once that every rank has the same configuration (``check_consistent``,
    a host sync at construction)."""
    P, _ = _group_size_rank(group)
    if num_experts % P:
        raise ValueError(f"MoE: the EP group size {P} does not divide num_experts={num_experts}")
    fields = {
        "num_experts": num_experts,
        "dim": dim,
        "hidden_dim": hidden_dim,
        "top_k": top_k,
        "dtype": str(dtype),
    }
    check_consistent(group, "MoE(ep_group=)", fields)
    return num_experts // P


# ---------------------------------------------------------------- the chunked pipeline


def _chunks(B: int, chunks: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) of the nonempty chunks of B rows (the same on every rank: B and chunks agree)."""
    base, extra = divmod(B, chunks)
    bounds, a = [], 0
    for i in range(chunks):
        b = a + base + (i < extra)
        if b > a:
            bounds.append((a, b))
        a = b
    return bounds


def _accumulate(acc: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor | None:
    """The chunks' weight gradients summed in fp32, cast once by the caller; the first chunk's is kept as it is
    (one chunk: no fp32 copy of a gradient as large as the weights)."""
    if grad is None:
        return acc
    if acc is None:
        return grad
    return (acc if acc.dtype == torch.float32 else acc.float()).add_(grad)


def _cast_or_zeros(acc: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if acc is None else acc.to(like.dtype)


class _Pipeline(torch.autograd.Function):
    """The EP block over row chunks with the collectives overlapped (docs/design.md, 'Expert parallelism').

    forward(x [B, d], ids [B, k] int32, weights [B, k], w13, w2, disp, backend, bounds) -> out [B, d]; chunk i's
    local step builds its own autograd graph (kept on ctx), which the backward runs chunk by chunk, mirroring
    the forward: chunk i+1's dout all_gather and chunk i-1's dx/dweights reduce_scatter run under chunk i's
    backward. The chunks' weight gradients are summed in fp32 and cast once."""

    @staticmethod
    def forward(ctx, x, ids, weights, w13, w2, disp, backend, bounds):
        group = disp.group
        need_x, _, need_w, need_13, need_2 = ctx.needs_input_grad[:5]
        track = need_x or need_w or need_13 or need_2
        w13_leaf = w13.detach().requires_grad_(need_13)
        w2_leaf = w2.detach().requires_grad_(need_2)

        def start(i):
            a, b = bounds[i]
            return [_gather_start(t[a:b], group) for t in (x, ids, weights)]

        pending = start(0) if bounds else None
        graphs, scatters = [], []
        for i in range(len(bounds)):
            x_all, ids_all, w_all = (_wait(p) for p in pending)
            if i + 1 < len(bounds):
                pending = start(i + 1)  # under this chunk's GEMMs
            with torch.set_grad_enabled(track), reserved_sms(OVERLAP_SMS if len(bounds) > 1 else 0):
                x_all = x_all.detach().requires_grad_(need_x)
                w_all = w_all.detach().requires_grad_(need_w)
                y = _local().moe_experts(x_all, ids_all, w_all, w13_leaf, w2_leaf, backend, disp.expert_base)
            graphs.append((y, x_all, w_all))
            scatters.append(_scatter_start(y.detach(), group))  # under the next chunk's GEMMs
        out = torch.cat([_wait(s) for s in scatters]) if scatters else x.new_zeros(x.shape)
        ctx.graphs, ctx.leaves, ctx.disp, ctx.bounds = graphs, (w13_leaf, w2_leaf), disp, bounds
        ctx.shapes = (x.shape, weights.shape, weights.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        group, bounds, graphs = ctx.disp.group, ctx.bounds, ctx.graphs
        ctx.graphs = None  # each chunk's graph goes with its backward
        w13_leaf, w2_leaf = ctx.leaves
        need_x, _, need_w, need_13, need_2 = ctx.needs_input_grad[:5]
        x_shape, w_shape, w_dtype = ctx.shapes
        acc = {"13": None, "2": None}
        dout = dout.contiguous()

        def start(i):
            a, b = bounds[i]
            return _gather_start(dout[a:b], group)

        pending = start(0) if bounds else None
        dxs, dws = [], []
        for i in range(len(bounds)):
            g = _wait(pending)
            if i + 1 < len(bounds):
                pending = start(i + 1)
            y, x_all, w_all = graphs[i]
            graphs[i] = None
            wanted = [
                (n, t)
                for n, t, need in (
                    ("x", x_all, need_x),
                    ("w", w_all, need_w),
                    ("13", w13_leaf, need_13),
                    ("2", w2_leaf, need_2),
                )
                if need
            ]
            grads = dict.fromkeys(("x", "w", "13", "2"))
            if y.requires_grad:
                with reserved_sms(OVERLAP_SMS if len(bounds) > 1 else 0):
                    got = torch.autograd.grad(y, [t for _, t in wanted], g, allow_unused=True)
                grads.update({n: gr for (n, _), gr in zip(wanted, got)})
            del y
            if need_x:
                dx_all = grads["x"] if grads["x"] is not None else torch.zeros_like(x_all)
                dxs.append(_scatter_start(dx_all, group))
            if need_w:
                dw_all = grads["w"] if grads["w"] is not None else torch.zeros_like(w_all)
                dws.append(_scatter_start(dw_all, group))
            for name in ("13", "2"):
                acc[name] = _accumulate(acc[name], grads[name])
        dx = (torch.cat([_wait(s) for s in dxs]) if dxs else dout.new_zeros(x_shape)) if need_x else None
        dw = (
            (torch.cat([_wait(s) for s in dws]) if dws else dout.new_zeros(w_shape, dtype=w_dtype))
            if need_w
            else None
        )
        dw13 = _cast_or_zeros(acc["13"], w13_leaf) if need_13 else None
        dw2 = _cast_or_zeros(acc["2"], w2_leaf) if need_2 else None
        return dx, None, dw, dw13, dw2, None, None, None


def moe_experts_ep(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    group,
    *,
    backend: str,
    chunks: int = 1,
    max_tokens_per_rank: int | None = None,
    check: bool = False,
    validate: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """The EP expert block on rank r (module docstring): x [T_r, d], topk_ids [T_r, k] global ids, topk_weights
    [T_r, k], w13 [E_l, 2n, d], w2 [E_l, d, n] (experts [r*E_l, (r+1)*E_l)) -> out [T_r, d], equal to the
    single-process block with all P*E_l experts on this rank's tokens, differentiable in x, topk_weights, w13, w2.

    ``out = reduce_scatter(moe_experts(all_gather(x), ..., expert_base=r*E_l))[:T_r]``.

    ``validate(E)``: the caller's local input checks for E global experts (``moegemm.torch.moe_experts``'s);
    in ``check`` mode its error is exchanged with the metadata, so every rank raises. No host sync otherwise.
    """
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"moe_experts: chunks must be an int >= 1, got {chunks!r}")
    disp = TokenDispatcher(group, w13.shape[0], max_tokens_per_rank=max_tokens_per_rank)
    if check:
        error = None
        try:
            if validate is not None:
                validate(disp.num_experts)
            disp.bound(x.shape[0])
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
            error = e
        B = x.shape[0] if max_tokens_per_rank is None else max_tokens_per_rank
        fields = {
            "num_local_experts (E/P)": w13.shape[0],
            "w13 [E_l, 2n, d]": tuple(w13.shape),
            "k": topk_ids.shape[-1],
            "rows per rank (B)": B,
            "chunks": chunks,
            "x dtype": str(x.dtype),
            "topk_weights dtype": str(topk_weights.dtype),
            # The backward reduce-scatters dx and dtopk_weights where they are wanted: every rank must want them.
            "x, topk_weights require grad": (x.requires_grad, topk_weights.requires_grad),
        }
        check_consistent(group, "moe_experts(ep_group=)", fields, error)
    elif validate is not None:
        validate(disp.num_experts)
    # One autograd node over the whole pipeline, for chunks = 1 too: its backward runs every collective on
    # every rank even where the local step's graph misses an input (the reference twin with no local choice),
    # where per-collective nodes would leave the other ranks waiting.
    x_pad, ids_pad, w_pad = disp.pad(x, topk_ids, topk_weights)
    bounds = _chunks(x_pad.shape[0], chunks)
    return _Pipeline.apply(x_pad, ids_pad, w_pad, w13, w2, disp, backend, bounds)[: x.shape[0]]
