"""The MoE layer as nn.Modules: a top-k ``Router``; ``MoE`` = router + ``moe_experts`` + shared experts.

For x [T, d] (leading dims flattened to T rows), with s = score_func(x @ router.weight^T) [T, E] in fp32::

    c      = s + expert_bias                      (load_balance="bias"; else c = s; the bias only selects)
    groups = keep the num_limited_groups best of num_expert_groups groups of c (group score: sum of its
             top-2 with sigmoid, its max with softmax); the other groups' experts are out of the choice
    ids    = topk(c, top_k) [T, k]
    w      = s[ids] (/ sum_j s[ids_j] if route_norm) * route_scale   [T, k] fp32
    out    = moe_experts(x, ids, w, w13, w2) + shared(x)               shared(x) = SwiGLU FFN, or 0

Load balancing: ``load_balance="aux_loss"`` sets ``moe.aux_loss = aux_loss_coef * E * sum_e f_e * P_e`` after
each forward, with f_e = (tokens routed to e) / (T * k) and P_e = mean_t p[t, e], p = s normalized over
experts (s itself for softmax); f is a count and carries no gradient, P carries it to the router.
``load_balance="bias"`` keeps the aux-loss-free expert bias (DeepSeek-V3, arXiv 2408.15664): call
``update_expert_bias()`` once per optimizer step.
``moe.tokens_per_expert`` [E] fp32 accumulates the routed (token, choice) counts of the training-mode forwards
on the device (no host sync) until ``update_expert_bias()`` or ``reset_tokens_per_expert()`` zeroes it.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moegemm._src import fp8
from moegemm._src.moe import check_router
from moegemm._src.torch import ep as _ep
from moegemm._src.torch.args import Backend
from moegemm.torch.grouped_linear import Fp8WeightCache
from moegemm.torch.moe import moe_experts

__all__ = ["MoE", "Router", "SwiGLU"]

ScoreFunc = Literal["softmax", "sigmoid"]
LoadBalance = Literal["aux_loss", "bias"] | None


class Router(nn.Module):
    """Token-choice top-k router over E experts, optionally group-limited (module docstring).

    ``forward(x [T, d], expert_bias [E] | None) -> (topk_weights [T, k] fp32, topk_ids [T, k] int64,
    scores [T, E] fp32)``. ``scores`` are score_func of the logits, computed in fp32 whatever x's dtype.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        check_router(num_experts, top_k, score_func, num_expert_groups, num_limited_groups)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.gate = nn.Linear(dim, num_experts, bias=False, dtype=dtype, device=device)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """score_func(x @ gate.weight^T) [T, E] in fp32 (the GEMM in x's dtype, the nonlinearity in fp32)."""
        logits = self.gate(x).float()
        return torch.sigmoid(logits) if self.score_func == "sigmoid" else torch.softmax(logits, dim=-1)

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with the experts of all but the num_limited_groups best groups set to -inf."""
        G = self.num_expert_groups
        grouped = choice.unflatten(-1, (G, self.num_experts // G))  # [T, G, E/G]
        if self.score_func == "sigmoid":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(-1)
        keep = group_scores.topk(self.num_limited_groups, dim=-1).indices  # [T, num_limited_groups]
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(-1, keep, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).flatten(-2)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.scores(x)
        with torch.no_grad():  # the selection is integer: no gradient flows through it
            choice = scores if expert_bias is None else scores + expert_bias
            if self.num_expert_groups is not None:
                choice = self._limit_groups(choice)
            topk_ids = choice.topk(self.top_k, dim=-1).indices
        topk_weights = scores.gather(-1, topk_ids)  # the bias selects; the weights are the unbiased scores
        if self.route_norm:
            topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
        return topk_weights * self.route_scale, topk_ids, scores

    def init_weights(self, init_std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std, a=-2 * init_std, b=2 * init_std)


class SwiGLU(nn.Module):
    """The shared experts' SwiGLU FFN: ``w2(silu(w1(x)) * w3(x))``; w1, w3 [hidden, dim], w2 [dim, hidden]."""

    def __init__(self, dim: int, hidden_dim: int, *, dtype=None, device=None):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False, dtype=dtype, device=device)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float = 0.02) -> None:
        _trunc_normal(self.w1.weight, 0.02)
        _trunc_normal(self.w2.weight, init_std)
        _trunc_normal(self.w3.weight, init_std)


