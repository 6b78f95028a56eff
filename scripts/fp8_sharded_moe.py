"""An FP8 MoE MLP (fc1, gelu, fc2) sharded over the GPUs with moegemm's partitioning rules, forward and
backward, against the same FP8 layer unsharded on one GPU.

    python scripts/fp8_sharded_moe.py --out result.json     # needs >= 2 GPUs

Layouts per run: EP (experts over "ep", tokens replicated), FSDP (tokens and the weights' K over
"fsdp"), and EP+FSDP when 4 or more devices exist. Reports per recipe: relerr of the loss gradient
against the unsharded run, steady-state step time (calls issued back to back, one sync), and the
collectives of the compiled step.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from moegemm import shapes
from moegemm.jax import fp8 as jfp8
from moegemm.jax import sharding
from moegemm.testing.hlo import collectives_in_hlo


def mlp(ragged_dot, x, w1, w2, gs):
    return ragged_dot(jax.nn.gelu(ragged_dot(x, w1, gs)), w2, gs)


def step_fn(ragged_dot, dy):
    def loss(x, w1, w2, gs):
        return jnp.vdot(mlp(ragged_dot, x, w1, w2, gs).astype(jnp.float32), dy)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def steady_ms(fn, args, calls=10) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) * 1e3 / calls


def relerr(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-ff", type=int, default=1408)
    p.add_argument("--recipes", default="tensorwise,rowwise,blockwise")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    n = len(jax.devices())
    M, G, D, F = args.tokens, args.experts, args.d_model, args.d_ff
    rng = np.random.default_rng(0)
    sizes = shapes.group_sizes(M, G, seed=0)
    gs = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.standard_normal((M, D)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((G, D, F)) / D**0.5, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((G, F, D)) / F**0.5, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
    layouts = {
        "ep": ((n,), ("ep",), P(), P("ep")),
        "fsdp": ((n,), ("fsdp",), P("fsdp"), P(None, "fsdp")),
    }
    if n >= 4:
        layouts["ep+fsdp"] = ((2, n // 2), ("fsdp", "ep"), P("fsdp"), P("ep", "fsdp"))
    results = {"devices": [str(d) for d in jax.devices()], "M": M, "G": G, "D": D, "F": F, "runs": []}
    for recipe in args.recipes.split(","):
        one = step_fn(lambda a, b, s, r=recipe: jfp8.ragged_dot_fp8(a, b, s, recipe=r), dy)
        want = one(x, w1, w2, gs)
        one_ms = steady_ms(one, (x, w1, w2, gs))
        for name, (shape, axes, xs, ws) in layouts.items():
            mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))
            put = lambda a, s, mesh=mesh: jax.device_put(a, NamedSharding(mesh, s))
            args_ = (put(x, xs), put(w1, ws), put(w2, ws), put(gs, P()))
            fn = step_fn(lambda a, b, s, r=recipe: sharding.ragged_dot_fp8(a, b, s, recipe=r), dy)
            row = dict(recipe=recipe, layout=name, one_gpu_ms=one_ms)
            try:
                got = fn(*args_)
                row["grad_relerr_vs_one_gpu"] = [relerr(g, w) for g, w in zip(got, want)]
                row["step_ms"] = steady_ms(fn, args_)
                row["collectives"] = sorted(
                    {c["op"] for c in collectives_in_hlo(fn.lower(*args_).compile().as_text())}
                )
            except Exception as e:  # noqa: BLE001 - a layout that fails is a result
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            print(json.dumps(row), flush=True)
            results["runs"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
