"""The MoE layer as Flax (linen) modules: a top-k ``Router``; ``MoE`` = router + ``moe_experts`` + shared experts.

The options of the PyTorch ``moegemm.torch.MoE`` (``moegemm.torch.moe_layer``). For x [T, d] (leading dims
flattened to T rows), with s = score_func(x @ router kernel) [T, E] in fp32::

    c      = s + expert_bias                      (load_balance="bias"; else c = s; the bias only selects)
    groups = keep the num_limited_groups best of num_expert_groups groups of c (group score: sum of its
             top-2 with sigmoid, its max with softmax); the other groups' experts are out of the choice
    ids    = topk(c, top_k) [T, k]
    w      = s[ids] (/ sum_j s[ids_j] if route_norm) * route_scale   [T, k] fp32
    out    = moe_experts(x, ids, w, w13, w2) + shared(x)               shared(x) = SwiGLU FFN, or 0

Load balancing, the Flax way (state is variables, updates are functions):

- ``load_balance="aux_loss"``: ``aux_loss = aux_loss_coef * E * sum_e f_e * P_e`` (f_e = tokens routed to e /
  (T * k), no gradient; P_e = mean_t p[t, e], p = s normalized over experts) is sown into the "losses"
  collection as "aux_loss" (``apply(..., mutable=["losses"])``), and returned as ``(out, aux_loss)`` with
  ``return_aux_loss=True``.
- ``load_balance="bias"``: the aux-loss-free expert bias (DeepSeek-V3, arXiv 2408.15664) is the variable
  "moe_state"/"expert_bias" [E] fp32. ``train=True`` with "moe_state" mutable adds the step's routed counts to
  "moe_state"/"tokens_per_expert" [E] fp32 (on the device, no sync); ``update_expert_bias(moe_state, rate)``
  returns the updated collection once per optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from moegemm._src.jax import ep as _ep
from moegemm._src.moe import check_router
from moegemm.jax import api
from moegemm.jax.moe import moe_experts

__all__ = ["MoE", "Router", "SwiGLU", "update_expert_bias"]

ScoreFunc = Literal["softmax", "sigmoid"]
LoadBalance = Literal["aux_loss", "bias"] | None
_STATE = "moe_state"  # the collection of expert_bias and tokens_per_expert


def _trunc_normal(std: float):
    """Truncated at ±2 std, as torchtitan's (and ``moegemm.torch.MoE``'s) ``trunc_normal_(std, -2 std, 2 std)``."""

    def init(key, shape, dtype=jnp.float32):
        return (std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)).astype(dtype)

    return init


class Router(nn.Module):
    """Token-choice top-k router over E experts, optionally group-limited (module docstring).

    ``__call__(x [T, d], expert_bias [E] | None) -> (topk_weights [T, k] fp32, topk_ids [T, k] int32,
    scores [T, E] fp32)``. Parameter "gate"/"kernel" [d, E]; the GEMM in ``dtype`` (None: x's), the
    nonlinearity in fp32.
    """

    num_experts: int
    top_k: int
    score_func: ScoreFunc = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    init_std: float = 0.02

    def __post_init__(self):
        check_router(
            self.num_experts, self.top_k, self.score_func, self.num_expert_groups, self.num_limited_groups
        )
        super().__post_init__()

    def _limit_groups(self, choice: jax.Array) -> jax.Array:
        """choice [T, E] with the experts of all but the num_limited_groups best groups set to -inf."""
        G = self.num_expert_groups
        grouped = choice.reshape(choice.shape[0], G, self.num_experts // G)
        if self.score_func == "sigmoid":
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:
            group_scores = grouped.max(-1)
        keep = jax.lax.top_k(group_scores, self.num_limited_groups)[1]  # [T, num_limited_groups]
        kept = jax.nn.one_hot(keep, G, dtype=jnp.bool_).any(-2)  # [T, G]
        return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)

    @nn.compact
    def __call__(self, x: jax.Array, expert_bias: jax.Array | None = None):
        logits = nn.Dense(
            self.num_experts,
            use_bias=False,
            dtype=self.dtype or x.dtype,
            param_dtype=self.param_dtype,
            kernel_init=_trunc_normal(self.init_std),
            name="gate",
        )(x)
        logits = logits.astype(jnp.float32)
        scores = jax.nn.sigmoid(logits) if self.score_func == "sigmoid" else jax.nn.softmax(logits, -1)
        # The selection is integer: no gradient flows through it.
        choice = jax.lax.stop_gradient(scores if expert_bias is None else scores + expert_bias)
        if self.num_expert_groups is not None:
            choice = self._limit_groups(choice)
        topk_ids = jax.lax.top_k(choice, self.top_k)[1].astype(jnp.int32)
        topk_weights = jnp.take_along_axis(scores, topk_ids, -1)  # the bias selects; the weights are unbiased
        if self.route_norm:
            topk_weights = topk_weights / (topk_weights.sum(-1, keepdims=True) + 1e-20)
        return topk_weights * self.route_scale, topk_ids, scores


class SwiGLU(nn.Module):
    """The shared experts' SwiGLU FFN: ``w2(silu(w1(x)) * w3(x))``, no biases."""

    hidden_dim: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda features, std, name: nn.Dense(
            features,
            use_bias=False,
            dtype=self.dtype or x.dtype,
            param_dtype=self.param_dtype,
            kernel_init=_trunc_normal(std),
            name=name,
        )
        h = jax.nn.silu(dense(self.hidden_dim, 0.02, "w1")(x)) * dense(self.hidden_dim, self.init_std, "w3")(
            x
        )
        return dense(x.shape[-1], self.init_std, "w2")(h)


def _w13_init(hidden_dim: int, init_std: float):
    """The gate rows [0, n) at std 0.02, the up rows [n, 2n) at init_std (as ``moegemm.torch.MoE``)."""

    def init(key, shape, dtype=jnp.float32):
        k1, k2 = jax.random.split(key)
        E, _, d = shape
        gate = _trunc_normal(0.02)(k1, (E, hidden_dim, d), dtype)
        up = _trunc_normal(init_std)(k2, (E, hidden_dim, d), dtype)
        return jnp.concatenate([gate, up], axis=1)

    return init


class MoE(nn.Module):
    """Router + routed SwiGLU experts on ``moegemm.jax.moe_experts`` + shared experts (module docstring).

    Parameters: "router"/"gate"/"kernel" [dim, E]; "w13" [E, 2 * hidden_dim, dim] (gate rows, then up rows);
    "w2" [E, dim, hidden_dim]; "shared" (a SwiGLU of hidden ``shared_experts * hidden_dim``) when
    shared_experts > 0. Variables in "moe_state" (load_balance="bias"): "expert_bias" and "tokens_per_expert"
    [E] fp32. ``__call__(x [..., dim], *, train=False, return_aux_loss=False) -> [..., dim]`` in the compute
    dtype (``dtype``, None: x's), or ``(out, aux_loss)``; no host sync. ``backend`` is passed to ``moe_experts``.

    ``ep_axis`` (expert parallelism, docs/design.md, 'Expert parallelism'): apply (and init) inside
    ``jax.shard_map`` over that mesh axis of size P, which must divide num_experts; "w13" and "w2" are then this
    device's E/P experts ([E/P, 2 * hidden_dim, dim], [E/P, dim, hidden_dim]; init draws each device's from its
    axis index), the router and shared experts are replicated, and x is this device's tokens. The aux loss and
    "tokens_per_expert" count this device's tokens (sum or average them over the axis as with data parallelism).
    """

    hidden_dim: int
    num_experts: int
    top_k: int
    score_func: ScoreFunc = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    load_balance: LoadBalance = "aux_loss"
    aux_loss_coef: float = 1e-2
    shared_experts: int = 0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    init_std: float = 0.02
    backend: api.Backend = "auto"
    ep_axis: Any = None

    def __post_init__(self):
        if self.load_balance not in ("aux_loss", "bias", None):
            raise ValueError(
                f"MoE: load_balance must be 'aux_loss', 'bias' or None, got {self.load_balance!r}"
            )
        if self.shared_experts < 0:
            raise ValueError(f"MoE: shared_experts must be >= 0, got {self.shared_experts}")
        check_router(
            self.num_experts, self.top_k, self.score_func, self.num_expert_groups, self.num_limited_groups
        )
        api.resolve_backend(self.backend)  # fail at model build time, not at the first step
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False, return_aux_loss: bool = False):
        shape, dim, E = x.shape, x.shape[-1], self.num_experts
        dtype = self.dtype or x.dtype
        x2d = x.reshape(-1, dim).astype(dtype)
        expert_bias = tokens = None
        if self.load_balance == "bias":
            expert_bias = self.variable(_STATE, "expert_bias", jnp.zeros, (E,), jnp.float32)
            tokens = self.variable(_STATE, "tokens_per_expert", jnp.zeros, (E,), jnp.float32)
        router = Router(
            E,
            self.top_k,
            score_func=self.score_func,
            route_norm=self.route_norm,
            route_scale=self.route_scale,
            num_expert_groups=self.num_expert_groups,
            num_limited_groups=self.num_limited_groups,
            dtype=dtype,
            param_dtype=self.param_dtype,
            init_std=self.init_std,
            name="router",
        )
        topk_weights, topk_ids, scores = router(x2d, None if expert_bias is None else expert_bias.value)
        # Counted by a scatter-add of ones into E bins: stays on the device.
        counts = jnp.zeros(E, jnp.float32).at[topk_ids.reshape(-1)].add(1.0)
        if tokens is not None and train and self.is_mutable_collection(_STATE):
            tokens.value = tokens.value + counts
        n = self.hidden_dim
        E_local, w13_init, w2_init = E, _w13_init(n, self.init_std), _trunc_normal(self.init_std)
        if self.ep_axis is not None:
            ep = _ep.axis_size(self.ep_axis)
            if E % ep:
                raise ValueError(
                    f"MoE: num_experts={E} is not divisible by the {ep} devices of ep_axis={self.ep_axis!r}"
                )
            E_local, w13_init, w2_init = (
                E // ep,
                _ep.per_device_init(w13_init, self.ep_axis),
                _ep.per_device_init(w2_init, self.ep_axis),
            )
        w13 = self.param("w13", w13_init, (E_local, 2 * n, dim), self.param_dtype)
        w2 = self.param("w2", w2_init, (E_local, dim, n), self.param_dtype)
        out = moe_experts(
            x2d,
            topk_ids,
            topk_weights,
            w13.astype(dtype),
            w2.astype(dtype),
            backend=self.backend,
            ep_axis=self.ep_axis,
        )
        if self.shared_experts:
            shared = SwiGLU(
                self.shared_experts * n,
                dtype=dtype,
                param_dtype=self.param_dtype,
                init_std=self.init_std,
                name="shared",
            )
            out = out + shared(x2d)
        out = out.reshape(shape)
        aux_loss = None
        if self.load_balance == "aux_loss":
            aux_loss = self._aux_loss(scores, counts, topk_ids.size)
            if not self.is_initializing():  # init's variables would carry it into every apply
                self.sow("losses", "aux_loss", aux_loss)
        return (out, aux_loss) if return_aux_loss else out

    def _aux_loss(self, scores: jax.Array, counts: jax.Array, routed: int) -> jax.Array:
        if self.score_func == "sigmoid":
            scores = scores / (scores.sum(-1, keepdims=True) + 1e-20)
        f = counts / max(routed, 1)
        P = scores.mean(0) if scores.shape[0] else scores.sum(0)  # T = 0: P = 0, not NaN
        return self.aux_loss_coef * self.num_experts * (f * P).sum()


def update_expert_bias(moe_state: Mapping, rate: float = 1e-3) -> dict:
    """The aux-loss-free update, once per optimizer step, of a "moe_state" collection (one MoE's, or a model's
    nested one): every ``expert_bias += rate * sign(mean(load) - load)`` with load its ``tokens_per_expert``,
    which is zeroed. Under data parallelism sum ``tokens_per_expert`` across replicas first."""
    if "expert_bias" in moe_state:
        load = moe_state["tokens_per_expert"]
        bias = moe_state["expert_bias"] + rate * jnp.sign(load.mean() - load)
        return {**moe_state, "expert_bias": bias, "tokens_per_expert": jnp.zeros_like(load)}
    return {k: update_expert_bias(v, rate) if isinstance(v, Mapping) else v for k, v in moe_state.items()}
