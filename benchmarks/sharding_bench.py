"""BENCHMARK (not a test): the expert MLP of an MoE layer with the experts sharded over `ep`, timed.

    python benchmarks/sharding_bench.py --out sharding_gpu.json            # 2-4 GPUs
    python benchmarks/sharding_bench.py --cpu-smoke --out /tmp/s.json      # 4 fake CPU devices, tiny shapes

Tokens already routed and sorted: up-projection, SiLU, down-projection, with skewed (Zipf-like)
group sizes. Variants: moegemm's sharded ragged_dot (Triton kernels on GPU, the jnp reference on
CPU) and XLA's own partitioning of jax.lax.ragged_dot, on one device, with EP over all devices and
the tokens replicated, and with the tokens sharded over ep too (``--fp8 RECIPE``: moegemm's in FP8,
the same rules). Prints a table; writes it, with the device and versions, as JSON to --out. The rules' correctness on real GPUs is tested in
tests/test_jax_sharding_gpu.py (pytest -m gpu). A committed run: benchmarks/results/sharding-2x-*.json.

Importing this module has no side effects; ``--cpu-smoke`` configures JAX in ``main`` before any
device is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from moegemm.jax import resolve_backend
from moegemm.jax import sharding as msh
from moegemm.testing.hlo import collectives_in_hlo


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--cpu-smoke", action="store_true", help="4 fake CPU devices and tiny shapes")
    p.add_argument("--tokens", type=int, default=8192, help="routed (token, expert) rows")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-ff", type=int, default=1408, help="expert hidden size")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--fp8",
        choices=("tensorwise", "rowwise", "blockwise"),
        help="moegemm's variants in FP8 with this recipe (sharding.ragged_dot(..., fp8_recipe=...))",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--xla-iters", type=int, default=3, help="iterations for XLA's ragged_dot (10-100x slower)"
    )
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.tokens, args.d_model, args.d_ff, args.experts, args.dtype, args.iters = (
            256,
            64,
            96,
            8,
            "float32",
            2,
        )
    return args


def mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[:n])


def timeit(fn, *args, iters: int) -> float:
    """Steady-state milliseconds per call: ``iters`` calls issued back to back (the host runs ahead,
    as in training), one wait at the end, divided by ``iters``; the compile and a warm-up call are
    excluded. A training step is one jitted call, so its dispatch (~40 us) is inside, and small."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(iters)]
    jax.block_until_ready(outs)
    return 1e3 * (time.perf_counter() - start) / iters


def xla_ragged_dot(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype)


