"""FP8 from JAX against FP8 from PyTorch (``python -m moegemm.bench --fp8 --fp8-jax``): same kernels, one clock.

Per (case, recipe): both front ends quantize the same bf16 tensors (the bytes and scales must agree
bit for bit), then per op the FP8 GEMM runs from each, its output checked against the other's, and
both are timed by device time from one CUPTI trace per call sequence (``timing.device_ms``: every
kernel the call ran, whichever stream), with host dispatch per call in its own column
(``timing.host_us``). Also the quantize with its transposed copy from each side, and JAX's
differentiable ``ragged_dot(fp8_recipe=)`` fwd+bwd (rhs quantized in the step, and once ahead: ``rhs_fp8``, as the
PyTorch step's weight cache) against moegemm's BF16 ``ragged_dot`` fwd+bwd, gradients checked against BF16's
first.
"""

from __future__ import annotations

import os

# The PyTorch side allocates on the same GPU: JAX must not take 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import moegemm.jax as mj  # noqa: E402
from moegemm import shapes  # noqa: E402
from moegemm.bench import timing  # noqa: E402
from moegemm.jax import api as jax_api  # noqa: E402
from moegemm.torch import k_grouped_mm, m_grouped_mm, quantize_fp8  # noqa: E402


def _to_jax(t: torch.Tensor) -> jax.Array:
    return jax.dlpack.from_dlpack(t.contiguous())


