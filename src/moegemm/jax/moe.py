"""The MoE expert block as one JAX op: gather -> fc1 + SwiGLU -> fc2 -> weighted combine, with a custom_vjp.

``moe_experts(x, topk_ids, topk_weights, w13, w2)``::

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u),  (g, u) = split(w13[e] @ x[t]),  e = topk_ids[t, j]

Shapes and layouts as ``moegemm.torch.moe_experts``: x [T, d]; topk_ids [T, k] integer; topk_weights [T, k] float;
w13 [E, 2n, d] (rows [0, n) the gate, [n, 2n) the up projection); w2 [E, d, n]; out [T, d] in x's dtype.
Differentiable in x, w13, w2 and topk_weights. The same kernels as the PyTorch op (docs/design.md, 'Fused expert
block'; the glue is ``moegemm._src.jax.moe``), no host sync, runs under jax.jit. Backends as ``moegemm.jax.api``:
"triton", "interpret", "reference" (``moe_experts_reference``), "auto".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moegemm._src import plan
from moegemm._src.jax import ep as _ep
from moegemm._src.jax import moe as _moe
from moegemm._src.moe import check_moe_shapes
from moegemm.jax import api
from moegemm.jax.reference import moe_experts_reference

__all__ = ["ACTIVATIONS", "moe_experts", "moe_experts_reference"]

ACTIVATIONS = ("swiglu",)


def _check_routing_values(topk_ids, topk_weights, E: int) -> None:
    """The syncing check (``check=True``; MOEGEMM_CHECK=1 on concrete arrays): every id in [0, E), every weight
    finite. It reads the values on the host, so it cannot run on traced arrays (under jax.jit)."""
    if isinstance(topk_ids, jax.core.Tracer) or isinstance(topk_weights, jax.core.Tracer):
        raise ValueError(
            "moe_experts: check=True reads topk_ids and topk_weights on the host and cannot run under "
            "jax.jit or another transformation; call it on concrete arrays"
        )
    ids, weights = np.asarray(topk_ids), np.asarray(topk_weights, np.float64)
    bad = np.argwhere((ids < 0) | (ids >= E))
    if len(bad):
        t, j = bad[0]
        raise ValueError(
            f"moe_experts: topk_ids[{t}, {j}] = {int(ids[t, j])} is outside [0, E={E}) ({len(bad)} such entries)"
        )
    bad = np.argwhere(~np.isfinite(weights))
    if len(bad):
        t, j = bad[0]
        raise ValueError(
            f"moe_experts: topk_weights[{t}, {j}] = {float(weights[t, j])} is not finite "
            f"({len(bad)} such entries)"
        )


def moe_experts(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    *,
    activation: str = "swiglu",
    fp8_recipe: str | None = None,
    check: bool | None = None,
    backend: api.Backend = "auto",
    ep_axis=None,
) -> jax.Array:
    """The routed expert block (module docstring): x [T, d], topk_ids [T, k], topk_weights [T, k], w13 [E, 2n, d],
    w2 [E, d, n] -> out [T, d] in x's dtype, fp32 accumulation.

    ``for t: out[t] = sum_j topk_weights[t, j] * w2[e] @ swiglu(w13[e] @ x[t])``, e = topk_ids[t, j].

    Duplicate experts in a token's top-k each count; k = 1 and T = 0 are allowed. An id outside [0, E) is
    clamped into it and a non-finite weight counts as 0 (no read or write out of bounds, no sync);
    ``check=True`` reads the values on the host and raises naming the first bad one (concrete arrays only;
    MOEGEMM_CHECK=1 turns it on for concrete arrays). ``backend``: "triton" (the fused kernels on the GPU),
    "interpret" (the same launches under the Triton interpreter, CPU), "reference" (``moe_experts_reference``),
    "auto".

    ``ep_axis`` (expert parallelism, docs/design.md, 'Expert parallelism'): a mesh axis name; call inside
    ``jax.shard_map`` over it. Per device r of its P: x [T_r, d], topk_ids [T_r, k] (global ids in [0, P * E_l)),
    topk_weights [T_r, k], w13 [E_l, 2n, d] and w2 [E_l, d, n] its experts [r * E_l, (r + 1) * E_l) -> out
    [T_r, d], the single-device result on its tokens; ``all_gather`` tokens, the local experts' block,
    ``psum_scatter`` (``moegemm._src.jax.ep``). An id outside [0, P * E_l) is clamped into it, as on one device
    and in the PyTorch op.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_experts: activation {activation!r}; supported: {ACTIVATIONS}")
    if fp8_recipe is not None:
        raise NotImplementedError(
            f"moe_experts: fp8_recipe={fp8_recipe!r}: the FP8 expert block is not built yet (bf16/fp16/fp32 only)"
        )
    x, topk_ids, topk_weights, w13, w2 = map(jnp.asarray, (x, topk_ids, topk_weights, w13, w2))
    check_moe_shapes(x, topk_ids, topk_weights, w13, w2)
    # The PyTorch op's errors: TypeError for mixed dtypes (check_same), ValueError for the rest.
    if len({jnp.dtype(t.dtype) for t in (x, w13, w2)}) > 1:
        raise TypeError(f"x, w13 and w2 must share a dtype, got {[x.dtype, w13.dtype, w2.dtype]}")
    if jnp.dtype(x.dtype) not in api._FLOAT_DTYPES:
        raise ValueError(f"moe_experts: x, w13 and w2 must be one of {api._FLOAT_DTYPES}, got {x.dtype}")
    if jnp.dtype(topk_ids.dtype) not in (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64)):
        raise ValueError(f"moe_experts: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise ValueError(f"moe_experts: topk_weights must be a float array, got {topk_weights.dtype}")
    # Under EP the checks run while shard_map traces (the same shapes on every device): before any collective.
    E = w13.shape[0] * (1 if ep_axis is None else _ep.axis_size(ep_axis))
    traced = any(isinstance(t, jax.core.Tracer) for t in (topk_ids, topk_weights))
    if check or (check is None and plan.SWITCHES.check and not traced):
        _check_routing_values(topk_ids, topk_weights, E)
    executor = api._executor(backend)

    def block(x, topk_ids, topk_weights, w13, w2, expert_base=None):
        if executor is None:
            return moe_experts_reference(
                x, topk_ids, topk_weights, w13, w2, activation=activation, expert_base=expert_base
            )
        return _moe.moe_experts(x, topk_ids, topk_weights, w13, w2, expert_base, executor)

    if ep_axis is None:
        return block(x, topk_ids, topk_weights, w13, w2)
    if x.shape[0] == 0:
        # T = 0: nothing to route, and XLA cannot lower all_gather or psum_scatter over an empty dimension.
        # Every device has the same static T under shard_map, so all of them skip the collectives alike.
        return jnp.zeros_like(x)
    return _ep.moe_experts(x, topk_ids, topk_weights, w13, w2, ep_axis, block)
