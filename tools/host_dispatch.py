"""Host time per call of moegemm's public ops, from PyTorch and from JAX, beside each framework's floor.

Usage (on a GPU):
    python tools/host_dispatch.py [--calls 300] [--out host.json]
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python tools/host_dispatch.py --label no-command-buffer

On a tiny shape (G=8, M=128, K=64, N=64) the GPU work is negligible, so what a call costs is what the
Python, dispatch and launch path costs the host. Each row gives two numbers: ``idle_us``, the median of
single calls issued with the device idle (the previous call waited for, untimed), and ``pipelined_us``,
``--calls`` calls issued back to back and then one wait, per call (what a training step pays per op).
Rows: a trivial op of each framework (its dispatch floor), moegemm's ops, the framework's own grouped
GEMM (torch._grouped_mm, jax.lax.ragged_dot), and per op inside one jit of 32 chained calls (XLA's
thunk for the kernel call, not a dispatch). JAX rows are left out, with the reason, when moegemm.jax
cannot run its kernels here (no JAX, or no jax-triton).

``python -m moegemm.bench --overhead`` measures the PyTorch side within the benchmark run (one op and a
GroupedLinear fwd+bwd step); this tool is the side-by-side of both front ends. Uses the public API only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

G, M, K, N = 8, 128, 64, 64
CHAIN = 32


def host_us(issue: Callable[[], object], wait: Callable[[object], object], calls: int) -> dict:
    """{"idle_us": median single call with the device idle, "pipelined_us": back-to-back cost per call}."""
    out = issue()
    wait(out)
    single = []
    for _ in range(calls):
        wait(out)
        start = time.perf_counter()
        out = issue()
        single.append(time.perf_counter() - start)
    wait(out)
    start = time.perf_counter()
    outs = [issue() for _ in range(calls)]
    issued = time.perf_counter() - start
    wait(outs[-1])
    return {"idle_us": statistics.median(single) * 1e6, "pipelined_us": issued / calls * 1e6}


def torch_rows(calls: int) -> dict[str, dict]:
    import torch

    import moegemm.torch as mt

    dev = torch.device("cuda")
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16)
    gs = torch.full((G,), M // G, device=dev, dtype=torch.int32)
    offs = gs.cumsum(0, dtype=torch.int32)

    def wait(_):
        torch.cuda.synchronize(dev)

    return {
        "torch: x + 1 (floor)": host_us(lambda: x + 1, wait, calls),
        "torch: moegemm m_grouped_mm": host_us(lambda: mt.m_grouped_mm(x, w.mT, gs), wait, calls),
        "torch: moegemm k_grouped_mm": host_us(
            lambda: mt.k_grouped_mm(x, x, gs, out_dtype=torch.bfloat16), wait, calls
        ),
        "torch: torch._grouped_mm": host_us(lambda: torch._grouped_mm(x, w.mT, offs=offs), wait, calls),
    }


def jax_rows(calls: int) -> dict[str, dict]:
    import jax
    import jax.numpy as jnp

    import moegemm.jax as mj

    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (M, K), jnp.bfloat16)
    w = jax.random.normal(key, (G, N, K), jnp.bfloat16)
    w_kn = jnp.swapaxes(w, 1, 2).copy()
    gs = jnp.full((G,), M // G, jnp.int32)
    wait = jax.block_until_ready
    plus1 = jax.jit(lambda x: x + 1)
    fwd = jax.jit(lambda x, w, gs: mj.m_grouped_mm(x, w, gs, transpose_w=True))
    wgrad = jax.jit(lambda a, gs: mj.k_grouped_mm(a, a, gs, out_dtype=jnp.bfloat16))
    ragged = jax.jit(lambda x, w, gs: mj.ragged_dot(x, w, gs))
    lax_ragged = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs))
    rows = {
        "jax: jit(x + 1) (floor)": host_us(lambda: plus1(x), wait, calls),
        "jax: jit(moegemm m_grouped_mm)": host_us(lambda: fwd(x, w, gs), wait, calls),
        "jax: jit(moegemm k_grouped_mm)": host_us(lambda: wgrad(x, gs), wait, calls),
        "jax: jit(moegemm ragged_dot)": host_us(lambda: ragged(x, w_kn, gs), wait, calls),
        "jax: jit(jax.lax.ragged_dot)": host_us(lambda: lax_ragged(x, w_kn, gs), wait, calls),
    }

    def chained(op):
        def fn(x, w, gs):
            for _ in range(CHAIN):
                x = op(x, w, gs)
            return x

        return jax.jit(fn)

    for name, op in (
        ("moegemm m_grouped_mm", lambda x, w, gs: mj.m_grouped_mm(x, w, gs, transpose_w=True)),
        ("XLA dot+tanh (floor)", lambda x, w, gs: jnp.tanh(x @ w[0])),
    ):
        fn = chained(op)
        r = host_us(lambda fn=fn: fn(x, w, gs), wait, max(10, calls // 3))
        rows[f"jax: {name}, per op inside one jit of {CHAIN}"] = {k: v / CHAIN for k, v in r.items()}
    return rows


def _jax_unavailable() -> str | None:
    """Why moegemm's JAX front end cannot run its kernels here (None: it can)."""
    if importlib.util.find_spec("jax") is None:
        return "jax is not installed"
    import moegemm.jax as mj

    try:
        backend = mj.resolve_backend("auto")
    except ValueError as exc:
        return str(exc)
    return None if backend != "reference" else "moegemm.jax resolves to the reference here (no GPU backend)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--label", default="default", help="a name for this run in the JSON")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    # JAX must not take 75% of the GPU the PyTorch side allocates on.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    if not torch.cuda.is_available():
        print("host_dispatch needs a GPU: on CPU the kernels run inside the call, under the interpreter")
        return 2
    rows = torch_rows(args.calls)
    why_not_jax = _jax_unavailable()
    if why_not_jax is None:
        rows.update(jax_rows(args.calls))
    else:
        print(f"JAX rows left out: {why_not_jax}")
    for name, r in rows.items():
        print(f"{name:56s} idle {r['idle_us']:8.1f} us   pipelined {r['pipelined_us']:8.1f} us")
    if args.out:
        result = {
            "label": args.label,
            "device": torch.cuda.get_device_name(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "shape": {"G": G, "M": M, "K": K, "N": N},
            "calls": args.calls,
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
