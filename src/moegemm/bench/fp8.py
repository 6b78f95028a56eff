"""FP8 mode of the benchmark (``python -m moegemm.bench --fp8``): every recipe, fwd/dgrad/wgrad, peers in one run.

Per (case, op, recipe), on the same quantized operands: moegemm's FP8 GEMM alone (promoted and, where the
recipe has it, fast accumulation), quantize + GEMM (the activation quantize that feeds it: x for fwd, dy for
dgrad, with their transposed copies; wgrad reads those copies and adds none), moegemm's BF16 kernel, and
torch._scaled_grouped_mm with the same recipe (``scaled_grouped_mm_peer``; the recipes torch 2.11 has are
listed in ``TORCH_RECIPES``). Every output is checked against an fp32 product of the dequantized operands
before it is timed; a failed check is recorded and not timed. The implementations of one (op, recipe) take
turns call by call (``timing.paired_ms``, the headline ``ms``) beside their CUPTI device time
(``timing.device_ms``) and host issue time (``timing.host_us``). ``vs_torch`` compares one recipe with the
same recipe in torch and the same accumulation mode, never across recipes. Also dense torch._scaled_mm of
the same FLOPs (its tensorwise rate is the FP8 roofline's compute floor) and the grouped quantize's bandwidth.

The GroupedLinear training step (``--fp8-step-cases``, ``StepTrainer``): the timed unit is one optimizer
step of a training loop, m micro-batches of fwd + bwd (m in ``MICRO_BATCHES``) accumulating gradients, then
AdamW and zero_grad, so the FP8 weight is quantized once per optimizer step, as in training. BF16 and each
recipe take turns; every routing seed of ``STEP_SEEDS`` is a record, summarized by the median over seeds
with its min and max. Each step is first checked against the fp64 oracle of its bf16 inputs (y, dx, dW,
dbias; ``STEP_TOLERANCE``), and its FP8 weight is checked to be quantized once per optimizer step.

Without a GPU (``check_only``) nothing is timed: interpreter times are not performance. The run checks
moegemm's FP8 GEMMs and the training steps (seed 0) under the Triton interpreter; peers, the quantize
bandwidth and timings are left out.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from moegemm import shapes
from moegemm.bench import roofline, timing
from moegemm.torch import Fp8WeightCache, GroupedLinear, k_grouped_mm, m_grouped_mm, quantize_fp8

RECIPES = ("tensorwise", "rowwise", "blockwise")
OPS = ("fwd", "dgrad", "wgrad")
TOLERANCE = 2e-2  # vs an fp32 product of the same dequantized operands: bf16 output and fast accumulation
TORCH_PEER = "torch._scaled_grouped_mm"

# What torch._scaled_grouped_mm (torch 2.11, SM90) does per recipe. It has one FP8 kernel, rowwise: fp32
# scales, [M] for a 2-D operand (or [G * rows] when both are 2-D, the k-grouped wgrad) and [G, N] for a 3-D
# one (aten/src/ATen/native/cuda/GroupedBlas.cpp, _scaled_grouped_mm_cuda and _check_scales_fp8_rowwise).
# Tensorwise runs on that kernel with each scale repeated over its rows, as torch's own operator benchmark
# does (benchmarks/operator_benchmark/pt/scaled_grouped_mm_test.py, "fp8_tensorwise"). torch 2.11 has no
# 1x128 / 128x128 grouped kernel: F.scaled_grouped_mm dispatches rowwise, MXFP8, MXFP4 and NVFP4 only
# (scale_grouped_kernel_dispatch, same file), and its MX formats need SM100.
TORCH_RECIPES = {
    "rowwise": "rowwise kernel",
    "tensorwise": "rowwise kernel, each tensorwise scale repeated over its rows",
}
TORCH_SKIP = {
    "blockwise": "torch 2.11 has no blockwise (1x128 / 128x128) grouped kernel: _scaled_grouped_mm takes fp32 "
    "rowwise scales only, F.scaled_grouped_mm adds MXFP8/MXFP4/NVFP4 (SM100)",
}

# The GroupedLinear step: micro-batches per optimizer step, routing seeds, gradient modes.
MICRO_BATCHES = (1, 4, 16)
STEP_SEEDS = (0, 1, 2)
STEP_MODES = ("main_grad", "grad")
# Relative Frobenius error of y, dx, dW and dbias against the fp64 oracle of the bf16 inputs (randn x and
# dy, nn.Linear-initialized weights). Measured under the interpreter on tiny-qwen3-fc2, tiny-dsv3-fc1 and
# tiny-odd, seeds 0-2, both gradient modes: BF16 3.0e-3 - 3.9e-3 (the bf16 rounding of y, dx, dbias; an fp32
# main_grad 4e-8); every FP8 recipe 3.0e-2 - 3.9e-2 (e4m3's 3 mantissa bits on both operands; dbias stays
# BF16). Tolerances leave a margin of ~1.5x for other shapes and fast accumulation, and fail a broken
# recipe (a wrong scale or an unwritten tile is >= 1e-1).
STEP_TOLERANCE = {"bf16": 1e-2, "tensorwise": 6e-2, "rowwise": 6e-2, "blockwise": 6e-2}
STEP_LR = 1e-4


@dataclasses.dataclass
class Row:
    """One implementation of one (case, op, recipe). ``ms`` is the headline clock (``timing.paired_stats``);
    ``status`` "ok" (checked, then timed), "failed" (check or run failed: not timed) or "skipped" (the peer has
    no such recipe; ``reason`` says why). ``vs_torch``: torch's ms / this ms, same recipe and accumulation."""

    case: str
    op: str
    impl: str
    recipe: str | None
    seed: int = 0
    fast_accum: bool | None = None
    ms: float | None = None
    reps: int | None = None
    device_ms: float | None = None
    host_us: float | None = None
    tflops: float | None = None
    quantize_plus_gemm_ms: float | None = None
    relerr: float | None = None
    tol: float | None = None
    status: str = "ok"
    reason: str | None = None
    peak_mb: float | None = None
    pct_floor: float | None = None
    vs_torch: float | None = None
    vs_bf16: float | None = None
    kernel: str | None = None


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32 (an fp64 copy of a [G, N, K] gradient does not fit beside the
    rest on the GPU: gptoss-120b-fc1's is 17 GB); inf on NaN."""
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def _grouped_ref(a, b_rows, sizes):
    """out[rows(g)] = a[rows(g)] @ b_rows[g]^T in fp32."""
    out = torch.zeros(a.shape[0], b_rows.shape[1], device=a.device)
    start = 0
    for g, n in enumerate(sizes):
        if n:
            out[start : start + n] = a[start : start + n] @ b_rows[g].T
        start += n
    return out


def _wgrad_ref(a, b, sizes):
    out, start = [], 0
    for n in sizes:
        out.append(a[start : start + n].T @ b[start : start + n])
        start += n
    return torch.stack(out)


def _op_calls(op, fast, x_q, w_q, dy_q, gs, sizes):
    """(moegemm's call, its fp32 reference) for one op on quantized operands."""
    if op == "fwd":
        fn = lambda: m_grouped_mm(x_q, w_q, gs, fast_accum=fast)  # noqa: E731
        ref = lambda: _grouped_ref(x_q.dequantize(), w_q.dequantize(), sizes)  # noqa: E731
    elif op == "dgrad":
        w_t = w_q.t()
        fn = lambda: m_grouped_mm(dy_q, w_t, gs, fast_accum=fast)  # noqa: E731
        ref = lambda: _grouped_ref(dy_q.dequantize(), w_t.dequantize(), sizes)  # noqa: E731
    else:
        fn = lambda: k_grouped_mm(dy_q, x_q, gs, fast_accum=fast)  # noqa: E731
        ref = lambda: _wgrad_ref(dy_q.dequantize_t(), x_q.dequantize_t(), sizes)  # noqa: E731
    return fn, ref


def inputs(case: shapes.Case, device: torch.device, seed: int = 0, split: str = "dirichlet"):
    """(sizes, group_sizes on device, x [M, K], w [G, N, K], dy [M, N]) in bf16, seeded: the operands
    every FP8 measurement quantizes."""
    G, M, K, N = case.G, case.M, case.K, case.N
    sizes = shapes.group_sizes(M, G, split=split, seed=seed)
    gs = torch.tensor(sizes, dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=gen).to(torch.bfloat16)
    w = (torch.randn(G, N, K, device=device, generator=gen) * K**-0.5).to(torch.bfloat16)
    dy = torch.randn(M, N, device=device, generator=gen).to(torch.bfloat16)
    return sizes, gs, x, w, dy


@dataclasses.dataclass
class Peer:
    """torch._scaled_grouped_mm for one (op, recipe) on moegemm's quantized operands: ``fn`` and its fp32
    reference ``ref`` where torch has the recipe, else ``skip`` (the reason)."""

    fn: Callable | None
    ref: Callable | None
    fast_accum: bool
    kernel: str | None = None
    skip: str | None = None


def scaled_grouped_mm_peer(op, recipe, x_q, w_q, dy_q, sizes) -> Peer:
    """torch._scaled_grouped_mm computing ``op`` on the same quantized operands as moegemm (``inputs``
    quantized with group sizes and ``transpose=True``). fwd and dgrad with fast accumulation, as torch's
    users run it; wgrad promoted, as moegemm's (the k-grouped form, offsets along the tokens: data_t's
    16-aligned group starts, whose padding columns are 0). Its FP8 operands need 16-byte rows: K and N
    multiples of 16."""
    fast = op != "wgrad"
    if recipe in TORCH_SKIP:
        return Peer(None, None, fast, skip=TORCH_SKIP[recipe])
    if not hasattr(torch, "_scaled_grouped_mm"):
        return Peer(None, None, fast, skip=f"torch {torch.__version__} has no _scaled_grouped_mm")
    K, N = x_q.shape[1], dy_q.shape[1]
    if K % 16 or N % 16:
        return Peer(
            None, None, fast, skip=f"torch needs K and N multiples of 16 (16-byte FP8 rows), got {K}, {N}"
        )
    device, G = x_q.data.device, len(sizes)
    ids = torch.repeat_interleave(torch.arange(G, device=device), torch.tensor(sizes, device=device))

    def rows(q):  # an activation's [M] scale (tensorwise: its group's scale on each row)
        return q.scale.contiguous() if recipe == "rowwise" else q.scale[ids].contiguous()

    def per_group(scale, n):  # a [G, n] scale (tensorwise: the group's scale repeated)
        return scale.contiguous() if recipe == "rowwise" else scale[:, None].expand(G, n).contiguous()

    if op in ("fwd", "dgrad"):
        a = x_q if op == "fwd" else dy_q
        b = w_q if op == "fwd" else w_q.t()  # [G, n_out, n_in], n_in contiguous
        a_data, b_data = a.data.contiguous(), b.data.contiguous().transpose(-2, -1)
        sa, sb = rows(a), per_group(b.scale, b.data.shape[1])
        offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
        ref = lambda: _grouped_ref(a.dequantize(), b.dequantize(), sizes)  # noqa: E731
    else:
        # dw[g] = dy[rows(g)].T @ x[rows(g)]: mat_a = dy's data_t [N, M_t], mat_b = x's data_t^T [M_t, K];
        # scales [G * N] and [G * K], group-major (moegemm's rowwise scale_t is [G, n]).
        a_data, b_data = dy_q.data_t, x_q.data_t.t()
        sa = per_group(dy_q.scale_t, N).reshape(-1)
        sb = per_group(x_q.scale_t, K).reshape(-1)
        padded = [16 * -(-n // 16) for n in sizes]
        offs = torch.tensor(padded, device=device).cumsum(0).to(torch.int32)
        ref = lambda: _wgrad_ref(dy_q.dequantize_t(), x_q.dequantize_t(), sizes)  # noqa: E731

    def fn():
        return torch._scaled_grouped_mm(
            a_data, b_data, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    return Peer(fn, ref, fast, kernel=TORCH_RECIPES[recipe])


def check(fn, ref, tol: float) -> tuple[float | None, str | None]:
    """(relerr, None) when fn's output is within ``tol`` of ``ref()``, else (relerr or None, the reason)."""
    try:
        err = relerr(fn().float(), ref())
    except Exception as exc:  # noqa: BLE001 - a call that fails is a result
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    return err, None if err <= tol else f"relerr {err:.3e} > tol {tol:.1e}"


def time_group(fns: dict, device: torch.device, cfg: timing.TimingConfig) -> dict:
    """name -> {"ms", "reps", "device_ms", "host_us"} of callables that take turns on the headline clock
    (``timing.paired_stats``: >= 10 warm-ups, >= 100 reps on small problems), each one's CUPTI device time
    and host issue time beside."""
    if not fns:
        return {}
    estimate = timing.round_ms(fns, device)
    stats = timing.paired_stats(fns, device, cfg, estimate)
    per_call = estimate / len(fns)
    calls = max(3, min(20, int(2000 / max(per_call, 1e-3))))
    return {
        name: {
            "ms": stats[name]["median"],
            "reps": stats[name]["reps"],
            "device_ms": timing.device_ms(fn, device, calls=calls),
            "host_us": timing.host_us(fn, device, calls=max(5, min(50, calls))),
        }
        for name, fn in fns.items()
    }


class Fp8Bench:
    def __init__(
        self,
        device: torch.device,
        cfg: timing.TimingConfig,
        seed: int = 0,
        check_only: bool | None = None,
        backend: str = "auto",
    ) -> None:
        self.device, self.cfg, self.seed, self.backend = device, cfg, seed, backend
        self.check_only = device.type != "cuda" if check_only is None else check_only
        self.rows: list[Row] = []
        self.extra: dict = {
            "quantize": [],
            "grouped_linear_step": [],
            "grouped_linear_step_summary": [],
            "dense_fp8_tflops": {},
            "tune": [],
        }

    def time(self, fn) -> float:
        """do_bench median (the tuner's clock: one config at a time)."""
        return timing.median_ms(fn, self.device, "events", self.cfg)

    def case(self, case: shapes.Case, ops, recipes) -> None:
        sizes, gs, x, w, dy = inputs(case, self.device, self.seed)
        dense_rate = None if self.check_only else self.dense(case)
        bf16_done = set()
        for recipe in recipes:
            x_q = quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
            w_q = quantize_fp8(w, recipe, transpose=True)
            dy_q = quantize_fp8(dy, recipe, group_sizes=gs, transpose=True)
            if not self.check_only:
                self.quantize_bandwidth(case, recipe, x, gs)
            for op in ops:
                cands = self._candidates(case, op, recipe, x, w, dy, x_q, w_q, dy_q, gs, sizes)
                if op not in bf16_done and not self.check_only:
                    cands["moegemm-bf16"] = self._bf16_candidate(case, op, x, w, dy, gs)
                    bf16_done.add(op)
                self.measure_group(case, cands, dense_rate)
            del x_q, w_q, dy_q

    def _candidates(self, case, op, recipe, x, w, dy, x_q, w_q, dy_q, gs, sizes) -> dict:
        """impl -> (Row, fn, ref, quantize + GEMM fn or None) of one (op, recipe)."""
        out = {}
        for fast in (False, True) if recipe != "blockwise" and op != "wgrad" else (False,):
            impl = f"moegemm-fp8{'-fast' if fast else ''}"
            fn, ref = _op_calls(op, fast, x_q, w_q, dy_q, gs, sizes)
            qfn = None
            if op != "wgrad":
                a, b = (x, w_q) if op == "fwd" else (dy, w_q.t())
                qfn = lambda a=a, b=b, fast=fast: m_grouped_mm(  # noqa: E731
                    quantize_fp8(a, recipe, group_sizes=gs, transpose=True), b, gs, fast_accum=fast
                )
            row = Row(case.name, op, impl, recipe, self.seed, fast, tol=TOLERANCE)
            out[impl] = (row, fn, ref, qfn)
        if not self.check_only:
            peer = scaled_grouped_mm_peer(op, recipe, x_q, w_q, dy_q, sizes)
            row = Row(case.name, op, TORCH_PEER, recipe, self.seed, peer.fast_accum, tol=TOLERANCE)
            row.kernel = peer.kernel
            if peer.skip:
                row.status, row.reason = "skipped", peer.skip
            out[TORCH_PEER] = (row, peer.fn, peer.ref, None)
        return out

    def _bf16_candidate(self, case, op, x, w, dy, gs):
        fn = {
            "fwd": lambda: m_grouped_mm(x, w.mT, gs),
            "dgrad": lambda: m_grouped_mm(dy, w, gs),
            "wgrad": lambda: k_grouped_mm(dy, x, gs),
        }[op]
        return Row(case.name, op, "moegemm-bf16", None, self.seed), fn, None, None

    def measure_group(self, case: shapes.Case, cands: dict, dense_rate: float | None = None) -> list[Row]:
        """Checks each candidate (impl -> (Row, fn, ref or None, quantize + GEMM fn or None)) against its
        reference, then times those that passed, taking turns; appends and returns the rows. A candidate
        that fails its check or raises is recorded "failed" and never timed; a "skipped" one is not run."""
        fns = {}
        for impl, (row, fn, ref, qfn) in cands.items():
            if row.status != "ok":
                continue
            if ref is not None:
                row.relerr, reason = check(fn, ref, row.tol)
                if reason:
                    row.status, row.reason = "failed", reason
                    continue
            if not self.check_only:
                fns[impl] = fn
                if qfn is not None:
                    fns[impl + "+quantize"] = qfn
        times = time_group(fns, self.device, self.cfg) if not self.check_only else {}
        torch_row = cands.get(TORCH_PEER, (None,))[0]
        bf16_row = cands.get("moegemm-bf16", (None,))[0]
        for impl, (row, *_) in cands.items():
            t = times.get(impl)
            if t is not None:
                row.ms, row.device_ms, row.host_us, row.reps = (
                    t["ms"],
                    t["device_ms"],
                    t["host_us"],
                    t["reps"],
                )
                row.tflops = roofline.op_flops(case, row.op) / row.ms / 1e9
                q = times.get(impl + "+quantize")
                row.quantize_plus_gemm_ms = q["ms"] if q else row.ms if row.op == "wgrad" else None
                row.pct_floor = self._floor_pct(case, row.op, row.ms, dense_rate)
        for impl, (row, *_) in cands.items():
            if row.ms is None or impl in (TORCH_PEER, "moegemm-bf16"):
                continue
            if torch_row is not None and torch_row.ms is not None and torch_row.fast_accum == row.fast_accum:
                row.vs_torch = torch_row.ms / row.ms
            if bf16_row is not None and bf16_row.ms is not None:
                row.vs_bf16 = bf16_row.ms / row.ms
        rows = [c[0] for c in cands.values()]
        self.rows.extend(rows)
        return rows

    def _floor_pct(self, case, op, ms, dense_rate) -> float | None:
        if dense_rate is None or ms is None:
            return None
        flops = roofline.op_flops(case, op)
        G, M, K, N = case.G, case.M, case.K, case.N
        out_bytes = {"fwd": 2 * M * N, "dgrad": 2 * M * K, "wgrad": 4 * G * N * K}[op]
        in_bytes = {"fwd": M * K + G * N * K, "dgrad": M * N + G * N * K, "wgrad": M * (N + K)}[op]
        floor_s = max(flops / (dense_rate * 1e12), (in_bytes + out_bytes) / roofline.PEAK_BYTES_PER_S)
        return 100 * floor_s / (ms / 1e3)

    def dense(self, case) -> float | None:
        """Dense FP8 of the fwd shape [M, K] x [K, N], the recipes taking turns; returns the tensorwise rate
        (the floor's compute rate)."""
        M, K, N = case.M, case.K, case.N
        a = torch.randn(M, K, device=self.device).to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device=self.device).to(torch.float8_e4m3fn)
        flops = 2 * M * K * N
        one = torch.ones((), device=self.device)
        calls = {
            "tensorwise": lambda: torch._scaled_mm(
                a, b.T, one, one, out_dtype=torch.bfloat16, use_fast_accum=True
            ),
            "rowwise": lambda: torch._scaled_mm(
                a,
                b.T,
                torch.ones(M, 1, device=self.device),
                torch.ones(1, N, device=self.device),
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            ),
        }
        try:
            from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

            sa = torch.ones(K // 128, M, device=self.device).T if K % 128 == 0 else None
            sb = torch.ones(N // 128, K // 128, device=self.device) if K % 128 == 0 and N % 128 == 0 else None
            if sa is not None and sb is not None:
                calls["blockwise"] = lambda: scaled_mm(
                    a,
                    b.T,
                    sa,
                    ScalingType.BlockWise1x128,
                    sb.T,
                    ScalingType.BlockWise128x128,
                    swizzle_a=SwizzleType.NO_SWIZZLE,
                    swizzle_b=SwizzleType.NO_SWIZZLE,
                    output_dtype=torch.bfloat16,
                )
        except ImportError:
            pass
        rows, fns = {}, {}
        for recipe, fn in calls.items():
            row = rows[recipe] = Row(case.name, "fwd", f"dense-scaled_mm-{recipe}", recipe, self.seed, True)
            try:
                fn()
                fns[recipe] = fn
            except Exception as exc:  # noqa: BLE001
                row.status, row.reason = "failed", f"{type(exc).__name__}: {str(exc)[:160]}"
        for recipe, t in time_group(fns, self.device, self.cfg).items():
            row = rows[recipe]
            row.ms, row.device_ms, row.host_us, row.reps = t["ms"], t["device_ms"], t["host_us"], t["reps"]
            row.tflops = flops / row.ms / 1e9
        self.rows.extend(rows.values())
        rates = {recipe: row.tflops for recipe, row in rows.items() if row.tflops is not None}
        self.extra["dense_fp8_tflops"][case.name] = rates
        return rates.get("tensorwise")

    def tune(self, case: shapes.Case, ops, recipes, modes=("promoted", "fast")) -> dict[str, dict]:
        """Times every candidate config of each (op, recipe, accumulation mode) on this case; returns
        the winners by the cache key the launcher looks up (recorded by ``harness.config_spy``)."""
        from moegemm._src import configs
        from moegemm._src.fp8 import config_op as fp8_op
        from moegemm.bench import harness, tune

        sizes, gs, x, w, dy = inputs(case, self.device, self.seed)
        winners = {}
        for recipe in recipes:
            x_q = quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
            w_q = quantize_fp8(w, recipe, transpose=True)
            dy_q = quantize_fp8(dy, recipe, group_sizes=gs, transpose=True)
            for op in ops:
                for fast in (False, True) if recipe != "blockwise" else (False,):
                    if ("fast" if fast else "promoted") not in modes:
                        continue
                    fn, ref = _op_calls(op, fast, x_q, w_q, dy_q, gs, sizes)
                    want = ref()
                    kind = fp8_op("k_grouped_fp8" if op == "wgrad" else "m_grouped_fp8", recipe, fast)
                    trial = []
                    for config in configs.candidates(kind, "sm90"):
                        seen: list[dict] = []
                        rec = {"case": case.name, "op": op, "recipe": recipe, "fast_accum": fast}
                        rec["config"] = dataclasses.asdict(config)
                        try:
                            with tune.force_config(config), harness.config_spy(seen):
                                err = relerr(fn().float(), want)
                                rec.update(relerr=err, cache_key=seen[0]["cache_key"])
                                if err <= TOLERANCE:
                                    rec["ms"] = self.time(fn)
                        except Exception as exc:  # noqa: BLE001 - a config that fails is a result
                            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                        trial.append(rec)
                    ok = [r for r in trial if r.get("ms") is not None]
                    if ok:
                        best = min(ok, key=lambda r: r["ms"])
                        best["best"] = True
                        winners[best["cache_key"]] = best["config"]
                    self.extra["tune"].extend(trial)
            del x_q, w_q, dy_q
        return winners

    def quantize_bandwidth(self, case, recipe, x, gs) -> None:
        M, K = x.shape
        call = lambda: quantize_fp8(x, recipe, group_sizes=gs, transpose=True)  # noqa: E731
        t = time_group({"quantize": call}, self.device, self.cfg)["quantize"]
        ms, dev_ms = t["ms"], t["device_ms"]
        nbytes = 2 * M * K + 2 * M * K  # read bf16, write data and data_t (scales are < 1%)
        self.extra["quantize"].append(
            {
                "case": case.name,
                "recipe": recipe,
                "seed": self.seed,
                "ms": ms,
                "reps": t["reps"],
                "device_ms": dev_ms,
                "host_us": t["host_us"],
                "GBps": nbytes / ms / 1e6,
                "pct_of_peak": 100 * nbytes / (ms / 1e3) / roofline.PEAK_BYTES_PER_S,
                # The kernels' own time (CUPTI): on small problems the event clock is the host's issue time.
                "device_pct_of_peak": None
                if dev_ms is None
                else 100 * nbytes / (dev_ms / 1e3) / roofline.PEAK_BYTES_PER_S,
            }
        )

    def grouped_linear_step(
        self,
        case: shapes.Case,
        micro_batches=MICRO_BATCHES,
        seeds=STEP_SEEDS,
        modes=STEP_MODES,
        recipes=("bf16", *RECIPES),
    ) -> list[dict]:
        """The GroupedLinear training step (``StepTrainer``), BF16 and each recipe, per gradient mode and
        routing seed: each trainer is checked (``check_step``), then for every m in ``micro_batches`` the
        optimizer steps of those that passed take turns (``time_group``; timed one after another, BF16's
        step drifted 8.9 -> 10.3 ms over three passes on the H100 while FP8's moved 5%). Appends one record
        per (mode, seed, recipe, m) and the summaries over seeds; returns the records."""
        records = []
        for mode in modes:
            for seed in seeds:
                sizes, gs, batches, w0, b0 = step_inputs(case, self.device, seed)
                trainers, checks = {}, {}
                for recipe in recipes:
                    try:
                        trainer = StepTrainer(recipe, mode, w0, b0, batches, gs, self.backend)
                        checks[recipe] = check_step(trainer, sizes, w0, b0)
                    except Exception as exc:  # noqa: BLE001 - a step that cannot run is a result
                        trainer = None
                        checks[recipe] = {
                            "status": "failed",
                            "reason": f"{type(exc).__name__}: {str(exc)[:200]}",
                        }
                    if checks[recipe]["status"] == "ok":
                        trainers[recipe] = trainer
                for m in micro_batches if not self.check_only else (None,):  # checked, not timed: one record
                    steps = {r: (lambda t=t, m=m: t.step(m)) for r, t in trainers.items()}
                    times = {} if self.check_only else time_group(steps, self.device, self.cfg)
                    peaks = {} if self.check_only else self._step_peaks(trainers, m)
                    for recipe in recipes:
                        c = checks[recipe]
                        t = times.get(recipe, {})
                        bf16 = times.get("bf16", {})
                        ms, dev = t.get("ms"), t.get("device_ms")
                        records.append(
                            {
                                "case": case.name,
                                "impl": "moegemm.GroupedLinear",
                                "recipe": recipe,
                                "mode": mode,
                                "seed": seed,
                                "micro_batches": m,
                                "optimizer": "AdamW(fused)",
                                "ms": ms,
                                "reps": t.get("reps"),
                                "ms_per_micro_batch": None if ms is None else ms / m,
                                "device_ms": dev,
                                "device_ms_per_micro_batch": None if dev is None else dev / m,
                                "host_us": t.get("host_us"),
                                "speedup_vs_bf16": _ratio(bf16.get("ms"), ms),
                                "device_speedup_vs_bf16": _ratio(bf16.get("device_ms"), dev),
                                "relerr": c.get("relerr"),
                                "relerr_parts": c.get("relerr_parts"),
                                "tol": STEP_TOLERANCE[recipe],
                                "weight_quantizes_per_step": c.get("weight_quantizes_per_step"),
                                "status": c["status"],
                                "reason": c["reason"],
                                "peak_mb": peaks.get(recipe, (None, None))[0],
                                "peak_mb_produced_input": peaks.get(recipe, (None, None))[1],
                            }
                        )
                # The last m's step closures hold the trainers too: without them, a seed's four trainers (their
                # fp32 masters and AdamW states, 19 GB each on dsv3-ep8-fc1 main_grad) outlived it, and the next
                # seed's inputs ran out of an H100's memory.
                del trainers, batches, steps
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        self.extra["grouped_linear_step"].extend(records)
        self.extra["grouped_linear_step_summary"].extend(summarize_steps(records))
        return records

    def _step_peaks(self, trainers: dict, m: int) -> dict:
        """recipe -> (peak MB of one optimizer step of m micro-batches, peak MB of one fwd + bwd whose input
        is made inside it, as a dispatched activation is: only what autograd saves keeps it alive, BF16 its
        input, FP8 its transposed FP8 copy)."""
        peaks = {}
        for recipe, t in trainers.items():
            _, peak = timing.call_with_peak_mb(lambda t=t: t.step(m), self.device)
            _, produced = timing.call_with_peak_mb(
                lambda t=t: t.micro_batch(0, produce_input=True), self.device
            )
            t.optimizer_step()
            peaks[recipe] = (peak, produced)
        return peaks


def _ratio(a, b) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def step_inputs(case: shapes.Case, device: torch.device, seed: int, pool: int = 2):
    """(sizes, group_sizes on device, micro-batches [(x [M, K] leaf requiring grad, dy [M, N])] * pool, w0
    [G, N, K], b0 [G, N]) in bf16, seeded; w0 and b0 as nn.Linear initializes them. The micro-batches of a
    step cycle through the pool, so consecutive ones read different inputs."""
    G, M, K, N = case.G, case.M, case.K, case.N
    sizes = shapes.group_sizes(M, G, seed=seed)
    gs = torch.tensor(sizes, dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    bound = K**-0.5 if K else 0.0
    w0 = ((torch.rand(G, N, K, device=device, generator=gen) * 2 - 1) * bound).to(torch.bfloat16)
    b0 = ((torch.rand(G, N, device=device, generator=gen) * 2 - 1) * bound).to(torch.bfloat16)
    batches = [
        (
            torch.randn(M, K, device=device, generator=gen).to(torch.bfloat16).requires_grad_(),
            torch.randn(M, N, device=device, generator=gen).to(torch.bfloat16),
        )
        for _ in range(pool)
    ]
    return sizes, gs, batches, w0, b0


class StepTrainer:
    """One GroupedLinear (bias, bf16 parameters w0, b0) in a training loop; ``step(m)`` is one optimizer step:
    m micro-batches of fwd + bwd accumulating gradients, then AdamW (fused, CPU too) and zero_grad.

    mode "grad": autograd accumulates weight.grad and bias.grad in bf16; AdamW updates the bf16 parameters
    in place. mode "main_grad" (Megatron): ``fuse_wgrad_accumulation`` accumulates the weight gradient into
    an fp32 ``weight.main_grad``; AdamW updates fp32 master copies, which are copied into the bf16
    parameters. The next forward of an FP8 layer quantizes the new weight (``Fp8WeightCache``: the optimizer
    step count is in its key, since the fused AdamW of mode "grad" leaves ``weight._version`` alone): once per
    optimizer step.
    """

    def __init__(self, recipe: str, mode: str, w0, b0, batches, gs, backend: str = "auto") -> None:
        G, N, K = w0.shape
        device = w0.device
        self.recipe, self.mode, self.batches, self.gs = recipe, mode, batches, gs
        self.module = GroupedLinear(
            G,
            K,
            N,
            dtype=torch.bfloat16,
            device=device,
            fuse_wgrad_accumulation=mode == "main_grad",
            backend=backend,
            fp8_recipe=None if recipe == "bf16" else recipe,
        )
        with torch.no_grad():
            self.module.weight.copy_(w0)
            self.module.bias.copy_(b0)
        opt_kwargs = {"lr": STEP_LR, "fused": True}  # as trainers run it; fused leaves _version alone
        if mode == "main_grad":
            self.module.weight.main_grad = torch.zeros(G, N, K, device=device)
            self.master = [p.detach().float().clone().requires_grad_() for p in self.module.parameters()]
            self.opt = torch.optim.AdamW(self.master, **opt_kwargs)
        else:
            self.master = None
            self.opt = torch.optim.AdamW(self.module.parameters(), **opt_kwargs)

    def micro_batch(self, i: int, produce_input: bool = False) -> torch.Tensor:
        """fwd + bwd of micro-batch i (of the pool, cyclically); returns y. ``produce_input``: the layer's
        input made inside the call (x * 1.0)."""
        x, dy = self.batches[i % len(self.batches)]
        x.grad = None
        y = self.module(x * 1.0 if produce_input else x, self.gs)
        y.backward(dy)
        return y

    def optimizer_step(self) -> None:
        weight, bias = self.module.weight, self.module.bias
        if self.master is not None:
            self.master[0].grad = weight.main_grad
            self.master[1].grad = bias.grad.float()
            self.opt.step()
            with torch.no_grad():
                weight.copy_(self.master[0])
                bias.copy_(self.master[1])
            weight.main_grad.zero_()
            bias.grad = None
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, m: int) -> None:
        for i in range(m):
            self.micro_batch(i)
        self.optimizer_step()


class CountingWeightCache(Fp8WeightCache):
    """An Fp8WeightCache that counts how often it quantized the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.quantizes = 0

    def get(self, *args, **kwargs):
        before = self.storage
        out = super().get(*args, **kwargs)
        self.quantizes += out is not before
        return out


def step_errors(y, dx, dw, db, x, w, b, dy, sizes) -> dict:
    """Relative Frobenius error of the step's y, dx, dW, dbias against the fp64 oracle of its bf16 inputs
    (for g: y[rows(g)] = x @ w[g].T + b[g], dx = dy @ w[g], dW[g] = dy.T @ x, db[g] = colsum(dy); rows past
    sum(sizes): y = dx = 0), accumulated group by group so no fp64 copy of a whole [G, N, K] is made."""
    err = dict.fromkeys(("y", "dx", "dw", "dbias"), 0.0)
    ref = dict.fromkeys(("y", "dx", "dw", "dbias"), 0.0)

    def add(name, out, want):
        err[name] += float((out.double() - want).pow(2).sum())
        ref[name] += float(want.pow(2).sum())

    start = 0
    for g, n in enumerate(sizes):
        rows = slice(start, start + n)
        xg, dyg, wg = x[rows].double(), dy[rows].double(), w[g].double()
        add("y", y[rows], xg @ wg.T + b[g].double())
        add("dx", dx[rows], dyg @ wg)
        add("dw", dw[g], dyg.T @ xg)
        add("dbias", db[g], dyg.sum(0))
        start += n
    tail = slice(start, None)
    add("y", y[tail], torch.zeros_like(y[tail], dtype=torch.float64))
    add("dx", dx[tail], torch.zeros_like(dx[tail], dtype=torch.float64))
    bad = lambda t: bool(torch.isnan(t).any())  # noqa: E731
    return {
        k: float("inf") if bad(out) else (err[k] / max(ref[k], 1e-300)) ** 0.5
        for k, out in zip(("y", "dx", "dw", "dbias"), (y, dx, dw, db))
    }


def check_step(trainer: StepTrainer, sizes, w0, b0, steps: int = 2, micro_batches: int = 2) -> dict:
    """Checks a fresh trainer before it is timed. Its first micro-batch's y, dx, dW and dbias against the
    fp64 oracle (``step_errors``, ``STEP_TOLERANCE``); then ``steps`` optimizer steps of ``micro_batches``
    micro-batches, counting the FP8 weight's quantizes: training re-quantizes once per optimizer step, so
    the count must be ``steps`` (1 would be a weight never updated, ``steps * micro_batches`` a cache that
    re-quantizes each micro-batch). Returns {"status", "reason", "relerr", "relerr_parts",
    "weight_quantizes_per_step"}."""
    module = trainer.module
    counter = CountingWeightCache() if module.fp8 is not None else None
    if counter is not None:
        module._fp8_weight = counter
    x, dy = trainer.batches[0]
    y = trainer.micro_batch(0)
    dw = module.weight.main_grad if trainer.mode == "main_grad" else module.weight.grad
    parts = step_errors(y.detach(), x.grad, dw, module.bias.grad, x.detach(), w0, b0, dy, sizes)
    for i in range(1, micro_batches):
        trainer.micro_batch(i)
    trainer.optimizer_step()
    for _ in range(steps - 1):
        trainer.step(micro_batches)
    err = max(parts.values())
    tol = STEP_TOLERANCE[trainer.recipe]
    out = {
        "status": "ok",
        "reason": None,
        "relerr": err,
        "relerr_parts": parts,
        "weight_quantizes_per_step": None,
    }
    if counter is not None:
        out["weight_quantizes_per_step"] = counter.quantizes / steps
        module._fp8_weight = Fp8WeightCache()  # the timed steps run the module's own cache
    if not err <= tol:
        worst = max(parts, key=parts.get)
        out["status"], out["reason"] = "failed", f"relerr {err:.3e} ({worst}) > tol {tol:.1e}"
    elif counter is not None and counter.quantizes != steps:
        out["status"] = "failed"
        out["reason"] = (
            f"weight quantized {counter.quantizes} times in {steps} optimizer steps of {micro_batches} "
            f"micro-batches (expected {steps})"
        )
    return out


def summarize_steps(records: list[dict]) -> list[dict]:
    """Per (case, mode, recipe, micro_batches): the median over routing seeds of ms, device_ms and the
    speedups, with their min and max; only records that passed their check and were timed."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["status"] == "ok" and r["ms"] is not None:
            groups.setdefault((r["case"], r["mode"], r["recipe"], r["micro_batches"]), []).append(r)
    out = []
    for (case, mode, recipe, m), rs in groups.items():
        summary = {"case": case, "mode": mode, "recipe": recipe, "micro_batches": m}
        summary["seeds"] = [r["seed"] for r in rs]
        for key in ("ms", "ms_per_micro_batch", "device_ms", "speedup_vs_bf16", "device_speedup_vs_bf16"):
            vals = [r[key] for r in rs if r[key] is not None]
            summary[key] = (
                {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
            )
        out.append(summary)
    return out


def meta(
    device: torch.device,
    check_only: bool,
    cfg: timing.TimingConfig,
    step_seeds=(),
    micro_batches=(),
    name: str = "fp8",
) -> dict:
    """The run's description at the top of the JSON (``report.run_meta``) with the FP8 tolerances and what
    torch's peer runs per recipe."""
    from moegemm.bench import harness, report

    env = harness.Environment.detect(device)
    return {
        **report.run_meta(env, check_only, None, benchmark=name, tcfg=cfg, seeds=list(step_seeds) or None),
        "tolerance": TOLERANCE,
        "step_tolerance": STEP_TOLERANCE,
        "step": {
            "micro_batches": list(micro_batches),
            "optimizer": f"AdamW lr={STEP_LR} (fused)",
            "modes": STEP_MODES,
        },
        "torch_recipes": {**TORCH_RECIPES, **{r: f"skipped: {why}" for r, why in TORCH_SKIP.items()}},
    }


def run(
    cases,
    ops,
    recipes,
    device,
    cfg,
    out: Path | None,
    step_cases=(),
    tune_dir: Path | None = None,
    tune_modes=("promoted", "fast"),
    micro_batches=MICRO_BATCHES,
    step_seeds=None,
    step_modes=STEP_MODES,
    name: str = "fp8",
) -> dict:
    """The FP8 benchmark; with ``tune_dir``, first times every candidate config per (case, op,
    recipe, accumulation mode) and merges the winners into ``tune_dir``/<device>.json (loaded by
    ``moegemm._src.configs`` when it is the committed directory), then benchmarks with them.
    ``step_seeds``: STEP_SEEDS on a GPU, seed 0 alone without one (each interpreter step takes seconds)."""
    from rich.console import Console
    from rich.table import Table

    bench = Fp8Bench(device, cfg)
    console = Console(width=180)
    if step_seeds is None:
        step_seeds = (0,) if bench.check_only else STEP_SEEDS
    if tune_dir is not None:
        from moegemm._src import configs
        from moegemm.bench import tune

        for case in cases:
            console.print(f"[bold]tune[/] {case.name}")
            winners = bench.tune(case, ops, recipes, tune_modes)
            path = tune.write_cache(torch.cuda.get_device_name(device), winners, tune_dir)
            console.print(f"  {len(winners)} winners merged into {path}")
        if Path(tune_dir).resolve() != configs.CACHE_DIR.resolve():
            # Benchmark with what was just tuned, not with the committed cache.
            configs.CACHE_DIR = Path(tune_dir)
        configs.load_cache.cache_clear()
    for case in cases:
        console.print(f"[bold]{case.name}[/] G={case.G} M={case.M} K={case.K} N={case.N}")
        bench.case(case, ops, recipes)
    for case in step_cases:
        console.print(f"[bold]GroupedLinear step[/] {case.name}")
        bench.grouped_linear_step(case, micro_batches, step_seeds, step_modes, ("bf16", *recipes))
    if bench.check_only:
        return _finish_check(console, bench, out, step_cases, step_seeds, name)
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    table = Table(title="FP8 grouped GEMMs (paired CUDA-event median; CUPTI device time beside)")
    cols = ("case", "op", "impl", "recipe", "fast", "ms", "device ms", "TF/s", "q+gemm ms", "% floor")
    for col in (*cols, "vs torch", "relerr", "status"):
        table.add_column(col)
    for r in bench.rows:
        table.add_row(
            r.case,
            r.op,
            r.impl,
            r.recipe or "",
            "" if r.fast_accum is None else str(r.fast_accum),
            fmt(r.ms, ".3f"),
            fmt(r.device_ms, ".3f"),
            fmt(r.tflops, ".0f"),
            fmt(r.quantize_plus_gemm_ms, ".3f"),
            fmt(r.pct_floor, ".0f"),
            fmt(r.vs_torch, ".2f"),
            fmt(r.relerr, ".1e"),
            r.status + (f": {r.reason}" if r.reason else ""),
        )
    console.print(table)
    for q in bench.extra["quantize"]:
        console.print(
            f"quantize {q['case']} {q['recipe']}: {q['ms']:.3f} ms, {q['GBps']:.0f} GB/s ({q['pct_of_peak']:.0f}%)"
            + (f"; device {q['device_ms']:.3f} ms ({q['device_pct_of_peak']:.0f}%)" if q["device_ms"] else "")
        )
    for s in bench.extra["grouped_linear_step_summary"]:
        ms, sp = s["ms"], s["speedup_vs_bf16"]
        console.print(
            f"GroupedLinear step {s['case']} {s['mode']} {s['recipe']} x{s['micro_batches']}: "
            f"{ms['median']:.3f} ms [{ms['min']:.3f}, {ms['max']:.3f}] over seeds {s['seeds']}"
            + (f", {sp['median']:.2f}x of bf16 [{sp['min']:.2f}, {sp['max']:.2f}]" if sp else "")
        )
    for s in bench.extra["grouped_linear_step"]:
        if s["status"] != "ok":
            console.print(
                f"GroupedLinear step {s['case']} {s['mode']} {s['recipe']} seed {s['seed']}: {s['reason']}"
            )
    failed = [r for r in bench.rows if r.status == "failed" and not r.impl.startswith(("torch", "dense"))]
    failed += [s for s in bench.extra["grouped_linear_step"] if s["status"] == "failed"]
    result = {
        "meta": meta(
            device, False, cfg, *((step_seeds, micro_batches) if step_cases else ((), ())), name=name
        ),
        "rows": [dataclasses.asdict(r) for r in bench.rows],
        **bench.extra,
        "failed": len(failed),
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        console.print(f"wrote {out}")
    return result


def _finish_check(
    console, bench: Fp8Bench, out: Path | None, step_cases=(), step_seeds=(), name: str = "fp8"
) -> dict:
    """The end of a check-only (CPU) run: each FP8 GEMM's error against the dequantized fp32 product and
    each training step's against the fp64 oracle, with its weight quantizes per optimizer step."""
    from rich.table import Table

    table = Table(title="FP8 under the interpreter, checked (nothing timed)")
    for col in ("case", "op", "impl", "recipe", "relerr", "tol", "check"):
        table.add_column(col)
    for r in bench.rows:
        check = "FAIL: " + r.reason if r.status == "failed" else "pass"
        err = "" if r.relerr is None else f"{r.relerr:.1e}"
        table.add_row(r.case, r.op, r.impl, r.recipe or "", err, f"{r.tol:.0e}", check)
    steps = {(s["mode"], s["seed"], s["recipe"]): s for s in bench.extra["grouped_linear_step"]}
    for (mode, seed, recipe), s in steps.items():
        check = "FAIL: " + s["reason"] if s["status"] == "failed" else "pass"
        err = "" if s["relerr"] is None else f"{s['relerr']:.1e}"
        table.add_row(s["case"], f"step {mode} seed {seed}", s["impl"], recipe, err, f"{s['tol']:.0e}", check)
    console.print(table)
    checked = len(bench.rows) + len(steps)
    failed = [r for r in bench.rows if r.status == "failed"] + [
        s for s in steps.values() if s["status"] == "failed"
    ]
    verdict = "FAIL" if failed else "PASS"
    console.print(f"correctness {verdict}: {checked - len(failed)}/{checked} within tolerance")
    result = {
        "meta": meta(
            bench.device, True, bench.cfg, *((step_seeds, (1,)) if step_cases else ((), ())), name=name
        ),
        "rows": [dataclasses.asdict(r) for r in bench.rows],
        "grouped_linear_step": bench.extra["grouped_linear_step"],
        "failed": len(failed),
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        console.print(f"wrote {out}")
    return result
