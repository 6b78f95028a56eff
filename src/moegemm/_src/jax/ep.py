"""Expert parallelism for the JAX expert block: ``moegemm.jax.moe_experts(..., ep_axis=...)`` under ``jax.shard_map``.

Megatron's "allgather" dispatcher (docs/design.md, 'Expert parallelism'): no split sizes, no host sync, dropless,
static shapes. Per device r of the P devices on the mesh axis ``ep_axis``, holding x [T_r, d], topk_ids [T_r, k]
(GLOBAL ids), topk_weights [T_r, k] and its experts [r*E_l, (r+1)*E_l) (w13 [E_l, 2n, d], w2 [E_l, d, n])::

    xs, ids, ws = all_gather((x, topk_ids, topk_weights), ep_axis, tiled=True)    # [P*T_r, ...]
    partial     = local_step(xs, ids, ws, w13, w2, expert_base=r*E_l)             # [P*T_r, d], others' experts absent
    out         = psum_scatter(partial, ep_axis, scatter_dimension=0, tiled=True) # [T_r, d]

The local step is the fused block with ``expert_base`` (``moegemm._src.jax.moe``): choices of other devices'
experts sort after every group and the combine skips them, so there is no zero-fill of other shards' rows and no
group offset. JAX's AD transposes all_gather into psum_scatter and back, so the custom_vjp is the local step's
alone: the gradients of x and topk_weights come back summed over the devices that used them, and each device's
dw13 and dw2 are its experts'. XLA schedules the collectives asynchronously, so there is no chunking argument.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def axis_size(ep_axis) -> int:
    """P, the static size of the mesh axis (or axes) ``ep_axis``; ValueError naming it when it is not bound
    (not inside ``jax.shard_map`` over a mesh with that axis)."""
    try:
        return int(jax.lax.psum(1, ep_axis))
    except NameError as e:
        raise ValueError(
            f"moe_experts: ep_axis={ep_axis!r} is not a bound mesh axis; call moe_experts inside jax.shard_map "
            f"over a mesh with that axis ({e})"
        ) from None


def moe_experts(x, topk_ids, topk_weights, w13, w2, ep_axis, local_step: Callable) -> jax.Array:
    """out [T_r, d] of this device's tokens over all P * E_l experts (module docstring). ``local_step(x, ids,
    weights, w13, w2, expert_base)`` is the single-device block with ``expert_base`` an int32 scalar."""
    E_local = w13.shape[0]
    # Clamped into the global range, as the single-device block clamps ids (an out-of-range id would otherwise
    # be no device's and add nothing).
    topk_ids = jnp.clip(topk_ids, 0, max(E_local * axis_size(ep_axis) - 1, 0))
    rank = jax.lax.axis_index(ep_axis)
    expert_base = (rank * E_local).astype(jnp.int32)  # traced: an operand of the custom_vjp, not static
    gather = lambda a: jax.lax.all_gather(a, ep_axis, axis=0, tiled=True)
    partial = local_step(gather(x), gather(topk_ids), gather(topk_weights), w13, w2, expert_base)
    return jax.lax.psum_scatter(partial, ep_axis, scatter_dimension=0, tiled=True)


def per_device_init(init: Callable, ep_axis) -> Callable:
    """A parameter initializer drawing each device's experts from its own key (the key folded with the axis
    index): under shard_map every device gets the same key, and would otherwise hold copies of one shard."""

    def fold(key, shape, dtype=jnp.float32):
        return init(jax.random.fold_in(key, jax.lax.axis_index(ep_axis)), shape, dtype)

    return fold
