"""An expert-parallel MoE layer with moegemm's grouped GEMMs: under jit with sharded weights, and in shard_map.

    python examples/jax_sharded_moe.py            # 8 fake CPU devices unless GPUs are present

Mesh (dp, ep). Experts' weights are sharded over ep (EP), tokens over dp.

1. jit: the layer is ordinary jax code; moegemm.jax.sharding.ragged_dot's partitioning rules turn
   the EP-sharded weights into group_offset = ep_index * G_local plus a psum over ep.
2. shard_map: each (dp, ep) shard routes its own tokens, all-gathers them over ep, sorts them by
   expert, and calls shard_map_ragged_dot with the same rules (lhs_spec=P(): the gathered rows are
   the same on every ep shard; rhs_spec=P("ep")). Each shard keeps its own tokens at the end.

Both match an unsharded reference, forward and gradients. The jit layer also runs in FP8 through the
same rules (``fp8_recipe="tensorwise"``: each shard quantizes, the amax all-reduced over the shards),
matching the unsharded FP8 op.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moegemm.jax as mj  # noqa: E402
from moegemm.jax import reference  # noqa: E402
from moegemm.jax import sharding as msh  # noqa: E402
from moegemm.testing.hlo import collectives_in_hlo  # noqa: E402

TOKENS, D, H, E, TOP_K = 64, 32, 48, 8, 2


def route(x, router):
    """Top-k routing: (expert ids [T, k], combine weights [T, k])."""
    weights, experts = jax.lax.top_k(jax.nn.softmax(x @ router), TOP_K)
    return experts, weights / weights.sum(-1, keepdims=True)


def experts_mlp(x, router, w_up, w_down, grouped_mm):
    """out[t] = sum_k weight[t, k] * (gelu(x[t] @ w_up[e]) @ w_down[e]), e = experts[t, k]."""
    experts, weights = route(x, router)
    order = jnp.argsort(experts.reshape(-1))
    token = order // TOP_K  # the token behind each sorted (token, k) slot
    group_sizes = jnp.bincount(experts.reshape(-1), length=E).astype(jnp.int32)
    h = jax.nn.gelu(grouped_mm(x[token], w_up, group_sizes))
    y = grouped_mm(h, w_down, group_sizes) * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y)


def moe_reference(x, router, w_up, w_down):
    return experts_mlp(x, router, w_up, w_down, reference.ragged_dot_reference)


def moe_reference_fp8(x, router, w_up, w_down, recipe):
    fp8_mm = lambda a, w, gs: mj.ragged_dot(a, w, gs, fp8_recipe=recipe, preferred_element_type=jnp.float32)
    return experts_mlp(x, router, w_up, w_down, fp8_mm)


def moe_jit(x, router, w_up, w_down, ops=None, fp8_recipe=None):
    """ops None: moegemm's kernels (the jnp reference on CPU), in FP8 with fp8_recipe."""
    mm = lambda a, w, gs: msh.ragged_dot(
        a, w, gs, preferred_element_type=jnp.float32, fp8_recipe=fp8_recipe, ops=ops
    )
    return experts_mlp(x, router, w_up, w_down, mm)


def moe_shard_map(mesh, ops=msh.REFERENCE_OPS):
    """The same layer, written per shard: tokens P(("dp", "ep")), experts' weights P("ep")."""

    def grouped_mm(a, w, group_sizes):
        return msh.shard_map_ragged_dot(a, w, group_sizes, lhs_spec=P(), rhs_spec=P("ep"), ops=ops)

    def per_shard(x, router, w_up, w_down):
        ep, T_local = jax.lax.axis_index("ep"), x.shape[0]
        x_ep = jax.lax.all_gather(x, "ep", tiled=True)  # the ep peers' tokens, the same on each of them
        out = experts_mlp(x_ep, router, w_up, w_down, grouped_mm)
        return jax.lax.dynamic_slice_in_dim(out, ep * T_local, T_local)  # keep this shard's tokens

    return jax.shard_map(
        per_shard, mesh=mesh, in_specs=(P(("dp", "ep")), P(), P("ep"), P("ep")), out_specs=P(("dp", "ep"))
    )


def main():
    n = len(jax.devices())
    mesh = jax.make_mesh((n // min(n, 4), min(n, 4)), ("dp", "ep"), axis_types=(AxisType.Auto,) * 2)
    ops = msh.moegemm_local_ops("auto")  # Triton kernels on GPU, the jnp reference on CPU
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (TOKENS, D))
    params = (
        jax.random.normal(keys[1], (D, E)),
        jax.random.normal(keys[2], (E, D, H)) / D**0.5,
        jax.random.normal(keys[3], (E, H, D)) / H**0.5,
    )
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    loss = lambda f: lambda x, *params: jnp.sum(f(x, *params) ** 2)
    fp8_reference = lambda *args: moe_reference_fp8(*args, recipe="tensorwise")
    variants = {
        "jit, tokens P('dp'), experts P('ep')": (
            lambda *args: moe_jit(*args, ops=ops),
            (P("dp"), P(), P("ep"), P("ep")),
            moe_reference,
        ),
        "shard_map, tokens P(('dp', 'ep')), experts P('ep')": (
            moe_shard_map(mesh, ops),
            (P(("dp", "ep")), P(), P("ep"), P("ep")),
            moe_reference,
        ),
        "jit FP8 tensorwise, tokens P('dp'), experts P('ep')": (
            lambda *args: moe_jit(*args, fp8_recipe="tensorwise"),
            (P("dp"), P(), P("ep"), P("ep")),
            fp8_reference,
        ),
    }
    for name, (f, specs, reference_f) in variants.items():
        want = reference_f(x, *params)
        want_grads = jax.grad(loss(reference_f), argnums=(0, 2, 3))(x, *params)
        args = [put(a, s) for a, s in zip((x, *params), specs)]
        out = jax.jit(f)(*args)
        grads = jax.jit(jax.grad(loss(f), argnums=(0, 2, 3)))(*args)
        err = max(
            float(np.max(np.abs(np.asarray(g) - np.asarray(r))) / (1 + np.max(np.abs(r))))
            for g, r in zip((out, *grads), (want, *want_grads))
        )
        hlo = jax.jit(f).lower(*args).compile().as_text()
        ops_seen = [f"{c['op']}{c['shape']}" for c in collectives_in_hlo(hlo)]
        print(f"{name}\n  max rel error vs reference (out, dx, dw_up, dw_down): {err:.2e}")
        print(f"  forward collectives: {', '.join(ops_seen) or 'none'}")
        assert err < (1e-4 if reference_f is moe_reference else 1e-2), err


if __name__ == "__main__":
    main()
