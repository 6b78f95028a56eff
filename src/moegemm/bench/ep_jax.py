"""JAX expert parallelism (issue 42): ``moegemm.jax.moe_experts(..., ep_axis=...)`` under ``jax.shard_map``
against the local-rows ideal (docs/design.md, 'Expert parallelism').

A case is a ``moegemm.bench.moe.MoEShape`` read as: T tokens per device, E experts in all (P must divide E),
width d, hidden n, top-k. On P devices of a 1-D mesh "ep", per case x P, forward and fwd+bwd (the gradients of
x, topk_weights, w13, w2), jitted, of:

- ``ep``: the whole EP block: all_gather of the tokens, the fused local step (``expert_base``), psum_scatter;
- ``ep local step``: the local step alone on the already gathered tokens (no collective): the EP block's
  compute, whose excess over the ideal is the absent rows' cost;
- ``local rows (ideal)``: the same kernels on only the rows of each device's experts, sliced on the host
  (untimed): one row per (token, choice) of a local expert (k = 1), the device's E/P experts, no absent row.
  Each device's ideal runs on that device; the record's time is the sum over the P devices.

Device time is ``timing.device_ms``: the CUPTI sum of every kernel (collectives included) any of the P GPUs ran
in ``calls`` back-to-back calls, per call; so ``ep`` and ``ep local step`` are also sums over the P devices, and
``vs_ideal`` = time / ideal time compares like with like. Before timing, the EP block's output and gradients are
checked against the single-device block with all E experts on all P*T tokens (relative Frobenius error).

Without a GPU nothing is timed and the run is a correctness check on tiny shapes: P XLA host devices must exist
before jax starts (XLA_FLAGS=--xla_force_host_platform_device_count=P, set by the caller); a P with too few
devices is recorded as skipped. The kernels then run under the Triton interpreter where TRITON_INTERPRET=1 (the
"interpret" backend), else as the jax.numpy twin ("reference").
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moegemm.testing.accuracy import relerr

REL_TOL = {"bfloat16": 2e-2, "float32": 1e-4}
GRADS = ("out", "dx", "dweights", "dw13", "dw2")


def _backend() -> str:
    import jax
    import triton

    if jax.default_backend() == "gpu":
        return "triton"
    return "interpret" if bool(triton.knobs.runtime.interpret) else "reference"


def _inputs(shape, P: int, routing: str, seed: int, dtype):
    """Global arrays: x [P*T, d], ids/weights [P*T, k] (``bench.moe.route``), w13 [E, 2n, d], w2 [E, d, n],
    dout [P*T, d]; numpy."""
    from moegemm.bench import moe as moe_bench

    T, d, n, E, k = P * shape.T, shape.d, shape.n, shape.E, shape.k
    ids, weights = moe_bench.route(T, E, k, routing, seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, d)).astype(dtype)
    w13 = (rng.standard_normal((E, 2 * n, d)) / d**0.5).astype(dtype)
    w2 = (rng.standard_normal((E, d, n)) / n**0.5).astype(dtype)
    dout = rng.standard_normal((T, d)).astype(dtype)
    return x, ids.numpy(), weights.numpy().astype(np.float32), w13, w2, dout


def _fns(mesh, backend: str):
    """{name: (fwd, step)} of the EP block and its local step, jitted; step returns (out, dx, dw, dw13, dw2)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as Spec

    import moegemm.jax as mj
    from moegemm._src.jax import moe as _moe
    from moegemm.jax import api
    from moegemm.jax.reference import moe_experts_reference

    def ep_block(x, ids, w, w13, w2):
        return mj.moe_experts(x, ids, w, w13, w2, backend=backend, ep_axis="ep")

    def local_step(x, ids, w, w13, w2):  # x, ids, w: every device's tokens, replicated (already gathered)
        base = (jax.lax.axis_index("ep") * w13.shape[0]).astype(jnp.int32)
        executor = api._executor(backend)
        if executor is None:
            return moe_experts_reference(x, ids, w, w13, w2, expert_base=base)
        return _moe.moe_experts(x, ids, w, w13, w2, base, executor)

    ep_specs = (Spec("ep"),) * 5
    gathered_specs = (Spec(), Spec(), Spec(), Spec("ep"), Spec("ep"))
    out = {}
    # The local step's partial sums differ per device: out_specs stacks them ([P * P*T, d]), unreduced.
    for name, fn, specs in (("ep", ep_block, ep_specs), ("ep local step", local_step, gathered_specs)):
        sharded = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=Spec("ep"))
        out[name] = (jax.jit(sharded), jax.jit(_step(sharded)))
    return out


