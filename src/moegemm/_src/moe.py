"""The expert block's framework-free parts, shared by the PyTorch and JAX front ends: the routing metadata's type,
the shape check of ``moe_experts`` and the routers' option checks (docs/design.md, 'Fused expert block')."""

from __future__ import annotations

from typing import Any, NamedTuple


class Routing(NamedTuple):
    """The expert block's routing metadata, built on the device (no sync) from topk_ids [T, k] and E experts by
    each front end (``moegemm._src.torch.moe.routing``, ``moegemm._src.jax.moe.routing``): torch or jax arrays.

    Row r of the grouped layout (R = T * k rows, expert-major, stable in (token, choice) order) holds one (token,
    choice) pair a = order[r], where order sorts the clamped ids ``clamp(topk_ids.flatten(), 0, E - 1)``:

    - gather [R] int32: the token of row r, ``order[r] // k`` (fc1 reads x[gather[r]]);
    - pos [T, k] int32: the row of (t, j), the inverse of order (the combine reads rows pos[t, :]);
    - group_sizes [E] int32: rows per expert (an expert nobody chose has 0);
    - row_scale [R] fp32: the routing weight of row r, a non-finite weight counted as 0.

    Example: T = 2, k = 2, E = 3, topk_ids = [[2, 0], [0, 2]] -> order = [1, 2, 0, 3], gather = [0, 1, 0, 1],
    pos = [[2, 0], [1, 3]], group_sizes = [2, 0, 2] (expert 1 empty).
    """

    gather: Any
    pos: Any
    group_sizes: Any
    row_scale: Any


def check_moe_shapes(x, topk_ids, topk_weights, w13, w2) -> None:
    """Raises ValueError naming the shapes unless x [T, d], topk_ids/topk_weights [T, k], w13 [E, 2n, d] and
    w2 [E, d, n] agree."""
    shapes = (
        f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)}, "
        f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
    )
    if len(x.shape) != 2 or len(topk_ids.shape) != 2 or len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError(
            f"moe_experts: want x [T, d], topk_ids [T, k], w13 [E, 2n, d], w2 [E, d, n]; got {shapes}"
        )
    T, d = x.shape
    E, two_n, d13 = w13.shape
    if topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"moe_experts: topk_ids and topk_weights must both be [T={T}, k]; got {shapes}")
    if two_n % 2 or d13 != d or tuple(w2.shape) != (E, d, two_n // 2):
        raise ValueError(
            f"moe_experts: want w13 [E, 2n, d={d}] (gate rows then up rows) and w2 [E, d, n]; got {shapes}"
        )
    if E == 0 and T * topk_ids.shape[1] > 0:
        raise ValueError(f"moe_experts: no experts (E = 0) for {T} tokens; got {shapes}")


def check_router(num_experts, top_k, score_func, num_expert_groups, num_limited_groups) -> None:
    """The routers' option checks (PyTorch ``moegemm.torch.Router``, Flax ``moegemm.jax.moe_layer.Router``):
    raises ValueError naming the values."""
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"Router: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"Router: top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if (num_expert_groups is None) != (num_limited_groups is None):
        raise ValueError(
            "Router: give both num_expert_groups and num_limited_groups (group-limited routing) or "
            f"neither; got {num_expert_groups} and {num_limited_groups}"
        )
    if num_expert_groups is None:
        return
    if num_expert_groups < 1 or num_experts % num_expert_groups:
        raise ValueError(
            f"Router: num_expert_groups={num_expert_groups} must divide num_experts={num_experts}"
        )
    per_group = num_experts // num_expert_groups
    if not 1 <= num_limited_groups <= num_expert_groups:
        raise ValueError(
            f"Router: num_limited_groups={num_limited_groups} must be in [1, {num_expert_groups}]"
        )
    if top_k > num_limited_groups * per_group:
        raise ValueError(
            f"Router: top_k={top_k} exceeds the {num_limited_groups} kept groups' "
            f"{num_limited_groups * per_group} experts"
        )
    if score_func == "sigmoid" and per_group < 2:
        raise ValueError(
            "Router: with sigmoid a group's score is the sum of its top-2 experts, so each group "
            f"needs at least 2 experts; got {per_group}"
        )