def time_moe(args, n: int, ops) -> list[dict]:
    T, D, F, E, dtype = args.tokens, args.d_model, args.d_ff, args.experts, jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(1), 3)
    # Skewed routing (realistic): Zipf-like expert popularity, sizes summing to T.
    popularity = 1.0 / np.arange(1, E + 1) ** 0.8
    sizes = np.floor(T * popularity / popularity.sum()).astype(np.int32)
    sizes[0] += T - sizes.sum()
    gs = jnp.asarray(sizes)
    x = jax.random.normal(keys[0], (T, D), dtype)
    w_up = (jax.random.normal(keys[1], (E, D, F)) / D**0.5).astype(dtype)
    w_down = (jax.random.normal(keys[2], (E, F, D)) / F**0.5).astype(dtype)

    def mlp(mm):
        return lambda x, w_up, w_down: mm(jax.nn.silu(mm(x, w_up, gs)), w_down, gs)

    def train_step(f):
        loss = lambda x, a, b: jnp.sum(f(x, a, b).astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    moegemm_mm = lambda a, w, g: msh.ragged_dot(a, w, g, ops=ops)
    ep, one = mesh((1, n), ("dp", "ep")), mesh((1, 1), ("dp", "ep"))
    # Names and JSON keys as in benchmarks/results/sharding-2x-nvidia-h200-2026-11-22.json ("GPU": device).
    variants = [
        ("moegemm, 1 GPU", one, moegemm_mm, P(), P()),
        ("XLA ragged_dot, 1 GPU", one, xla_ragged_dot, P(), P()),
        (f"moegemm, EP={n}, tokens replicated", ep, moegemm_mm, P(), P("ep")),
        (f"XLA ragged_dot, EP={n}, tokens replicated", ep, xla_ragged_dot, P(), P("ep")),
        (f"moegemm, EP={n}, tokens sharded over ep", ep, moegemm_mm, P("ep"), P("ep")),
        (f"XLA ragged_dot, EP={n}, tokens sharded over ep", ep, xla_ragged_dot, P("ep"), P("ep")),
    ]
    flops = 2 * T * D * F * 2  # two grouped GEMMs, forward
    rows = []
    for name, m, mm, xs, ws in variants:
        placed = (
            jax.device_put(x, NamedSharding(m, xs)),
            jax.device_put(w_up, NamedSharding(m, ws)),
            jax.device_put(w_down, NamedSharding(m, ws)),
        )
        f = mlp(mm)
        row = {"variant": name, "mesh": dict(m.shape), "tokens": str(xs), "experts": str(ws)}
        try:
            iters = args.xla_iters if mm is xla_ragged_dot else args.iters
            fwd_ms = timeit(jax.jit(f), *placed, iters=iters)
            step_ms = timeit(train_step(f), *placed, iters=iters)
            hlo = jax.jit(f).lower(*placed).compile().as_text()
            step_hlo = train_step(f).lower(*placed).compile().as_text()
            row |= {
                "fwd_ms": fwd_ms,
                "fwd_bwd_ms": step_ms,
                "fwd_tflops_per_gpu": flops / fwd_ms / 1e9 / m.size,
                "fwd_bwd_tflops_per_gpu": 3 * flops / step_ms / 1e9 / m.size,
                "fwd_collectives": sorted({c["op"] for c in collectives_in_hlo(hlo)}),
                "step_collectives": [f"{c['op']} {list(c['shape'])}" for c in collectives_in_hlo(step_hlo)],
            }
        except Exception as e:  # one variant failing (say XLA's partitioner) must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    # Scaling: the same implementation's 1-GPU step time over this one (2.0 = linear on 2 GPUs).
    single = {r["variant"].split(",")[0]: r.get("fwd_bwd_ms") for r in rows if "1 GPU" in r["variant"]}
    for r in rows:
        base = single.get(r["variant"].split(",")[0])
        if base and r.get("fwd_bwd_ms"):
            r["step_speedup_vs_1gpu"] = base / r["fwd_bwd_ms"]
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return ",".join(v) or "-"
    return str(v)


def print_table(rows, columns):
    cells = [[_fmt(r.get(c, "-")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cpu_smoke:  # before JAX creates its backends
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        jax.config.update("jax_platforms", "cpu")
    n = min(len(jax.devices()), 4)
    if n < 2:
        raise SystemExit(f"needs 2-4 devices, found {len(jax.devices())} ({jax.devices()})")
    backend = "triton" if jax.default_backend() == "gpu" else "reference"
    resolve_backend(backend)  # raises with the reason if the Triton path cannot run here
    ops = msh.moegemm_local_ops(backend, fp8_recipe=args.fp8)
    report = {
        "device": str(jax.devices()[0].device_kind),
        "num_devices": n,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "local_ops": ops.name,
        "shardy": bool(jax.config.jax_use_shardy_partitioner),
        "args": vars(args),
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"{n} x {report['device']}, jax {jax.__version__}, local ops {ops.name}\n")
    report["moe"] = time_moe(args, n, ops)
    columns = [
        "variant",
        "fwd_ms",
        "fwd_bwd_ms",
        "step_speedup_vs_1gpu",
        "fwd_tflops_per_gpu",
        "fwd_bwd_tflops_per_gpu",
    ]
    print_table(report["moe"], [*columns, "fwd_collectives", "error"])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