def _bytes(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.contiguous().view(torch.uint8).cpu().numpy()
    return np.asarray(a).view(np.uint8)


def _same_quantization(t_q, j_q, recipe: str) -> bool:
    """data and scale bit for bit (a blockwise activation scale is [M, kb] in torch, [kb, M] in JAX)."""
    scale = t_q.scale.T if recipe == "blockwise" and not t_q.is_weight else t_q.scale
    same = np.array_equal(_bytes(t_q.data), _bytes(j_q.data))
    return same and np.array_equal(scale.contiguous().cpu().numpy(), np.asarray(j_q.scale))


# The FP8 step's gradients against the BF16 step's: E4M3's level (four roundings a product), as the --moe gate.
STEP_GATE = 0.12


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run_case(case: shapes.Case, ops, recipes, device: torch.device, seed: int = 0) -> list[dict]:
    G, M, K, N = case.G, case.M, case.K, case.N
    sizes = shapes.group_sizes(M, G, seed=seed)
    gs = torch.tensor(sizes, dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=gen).to(torch.bfloat16)
    w = (torch.randn(G, N, K, device=device, generator=gen) * K**-0.5).to(torch.bfloat16)
    dy = torch.randn(M, N, device=device, generator=gen).to(torch.bfloat16)
    rows = []
    for recipe in recipes:
        rows += _recipe_rows(case.name, recipe, ops, x, w, dy, gs, device)
    return rows


def _recipe_rows(name: str, recipe: str, ops, x, w, dy, gs, device) -> list[dict]:
    jx, jw, jdy, jgs = _to_jax(x), _to_jax(w), _to_jax(dy), _to_jax(gs)
    dev = lambda fn: timing.device_ms(fn, device)  # noqa: E731
    host = lambda fn: timing.host_us(fn, device)  # noqa: E731
    tq = dict(
        x=quantize_fp8(x, recipe, group_sizes=gs, transpose=True),
        w=quantize_fp8(w, recipe, transpose=True),
        dy=quantize_fp8(dy, recipe, group_sizes=gs, transpose=True),
    )
    quant_act = jax.jit(lambda a, s: mj.quantize_fp8(a, recipe, group_sizes=s, transpose=True))
    quant_w = jax.jit(lambda a: mj.quantize_fp8(a, recipe, transpose=True))
    jq = dict(x=quant_act(jx, jgs), w=quant_w(jw), dy=quant_act(jdy, jgs))
    rows = [
        dict(
            case=name,
            op="quantize",
            recipe=recipe,
            same_bits={k: _same_quantization(tq[k], jq[k], recipe) for k in tq},
            torch_ms=dev(lambda: quantize_fp8(x, recipe, group_sizes=gs, transpose=True)),
            jax_ms=dev(lambda: quant_act(jx, jgs)),
        )
    ]
    torch_calls = {
        "fwd": lambda: m_grouped_mm(tq["x"], tq["w"], gs),
        "dgrad": lambda: m_grouped_mm(tq["dy"], tq["w"].t(), gs),
        "wgrad": lambda: k_grouped_mm(tq["dy"], tq["x"], gs),
    }
    jax_fns = {
        "fwd": (jax.jit(lambda a, b, s: mj.m_grouped_mm(a, b, s)), (jq["x"], jq["w"], jgs)),
        "dgrad": (jax.jit(lambda a, b, s: mj.m_grouped_mm(a, b.t(), s)), (jq["dy"], jq["w"], jgs)),
        "wgrad": (jax.jit(lambda a, b, s: mj.k_grouped_mm(a, b, s)), (jq["dy"], jq["x"], jgs)),
    }
    for op in ops:
        fn, args = jax_fns[op]
        t_out = torch_calls[op]()
        j_out = torch.from_dlpack(jax.block_until_ready(fn(*args)))
        row = dict(case=name, op=op, recipe=recipe, relerr_vs_torch=_relerr(j_out, t_out))
        rows.append(row)
        if not row["relerr_vs_torch"] <= 1e-3:
            row["note"] = "wrong: JAX and PyTorch outputs differ"
            continue
        call = lambda fn=fn, args=args: fn(*args)  # noqa: E731
        row["torch_ms"] = dev(torch_calls[op])
        row["jax_ms"] = dev(call)
        row["jax_vs_torch"] = row["torch_ms"] / row["jax_ms"]
        row["torch_host_us"] = host(torch_calls[op])
        row["jax_host_us"] = host(call)
    # The training op: quantize x, w, dy inside, FP8 fwd + dgrad + wgrad, against BF16 ragged_dot.
    jw_kn = jnp.swapaxes(jw, 1, 2).copy()
    dy32 = jdy.astype(jnp.float32)

    # sin keeps the forward GEMM in the step: with a loss linear in the output, XLA drops the forward
    # custom call (its output feeds nothing).
    def loss_fp8(a, b, s):
        return jnp.vdot(jnp.sin(mj.ragged_dot(a, b, s, fp8_recipe=recipe).astype(jnp.float32)), dy32)

    def loss_bf16(a, b, s):
        return jnp.vdot(jnp.sin(jax_api.ragged_dot(a, b, s).astype(jnp.float32)), dy32)

    # rhs quantized once and kept (rhs_fp8: gradient accumulation's micro-batches, as the PyTorch step's cache).
    def loss_fp8_cached(a, b, s, b_q):
        out = mj.ragged_dot(a, b, s, fp8_recipe=recipe, rhs_fp8=b_q).astype(jnp.float32)
        return jnp.vdot(jnp.sin(out), dy32)

    step_fp8 = jax.jit(jax.grad(loss_fp8, argnums=(0, 1)))
    step_cached = jax.jit(jax.grad(loss_fp8_cached, argnums=(0, 1)))
    step_bf16 = jax.jit(jax.grad(loss_bf16, argnums=(0, 1)))
    jw_q = jax.jit(lambda b: mj.quantize_fp8(b, recipe, transpose=True))(jw_kn)
    # Correctness first: both FP8 steps' gradients against the BF16 step's, at the E4M3 level.
    want = step_bf16(jx, jw_kn, jgs)
    err = lambda got: max(_relerr(torch.from_dlpack(g), torch.from_dlpack(w)) for g, w in zip(got, want))  # noqa: E731
    row = dict(case=name, op="ragged_dot fwd+bwd", recipe=recipe)
    row["relerr_vs_bf16"] = max(err(step_fp8(jx, jw_kn, jgs)), err(step_cached(jx, jw_kn, jgs, jw_q)))
    rows.append(row)
    if not row["relerr_vs_bf16"] <= STEP_GATE:
        row["note"] = f"wrong: FP8 gradients over {STEP_GATE} from BF16's"
        return rows
    row["jax_ms"] = dev(lambda: step_fp8(jx, jw_kn, jgs))
    row["cached_jax_ms"] = dev(lambda: step_cached(jx, jw_kn, jgs, jw_q))
    row["bf16_jax_ms"] = dev(lambda: step_bf16(jx, jw_kn, jgs))
    row["fp8_speedup"] = row["bf16_jax_ms"] / row["jax_ms"]
    row["cached_fp8_speedup"] = row["bf16_jax_ms"] / row["cached_jax_ms"]
    return rows


def run(cases, ops, recipes, device: torch.device, out=None) -> dict:
    """Every case; prints a table and writes the JSON (``out``)."""
    import datetime
    import json

    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    rows = []
    for case in cases:
        console.print(f"[bold]{case.name}[/] G={case.G} M={case.M} K={case.K} N={case.N}")
        rows += run_case(case, ops, recipes, device)
    table = Table(title="FP8 from JAX vs from PyTorch (device time per call, CUPTI)")
    cols = ("case", "op", "recipe", "torch_ms", "jax_ms", "jax_vs_torch", "torch_host_us", "jax_host_us")
    step_cols = ("bf16_jax_ms", "cached_jax_ms", "fp8_speedup", "cached_fp8_speedup", "relerr_vs_bf16")
    extra = (*step_cols, "relerr_vs_torch", "same_bits", "note")
    for col in (*cols, *extra):
        table.add_column(col)
    fmt = lambda v: "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in rows:
        table.add_row(*(fmt(r.get(c)) for c in (*cols, *extra)))
    console.print(table)
    ratios = [r["jax_vs_torch"] for r in rows if r.get("jax_vs_torch")]
    summary = {}
    if ratios:
        summary = dict(
            geomean_jax_vs_torch=float(np.exp(np.mean(np.log(ratios)))),
            within_5pct=sum(r >= 0.95 for r in ratios),
            gemm_rows=len(ratios),
        )
        console.print(summary)
    result = dict(
        meta=dict(
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            date=datetime.date.today().isoformat(),
            torch=torch.__version__,
            jax=jax.__version__,
            triton=__import__("triton").__version__,
            timing="device time per call from a CUPTI trace of 20 back-to-back calls (timing.device_ms)",
        ),
        summary=summary,
        rows=rows,
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
        console.print(f"wrote {out}")
    return result