def _trunc_normal(t: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(t, mean=0.0, std=std, a=-2 * std, b=2 * std)


class MoE(nn.Module):
    """Router + routed SwiGLU experts on ``moegemm.torch.moe_experts`` + shared experts (module docstring).

    Parameters: ``router.gate.weight`` [E, dim]; ``w13`` [E, 2 * hidden_dim, dim] (gate rows, then up rows);
    ``w2`` [E, dim, hidden_dim]; ``shared`` (a SwiGLU of hidden ``shared_experts * hidden_dim``) when
    shared_experts > 0. Buffers: ``expert_bias`` [E] fp32 (load_balance="bias", persistent) and
    ``tokens_per_expert`` [E] fp32 (not persistent). ``forward(x [..., dim]) -> [..., dim]`` in x's dtype,
    with no host sync; ``backend`` is passed to ``moe_experts``.

    ``ep_group`` (expert parallelism, docs/design.md, 'Expert parallelism'): this rank (r of P) holds experts
    [r*E/P, (r+1)*E/P) only: ``w13`` [E/P, 2 * hidden_dim, dim], ``w2`` [E/P, dim, hidden_dim]; the router and
    the shared experts stay whole. ``chunks`` and ``max_tokens_per_rank`` go to ``moe_experts``. The ranks'
    configurations are checked to agree once, here (every rank raises otherwise).

    ``fp8_recipe`` ("tensorwise", "rowwise", "blockwise"; docs/design.md, 'FP8 expert block'): the routed experts'
    GEMMs in FP8; the module keeps w13's and w2's FP8 copies while the weights are unchanged (re-quantized after
    each optimizer step; under torch.compile in every call). Single process only.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        load_balance: LoadBalance = "aux_loss",
        aux_loss_coef: float = 1e-2,
        bias_update_rate: float = 1e-3,
        shared_experts: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        backend: Backend = "auto",
        ep_group=None,
        chunks: int = 1,
        max_tokens_per_rank: int | None = None,
        fp8_recipe: str | None = None,
    ):
        super().__init__()
        if fp8_recipe is not None:
            fp8.check_recipe(fp8_recipe)
            if ep_group is not None:
                raise NotImplementedError(
                    f"MoE: fp8_recipe={fp8_recipe!r} with ep_group: the FP8 expert block runs on one process only"
                )
        self.fp8_recipe = fp8_recipe
        self._fp8_caches = (Fp8WeightCache(), Fp8WeightCache())
        if load_balance not in ("aux_loss", "bias", None):
            raise ValueError(f"MoE: load_balance must be 'aux_loss', 'bias' or None, got {load_balance!r}")
        if shared_experts < 0:
            raise ValueError(f"MoE: shared_experts must be >= 0, got {shared_experts}")
        self.dim, self.hidden_dim, self.num_experts, self.top_k = dim, hidden_dim, num_experts, top_k
        self.load_balance = load_balance
        self.aux_loss_coef = aux_loss_coef
        self.bias_update_rate = bias_update_rate
        self.backend = backend
        self.ep_group, self.chunks, self.max_tokens_per_rank = ep_group, chunks, max_tokens_per_rank
        local_experts = (
            num_experts
            if ep_group is None
            else _ep.local_experts(ep_group, num_experts, dim, hidden_dim, top_k, dtype)
        )
        self.router = Router(
            dim,
            num_experts,
            top_k,
            score_func=score_func,
            route_norm=route_norm,
            route_scale=route_scale,
            num_expert_groups=num_expert_groups,
            num_limited_groups=num_limited_groups,
            dtype=dtype,
            device=device,
        )
        factory = {"dtype": dtype, "device": device}
        self.w13 = nn.Parameter(torch.empty(local_experts, 2 * hidden_dim, dim, **factory))
        self.w2 = nn.Parameter(torch.empty(local_experts, dim, hidden_dim, **factory))
        self.shared = SwiGLU(dim, shared_experts * hidden_dim, **factory) if shared_experts else None
        self.register_buffer(
            "expert_bias",
            torch.zeros(num_experts, dtype=torch.float32, device=device) if load_balance == "bias" else None,
            persistent=True,
        )
        self.register_buffer(
            "tokens_per_expert",
            torch.zeros(num_experts, dtype=torch.float32, device=device),
            persistent=False,
        )
        self.aux_loss: torch.Tensor | None = None
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.init_weights()

    def init_weights(self, init_std: float = 0.02) -> None:
        """Truncated normal (±2 std) as torchtitan: the gate projection std 0.02, up, down, router and shared
        experts ``init_std``; zeroes the expert bias and the token counts."""
        n = self.hidden_dim
        with torch.no_grad():
            _trunc_normal(self.w13[:, :n], 0.02)
            _trunc_normal(self.w13[:, n:], init_std)
            _trunc_normal(self.w2, init_std)
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.tokens_per_expert.zero_()
        self.router.init_weights(init_std)
        if self.shared is not None:
            self.shared.init_weights(init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # Checked here: x.reshape(-1, dim) would otherwise take x [4, 32] at dim=16 as 8 tokens.
        if x.dim() == 0 or shape[-1] != self.dim:
            raise ValueError(f"MoE: x.shape={tuple(shape)} must end in the module's dim={self.dim}")
        x2d = x.reshape(-1, self.dim)
        topk_weights, topk_ids, scores = self.router(x2d, self.expert_bias)
        # Counted with a scatter-add of ones into E bins: stays on the device (bincount would sync on CUDA).
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=x.device).scatter_add_(
            0, topk_ids.reshape(-1), torch.ones(topk_ids.numel(), dtype=torch.float32, device=x.device)
        )
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        if self.load_balance == "aux_loss":
            self.aux_loss = self._aux_loss(scores, counts, topk_ids.numel())
        out = moe_experts(
            x2d,
            topk_ids,
            topk_weights,
            self.w13,
            self.w2,
            backend=self.backend,
            ep_group=self.ep_group,
            chunks=self.chunks,
            max_tokens_per_rank=self.max_tokens_per_rank,
            fp8_recipe=self.fp8_recipe,
            # No Python-side cache in a traced graph (as GroupedLinear).
            fp8_caches=None if torch.compiler.is_compiling() else self._fp8_caches,
        )
        if self.shared is not None:
            out = out + self.shared(x2d)
        return out.reshape(shape)

    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor, routed: int) -> torch.Tensor:
        if self.router.score_func == "sigmoid":
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        f = counts / max(routed, 1)
        P = scores.mean(0) if scores.shape[0] else scores.sum(0)  # T = 0: P = 0, not NaN
        return self.aux_loss_coef * self.num_experts * (f * P).sum()

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """The aux-loss-free update, once per optimizer step:
        ``expert_bias += bias_update_rate * sign(mean(load) - load)`` with load = ``tokens_per_expert``,
        which is then zeroed. Under data parallelism all-reduce ``tokens_per_expert`` (sum) before calling it,
        so that every rank applies the same update."""
        if self.expert_bias is None:
            raise RuntimeError(f"MoE.update_expert_bias needs load_balance='bias', got {self.load_balance!r}")
        load = self.tokens_per_expert
        self.expert_bias.add_(self.bias_update_rate * torch.sign(load.mean() - load))
        load.zero_()

    @torch.no_grad()
    def reset_tokens_per_expert(self) -> None:
        self.tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        r = self.router
        return (
            f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, "
            f"score_func={r.score_func!r}, route_norm={r.route_norm}, route_scale={r.route_scale}, "
            f"groups={r.num_expert_groups}/{r.num_limited_groups}, load_balance={self.load_balance!r}"
            + (f", fp8_recipe={self.fp8_recipe!r}" if self.fp8_recipe else "")
        )
