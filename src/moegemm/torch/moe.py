"""The MoE expert block as one op: gather -> fc1 + SwiGLU -> fc2 -> weighted combine, forward and backward.

``moe_experts(x, topk_ids, topk_weights, w13, w2)``::

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u),  (g, u) = split(w13[e] @ x[t]),  e = topk_ids[t, j]

Shapes: x [T, d]; topk_ids [T, k] int32/int64; topk_weights [T, k] float; w13 [E, 2n, d] (rows [0, n) the gate,
[n, 2n) the up projection: transformers' ``gate_up_proj`` layout); w2 [E, d, n]; out [T, d] in x's dtype.
Differentiable in x, w13, w2 and topk_weights. The kernels (docs/design.md, 'Fused expert block'): fc1 reads
x's rows by token index (no permuted copy of x) and applies SwiGLU in its epilogue, writing the pre-activation
the backward keeps; fc2 writes each (token, choice) row once, and a combine kernel sums each token's k rows in
a fixed order (deterministic). The backward keeps x, the fc1 pre-activation and the routing metadata.
"""

from __future__ import annotations

import torch

from moegemm._src import fp8
from moegemm._src.moe import check_moe_shapes
from moegemm._src.torch import ep as _ep
from moegemm._src.torch import moe as _moe
from moegemm._src.torch.args import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    Backend,
    check_same,
    checks_enabled,
    resolve_backend,
)
from moegemm.torch.grouped_linear import Fp8WeightCache

__all__ = ["moe_experts"]

ACTIVATIONS = ("swiglu",)


def _check_routing_values(topk_ids: torch.Tensor, topk_weights: torch.Tensor, E: int) -> None:
    """The syncing check (``check=True`` / MOEGEMM_CHECK=1): every id in [0, E), every weight finite."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("check=True syncs the host and cannot run inside CUDA graph capture")
    bad = ((topk_ids < 0) | (topk_ids >= E)).nonzero()
    if bad.numel():
        t, j = bad[0].tolist()
        raise ValueError(
            f"moe_experts: topk_ids[{t}, {j}] = {int(topk_ids[t, j])} is outside [0, E={E}) "
            f"({bad.shape[0]} such entries)"
        )
    bad = (~torch.isfinite(topk_weights)).nonzero()
    if bad.numel():
        t, j = bad[0].tolist()
        raise ValueError(
            f"moe_experts: topk_weights[{t}, {j}] = {float(topk_weights[t, j])} is not finite "
            f"({bad.shape[0]} such entries)"
        )


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: str = "swiglu",
    fp8_recipe: str | None = None,
    fp8_caches: tuple[Fp8WeightCache, Fp8WeightCache] | None = None,
    check: bool | None = None,
    backend: Backend = "auto",
    ep_group: object | None = None,
    chunks: int = 1,
    max_tokens_per_rank: int | None = None,
) -> torch.Tensor:
    """The routed expert block (module docstring): x [T, d], topk_ids [T, k], topk_weights [T, k], w13 [E, 2n, d],
    w2 [E, d, n] -> out [T, d] in x's dtype, fp32 accumulation.

    ``for t: out[t] = sum_j topk_weights[t, j] * w2[e] @ swiglu(w13[e] @ x[t])``, e = topk_ids[t, j].

    Duplicate experts in a token's top-k each count; k = 1 and T = 0 are allowed. An id outside [0, E) is
    clamped into it and a non-finite weight counts as 0 (no read or write out of bounds, no sync);
    ``check=True`` (or MOEGEMM_CHECK=1) syncs and raises naming the first bad value. ``backend``: "triton"
    (the fused kernels), "reference" (``moe_experts_reference``), "auto". No host sync in forward or backward.

    Expert parallelism (docs/design.md, 'Expert parallelism'): with ``ep_group`` (a ProcessGroup of size P, rank
    r), w13 [E/P, 2n, d] and w2 [E/P, d, n] hold experts [r*E/P, (r+1)*E/P), topk_ids are global ids in [0, E),
    and out equals the single-process block with all E experts on this rank's tokens
    (``moegemm._src.torch.ep``: all_gather the tokens, the local experts, reduce_scatter). ``chunks``: row
    chunks whose collectives overlap the expert GEMMs. ``max_tokens_per_rank``: a row bound B every rank
    declares alike, so ranks may pass different T <= B (None: every rank passes the same T). In check mode one
    metadata all_gather first makes every rank raise on a mismatch across ranks (E/P, d, n, k, B, dtypes) or a
    bad input on any rank; without it such a mismatch is undefined, as NCCL's collectives are.

    FP8 (docs/design.md, 'FP8 expert block'): ``fp8_recipe`` "tensorwise", "rowwise" or "blockwise" runs all six
    GEMMs on e4m3 operands (``moegemm.torch.quantize_fp8``'s recipes; fc1 and fc2 with fast accumulation where the
    recipe has it, the backward promoted), with fp32 accumulation, out and the gradients in the inputs' dtypes.
    x and dout are quantized once per token, the SwiGLU epilogues run on the scaled accumulators. ``fp8_caches``:
    a pair of ``Fp8WeightCache`` for w13 and w2, which keep each weight's quantized copies while the weight is
    unchanged (gradient accumulation quantizes the weights once per optimizer step); None quantizes them every
    call. Single process only (no ``ep_group``).
    """
    if ep_group is not None and fp8_recipe is not None:
        raise NotImplementedError(
            f"moe_experts: fp8_recipe={fp8_recipe!r} with ep_group: the FP8 block runs on one process only "
            "(docs/design.md, 'FP8 expert block')"
        )
    if ep_group is not None:
        return _ep.moe_experts_ep(
            x,
            topk_ids,
            topk_weights,
            w13,
            w2,
            ep_group,
            backend=resolve_backend(backend, x.device),
            chunks=chunks,
            max_tokens_per_rank=max_tokens_per_rank,
            check=checks_enabled(check),
            validate=lambda E: _check_inputs(
                x, topk_ids, topk_weights, w13, w2, activation, fp8_recipe, check, E
            ),
        )
    _check_inputs(x, topk_ids, topk_weights, w13, w2, activation, fp8_recipe, check, w13.shape[0])
    if fp8_recipe is not None:
        return _moe.moe_experts_fp8(
            x, topk_ids, topk_weights, w13, w2, fp8_recipe, resolve_backend(backend, x.device), fp8_caches
        )
    return _moe.moe_experts(x, topk_ids, topk_weights, w13, w2, resolve_backend(backend, x.device))


def _check_inputs(x, topk_ids, topk_weights, w13, w2, activation, fp8_recipe, check, E) -> None:
    """``moe_experts``' input checks for E experts in all (E = P * w13.shape[0] under expert parallelism)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_experts: activation {activation!r}; supported: {ACTIVATIONS}")
    if fp8_recipe is not None:
        fp8.check_recipe(fp8_recipe)
    check_moe_shapes(x, topk_ids, topk_weights, w13, w2)
    check_same("x, w13 and w2", x, w13, w2)
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"moe_experts: x, w13 and w2 must be one of {FLOAT_DTYPES}, got {x.dtype}")
    if topk_ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"moe_experts: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"moe_experts: topk_weights must be a float tensor, got {topk_weights.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"moe_experts: {name} is on {t.device}, x on {x.device}")
    if checks_enabled(check):
        _check_routing_values(topk_ids, topk_weights, E)