def _step(fn):
    import jax

    def step(x, ids, w, w13, w2, dout):
        out, vjp = jax.vjp(lambda x, w, a, b: fn(x, ids, w, a, b), x, w, w13, w2)
        return (out, *vjp(dout.astype(out.dtype)))

    return step


def _ideal_inputs(ids: np.ndarray, weights: np.ndarray, E_local: int, r: int):
    """Device r's local rows: (token index [R_r], local ids [R_r, 1], weights [R_r, 1])."""
    t, j = np.nonzero((ids >= r * E_local) & (ids < (r + 1) * E_local))
    return t, (ids[t, j] - r * E_local).astype(np.int32)[:, None], weights[t, j][:, None]


def _ideal_ms(devices, E_local: int, arrays, backend: str, timed: bool, calls: int) -> dict:
    """({"fwd", "fwd+bwd"}: the local-rows ideal's device ms summed over the devices, each on its own device
    (None untimed); its output [P*T, d] fp64, the rows added back into their tokens (a check))."""
    import jax
    import jax.numpy as jnp
    import torch

    import moegemm.jax as mj
    from moegemm.bench import timing

    x, ids, weights, w13, w2, dout = arrays
    block = lambda *b: mj.moe_experts(*b, backend=backend)  # noqa: E731
    fwd, step = jax.jit(block), jax.jit(_step(block))
    total = {"fwd": 0.0, "fwd+bwd": 0.0}
    out = np.zeros(x.shape, np.float64)
    for r, dev in enumerate(devices):
        t, lids, lw = _ideal_inputs(ids, weights, E_local, r)
        experts = slice(r * E_local, (r + 1) * E_local)
        a = [jax.device_put(jnp.asarray(v), dev) for v in (x[t], lids, lw, w13[experts], w2[experts])]
        g = jax.device_put(jnp.asarray(dout[t]), dev)
        np.add.at(out, t, np.asarray(step(*a, g)[0], np.float64))
        if timed:
            device = torch.device("cuda")
            total["fwd"] += timing.device_ms(lambda a=a: fwd(*a), device, calls)
            total["fwd+bwd"] += timing.device_ms(lambda a=a, g=g: step(*a, g), device, calls)
    return (total if timed else {"fwd": None, "fwd+bwd": None}), out


