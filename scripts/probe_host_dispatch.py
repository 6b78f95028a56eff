"""Where the JAX front end's host time per call goes (issue 14), against PyTorch's, on one GPU.

Each row: the median host time of one call issued with the device idle (the previous call waited
for, untimed), and the pipelined cost (``--calls`` calls issued back to back, then one wait, divided
by the count; what a training step's host pays per op). Rows: a trivial op of each framework (the
floor of an ordinary dispatch), moegemm on a tiny and a large shape, jax.lax.ragged_dot, a trivial
jax-triton kernel (jax-triton's own floor), and moegemm through the AOT-compiled executable. Also:
the size of the kernel-call payload (backend_config) XLA hands the custom-call handler on every call,
and a cProfile of the Python frames on the jit hit path.

Usage: python scripts/probe_host_dispatch.py --out result.json [--label default]
(run it under different XLA_FLAGS to compare, e.g. XLA_FLAGS=--xla_gpu_enable_command_buffer=)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import statistics
import time


def host_us(issue, wait, calls: int) -> dict:
    """{"idle_us": median single call with the device idle, "pipelined_us": back-to-back per call}."""
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
    return dict(idle_us=statistics.median(single) * 1e6, pipelined_us=issued / calls * 1e6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="default")
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import torch
    import triton
    import triton.language as tl

    import moegemm.torch as mt
    from moegemm.jax import _jax_triton
    from moegemm.jax import api as mj

    rows: dict[str, dict] = {}
    dev = torch.device("cuda")
    G, M, K, N = 8, 128, 64, 64
    sizes = [M // G] * G
    tx = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    tw = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16)
    tgs = torch.tensor(sizes, device=dev, dtype=torch.int32)
    toffs = tgs.cumsum(0, dtype=torch.int32)
    twait = lambda _: torch.cuda.synchronize()
    rows["torch: x + 1 (floor)"] = host_us(lambda: tx + 1, twait, args.calls)
    rows["torch: moegemm m_grouped_mm tiny"] = host_us(
        lambda: mt.m_grouped_mm(tx, tw.mT, tgs), twait, args.calls
    )
    rows["torch: torch._grouped_mm tiny"] = host_us(
        lambda: torch._grouped_mm(tx, tw.mT, offs=toffs), twait, args.calls
    )
    rows["torch: moegemm k_grouped_mm tiny"] = host_us(
        lambda: mt.k_grouped_mm(tx, tx, tgs, out_dtype=torch.bfloat16), twait, args.calls
    )

    jwait = lambda out: jax.block_until_ready(out)
    x = jnp.asarray(jax.dlpack.from_dlpack(tx))
    w = jnp.asarray(jax.dlpack.from_dlpack(tw))
    w_kn = jnp.swapaxes(w, 1, 2).copy()
    gs = jnp.asarray(sizes, jnp.int32)
    plus1 = jax.jit(lambda x: x + 1)
    rows["jax: jit(x + 1) (floor)"] = host_us(lambda: plus1(x), jwait, args.calls)
    lax_fn = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs))
    rows["jax: jit(lax.ragged_dot) tiny"] = host_us(lambda: lax_fn(x, w_kn, gs), jwait, args.calls)
    fwd = jax.jit(lambda x, w, gs: mj.m_grouped_mm(x, w, gs, transpose_w=True))
    rows["jax: jit(moegemm m_grouped_mm) tiny"] = host_us(lambda: fwd(x, w, gs), jwait, args.calls)
    wgrad = jax.jit(lambda a, gs: mj.k_grouped_mm(a, a, gs, out_dtype=jnp.bfloat16))
    rows["jax: jit(moegemm k_grouped_mm) tiny"] = host_us(lambda: wgrad(x, gs), jwait, args.calls)
    compiled = fwd.lower(x, w, gs).compile()
    rows["jax: AOT compiled moegemm m_grouped_mm tiny"] = host_us(
        lambda: compiled(x, w, gs), jwait, args.calls
    )

    # Inside one jit (a training step): the per-op host cost is XLA's thunk for the custom call, not
    # a dispatch. 32 chained ops in one jitted call; host time of the call / 32 (device idle before).
    chain = 32

    def chained(op):
        def fn(x, w, gs):
            for _ in range(chain):
                x = op(x, w, gs)
            return x

        return jax.jit(fn)

    ours_chain = chained(lambda x, w, gs: mj.m_grouped_mm(x, w, gs, transpose_w=True))
    dot_chain = chained(lambda x, w, gs: jnp.tanh(x @ w[0]))  # cuBLAS + a fusion per step
    for name, fn in (("moegemm m_grouped_mm", ours_chain), ("XLA dot+tanh (floor)", dot_chain)):
        r = host_us(lambda fn=fn: fn(x, w, gs), jwait, 100)
        rows[f"jax: {name}, per op inside one jit of {chain}"] = {k: v / chain for k, v in r.items()}

    # A trivial jax-triton kernel: jax-triton's own dispatch floor.
    @triton.jit
    def add_one(x_ptr, out_ptr, n: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    jt = _jax_triton._import_jax_triton()
    flat = x.reshape(-1)
    add_fn = jax.jit(
        lambda v: jt.triton_call(
            v, kernel=add_one, out_shape=v, grid=(triton.cdiv(v.size, 1024),), n=v.size, BLOCK=1024
        )
    )
    rows["jax: jit(jax-triton add_one) tiny"] = host_us(lambda: add_fn(flat), jwait, args.calls)

    # A large shape: does the cost grow with the kernel (payload size, grid)?
    GL, ML, KL, NL = 32, 32768, 7168, 4096
    xl = jnp.zeros((ML, KL), jnp.bfloat16)
    wl = jnp.zeros((GL, NL, KL), jnp.bfloat16)
    gsl = jnp.full((GL,), ML // GL, jnp.int32)
    rows["jax: jit(moegemm m_grouped_mm) dsv3-fc1"] = host_us(lambda: fwd(xl, wl, gsl), jwait, 30)

    payload = {}
    for name, (fn, fargs) in {
        "moegemm m_grouped_mm tiny": (fwd, (x, w, gs)),
        "jax-triton add_one": (add_fn, (flat,)),
    }.items():
        text = fn.lower(*fargs).as_text()
        configs = re.findall(r'backend_config = "((?:[^"\\]|\\.)*)"', text)
        payload[name] = [len(c) for c in configs]  # escaped text: an upper bound on the bytes

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        out = fwd(x, w, gs)
    profile.disable()
    jwait(out)
    stream = io.StringIO()
    pstats.Stats(profile, stream=stream).sort_stats("cumulative").print_stats(18)

    result = dict(
        label=args.label,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        jax=jax.__version__,
        torch=torch.__version__,
        triton=triton.__version__,
        calls=args.calls,
        rows=rows,
        payload_bytes=payload,
        cprofile_500_calls=stream.getvalue(),
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, r in rows.items():
        print(f"{name:48s} idle {r['idle_us']:8.1f} us   pipelined {r['pipelined_us']:8.1f} us")
    print("payload bytes:", payload)
    print(stream.getvalue()[:3000])


if __name__ == "__main__":
    main()