def run(
    cases,
    ep_sizes,
    out_path: Path,
    *,
    routing: str = "skewed",
    calls: int = 20,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> list[dict]:
    """Checks, then (on a GPU) times every case x P (module docstring); writes ``out_path`` (JSON) and returns
    the records: one per case x P x impl x pass ("fwd", "fwd+bwd"), with ``status``, ``ms`` (device time,
    summed over the P devices; GPU only) and on EP records ``ideal_ms`` and ``vs_ideal``."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as Spec

    import moegemm.jax as mj
    from moegemm.bench import timing

    backend = _backend()
    gpu = backend == "triton" and torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    np_dtype = jnp.dtype(dtype)
    records = []
    for shape in cases:
        for P in ep_sizes:
            base = dict(
                case=shape.name, ep=P, T_per_device=shape.T, d=shape.d, n=shape.n, E=shape.E, k=shape.k
            )
            base.update(routing=routing, backend=backend, dtype=dtype)
            if len(jax.devices()) < P or shape.E % P:
                why = f"{len(jax.devices())} devices" if len(jax.devices()) < P else f"{P} does not divide E"
                records.append({**base, "impl": "ep", "status": f"skipped: {why}"})
                continue
            devices = jax.devices()[:P]
            mesh = Mesh(np.array(devices), ("ep",))
            x, ids, weights, w13, w2, dout = _inputs(shape, P, routing, seed, np_dtype)
            put = lambda a, spec, mesh=mesh: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))  # noqa: E731
            sharded = [put(a, Spec("ep")) for a in (x, ids, weights, w13, w2)]
            replicated = [put(a, Spec()) for a in (x, ids, weights)]
            dout_d = put(dout, Spec("ep"))
            fns = _fns(mesh, backend)

            # Correctness: the EP step against the single-device block with all E experts.
            single = jax.jit(_step(lambda *a: mj.moe_experts(*a, backend=backend)))
            want = single(*map(jnp.asarray, (x, ids, weights, w13, w2, dout)))
            got = fns["ep"][1](*sharded, dout_d)
            errs = {name: relerr(a, b) for name, a, b in zip(GRADS, got, want)}
            worst = max(errs, key=errs.get)
            tol = REL_TOL.get(dtype, 2e-2)
            ok = errs[worst] <= tol
            status = "ok" if ok else f"failed: {worst} relerr {errs[worst]:.2e}"
            args = {
                "ep": (sharded, dout_d),
                "ep local step": ((*replicated, *sharded[3:]), put(np.tile(dout, (P, 1)), Spec("ep"))),
            }
            # The local step's partial sums, added over the devices, are the block's output.
            partial = np.asarray(fns["ep local step"][0](*args["ep local step"][0]), np.float64)
            err = relerr(partial.reshape(P, *x.shape).sum(0), want[0])
            # Its gradients: the replicated x's and weights' summed over the devices by the custom_vjp.
            local_grads = fns["ep local step"][1](*args["ep local step"][0], args["ep local step"][1])
            err = max([err] + [relerr(a, b) for a, b in zip(local_grads[1:], want[1:])])
            statuses = {
                "ep": status,
                "ep local step": "ok" if err <= tol else f"failed: out relerr {err:.2e}",
            }
            for name, (fwd, step) in fns.items():
                for pass_, fn, extra in (("fwd", fwd, ()), ("fwd+bwd", step, (args[name][1],))):
                    rec = {**base, "impl": name, "pass": pass_, "status": statuses[name]}
                    if name == "ep":
                        rec["relerr"] = errs
                    if gpu and ok:
                        rec["ms"] = timing.device_ms(
                            lambda fn=fn, a=(*args[name][0], *extra): fn(*a), device, calls
                        )
                    records.append(rec)
            # The ideal: each device's local rows on that device, k = 1; times summed over the devices.
            ideal, ideal_out = _ideal_ms(
                devices, shape.E // P, (x, ids, weights, w13, w2, dout), backend, gpu and ok, calls
            )
            err = relerr(ideal_out, want[0])
            for pass_ in ("fwd", "fwd+bwd"):
                rec = {**base, "impl": "local rows (ideal)", "pass": pass_}
                rec["status"] = "ok (the reference)" if err <= tol else f"failed: out relerr {err:.2e}"
                if ideal[pass_] is not None:
                    rec["ms"] = ideal[pass_]
                records.append(rec)
    _ratios(records)
    meta = dict(
        what="moegemm-jax expert parallelism (all_gather + local step + psum_scatter) vs the local-rows ideal",
        jax=jax.__version__,
        backend=backend,
        devices=[str(d) for d in jax.devices()],
        clock=f"CUPTI device time summed over the P GPUs, {calls} back-to-back calls" if gpu else None,
        performance=gpu,
    )
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    return records


def _ratios(records: list[dict]) -> None:
    """Adds ``ideal_ms`` and ``vs_ideal`` (time / ideal time) to every timed EP record."""
    ideal = {
        (r["case"], r["ep"], r["pass"]): r.get("ms") for r in records if r["impl"] == "local rows (ideal)"
    }
    for r in records:
        if r["impl"].startswith("ep") and r.get("ms") and ideal.get((r["case"], r["ep"], r.get("pass"))):
            r["ideal_ms"] = ideal[(r["case"], r["ep"], r["pass"])]
            r["vs_ideal"] = r["ms"] / r["ideal_ms"]


def cases_for(shapes, P: int) -> list:
    """``bench.ep.EPShape``s (the PyTorch EP bench's shapes) as this bench's cases at EP size P (E fixed, or
    E_local * P)."""
    from moegemm.bench.moe import MoEShape

    return [MoEShape(s.name, s.T, s.d, s.n, s.experts(P), s.k, s.tags, s.source) for s in shapes]


def main(argv=None) -> int:
    """``python -m moegemm.bench.ep_jax``: the bench on this host's devices (``bench --ep`` runs it in a child
    process after the PyTorch runs: JAX and PyTorch then do not share one process's GPU memory)."""
    import argparse

    from moegemm.bench import ep as ep_torch

    p = argparse.ArgumentParser(prog="python -m moegemm.bench.ep_jax")
    p.add_argument("--ep-sizes", default="2,4")
    p.add_argument("--ep-shapes", default=None)
    p.add_argument("--routing", default="skewed")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import jax

    cuda = jax.default_backend() == "gpu"
    records = []
    for P in (int(v) for v in args.ep_sizes.split(",") if v.strip()):
        cases = cases_for(ep_torch.select_shapes(args.ep_shapes, cuda), P)
        records += run(cases, [P], args.out.with_suffix(f".ep{P}.json"), routing=args.routing)
    failed = [r for r in records if str(r.get("status", "ok")).startswith("failed")]
    doc = {"meta": {"ep_sizes": args.ep_sizes, "routing": args.routing}, "records": records}
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    for r in records:
        ms = f"{r['ms']:.3f} ms" if r.get("ms") else ""
        ratio = f" vs ideal {r['vs_ideal']:.2f}x" if r.get("vs_ideal") else ""
        print(
            f"{r['case']:18} EP{r['ep']} {r['impl']:20} {r.get('pass', ''):8} {ms}{ratio} {r.get('status')}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
