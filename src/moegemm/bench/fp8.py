"""FP8 mode of the benchmark (``python -m moegemm.bench --fp8``): every recipe, fwd/dgrad/wgrad, peers in one run.

Per (case, op, recipe): moegemm's FP8 GEMM alone (operands quantized beforehand), and quantize +
GEMM (the activation quantize that feeds it: x for fwd, dy for dgrad, both with their transposed
copies; wgrad reads those copies and adds none). Peers in the same process: torch._scaled_grouped_mm
(rowwise, fast accumulation; fwd and dgrad: its SM90 k-grouped form takes per-group scales we do not
produce, so wgrad is reported as not run), dense torch._scaled_mm of the same FLOPs (tensorwise,
rowwise, and blockwise 1x128/128x128 through torch.nn.functional.scaled_mm), and moegemm's BF16
kernels. Every output is checked against an fp32 product of the dequantized operands before it is
timed. Times are medians of CUDA-event device time (triton do_bench), the same clock for every impl.
The FP8 roofline floor uses the dense tensorwise rate measured in the same run and 1-byte operands.

Also: the grouped quantize's bandwidth, and a GroupedLinear fwd+bwd step per recipe against BF16
with its peak memory (``--fp8-step-cases``).

Without a GPU (``check_only``) the run only checks moegemm's FP8 GEMMs under the Triton interpreter:
interpreter times are not performance, so nothing is timed and the peers, the quantize bandwidth and
the steps are left out.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
from pathlib import Path

import torch

from moegemm import shapes
from moegemm.bench import roofline, timing
from moegemm.torch import GroupedLinear, k_grouped_mm, m_grouped_mm, quantize_fp8

RECIPES = ("tensorwise", "rowwise", "blockwise")
OPS = ("fwd", "dgrad", "wgrad")
TOLERANCE = 2e-2  # vs an fp32 product of the same dequantized operands: bf16 output and fast accumulation


@dataclasses.dataclass
class Row:
    case: str
    op: str
    impl: str
    recipe: str | None
    ms: float | None = None
    tflops: float | None = None
    quantize_plus_gemm_ms: float | None = None
    relerr: float | None = None
    pct_floor: float | None = None
    note: str | None = None


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


def scaled_grouped_mm_call(op, x, w, dy, sizes):
    """(torch._scaled_grouped_mm's call, its fp32 reference) for fwd or dgrad: rowwise operands, fast
    accumulation. Its FP8 operands need 16-byte rows (K and N multiples of 16); it raises otherwise."""
    offs = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
    a = quantize_fp8(x if op == "fwd" else dy, "rowwise")
    wq = quantize_fp8(w, "rowwise", transpose=op == "dgrad")
    b = wq if op == "fwd" else wq.t()
    a_data, b_data = a.data.contiguous(), b.data.contiguous()

    def fn():
        return torch._scaled_grouped_mm(
            a_data,
            b_data.transpose(-2, -1),
            a.scale,
            b.scale.contiguous(),
            offs=offs,
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )

    return fn, lambda: _grouped_ref(a.dequantize(), b.dequantize(), sizes)


class Fp8Bench:
    def __init__(self, device: torch.device, cfg: timing.TimingConfig, seed: int = 0) -> None:
        self.device, self.cfg, self.seed = device, cfg, seed
        self.check_only = device.type != "cuda"
        self.rows: list[Row] = []
        self.extra: dict = {"quantize": [], "grouped_linear_step": [], "dense_fp8_tflops": {}, "tune": []}

    def time(self, fn) -> float:
        return timing.median_ms(fn, self.device, "events", self.cfg)

    def case(self, case: shapes.Case, ops, recipes) -> None:
        sizes, gs, x, w, dy = inputs(case, self.device, self.seed)
        dense_rate = None if self.check_only else self.dense(case, ops)
        for op in ops:
            if not self.check_only:
                self.bf16(case, op, x, w, dy, gs)
        for recipe in recipes:
            x_q = quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
            w_q = quantize_fp8(w, recipe, transpose=True)
            dy_q = quantize_fp8(dy, recipe, group_sizes=gs, transpose=True)
            if not self.check_only:
                self.quantize_bandwidth(case, recipe, x, gs)
            for op in ops:
                for fast in (False, True) if recipe != "blockwise" and op != "wgrad" else (False,):
                    self.moegemm(case, op, recipe, fast, x, dy, x_q, w_q, dy_q, gs, sizes, dense_rate)
            del x_q, w_q, dy_q
        for op in ops if not self.check_only else ():
            if op != "wgrad":
                self.scaled_grouped_mm(case, op, x, w, dy, sizes)
            else:
                self.rows.append(
                    Row(
                        case.name,
                        op,
                        "torch._scaled_grouped_mm",
                        "rowwise",
                        note="not run: its SM90 k-grouped scaling is not the per-token recipe here",
                    )
                )

    def _floor_pct(self, case, op, ms, dense_rate) -> float | None:
        if dense_rate is None or ms is None:
            return None
        flops = roofline.op_flops(case, op)
        G, M, K, N = case.G, case.M, case.K, case.N
        out_bytes = {"fwd": 2 * M * N, "dgrad": 2 * M * K, "wgrad": 4 * G * N * K}[op]
        in_bytes = {"fwd": M * K + G * N * K, "dgrad": M * N + G * N * K, "wgrad": M * (N + K)}[op]
        floor_s = max(flops / (dense_rate * 1e12), (in_bytes + out_bytes) / roofline.PEAK_BYTES_PER_S)
        return 100 * floor_s / (ms / 1e3)

    def moegemm(self, case, op, recipe, fast, x, dy, x_q, w_q, dy_q, gs, sizes, dense_rate) -> None:
        impl = f"moegemm-fp8{'-fast' if fast else ''}"
        fn, ref = _op_calls(op, fast, x_q, w_q, dy_q, gs, sizes)
        if op == "wgrad":
            qfn = None
        else:
            a, b = (x, w_q) if op == "fwd" else (dy, w_q.t())
            qfn = lambda: m_grouped_mm(  # noqa: E731
                quantize_fp8(a, recipe, group_sizes=gs, transpose=True), b, gs, fast_accum=fast
            )
        row = Row(case.name, op, impl, recipe)
        err = relerr(fn().float(), ref())
        row.relerr = err
        if not err <= TOLERANCE:
            row.note = f"wrong: relerr {err:.2e}"
            self.rows.append(row)
            return
        if self.check_only:
            self.rows.append(row)
            return
        row.ms = self.time(fn)
        row.tflops = roofline.op_flops(case, op) / row.ms / 1e9
        row.quantize_plus_gemm_ms = row.ms if qfn is None else self.time(qfn)
        row.pct_floor = self._floor_pct(case, op, row.ms, dense_rate)
        self.rows.append(row)

    def bf16(self, case, op, x, w, dy, gs) -> None:
        fn = {
            "fwd": lambda: m_grouped_mm(x, w.mT, gs),
            "dgrad": lambda: m_grouped_mm(dy, w, gs),
            "wgrad": lambda: k_grouped_mm(dy, x, gs),
        }[op]
        ms = self.time(fn)
        self.rows.append(Row(case.name, op, "moegemm-bf16", None, ms, roofline.op_flops(case, op) / ms / 1e9))

    def scaled_grouped_mm(self, case, op, x, w, dy, sizes) -> None:
        row = Row(case.name, op, "torch._scaled_grouped_mm", "rowwise")
        try:
            fn, ref = scaled_grouped_mm_call(op, x, w, dy, sizes)
            row.relerr = relerr(fn().float(), ref())
            row.ms = self.time(fn)
            row.tflops = roofline.op_flops(case, op) / row.ms / 1e9
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            row.note = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
        self.rows.append(row)

    def dense(self, case, ops) -> float | None:
        """Dense FP8 of the fwd shape [M, K] x [K, N]; returns the tensorwise rate (the floor's compute rate)."""
        M, K, N = case.M, case.K, case.N
        a = torch.randn(M, K, device=self.device).to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device=self.device).to(torch.float8_e4m3fn)
        flops = 2 * M * K * N
        rates = {}
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
        for recipe, fn in calls.items():
            row = Row(case.name, "fwd", f"dense-scaled_mm-{recipe}", recipe)
            try:
                row.ms = self.time(fn)
                row.tflops = flops / row.ms / 1e9
                rates[recipe] = row.tflops
            except Exception as exc:  # noqa: BLE001
                row.note = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
            self.rows.append(row)
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
        ms = self.time(call)
        # The kernels' own time (CUPTI): on small problems the back-to-back wall clock above is the
        # host's issue time of the call's two or three launches, not the device's.
        dev_ms = timing.device_ms(call, x.device)
        nbytes = 2 * M * K + 2 * M * K  # read bf16, write data and data_t (scales are < 1%)
        self.extra["quantize"].append(
            {
                "case": case.name,
                "recipe": recipe,
                "ms": ms,
                "GBps": nbytes / ms / 1e6,
                "pct_of_peak": 100 * nbytes / (ms / 1e3) / roofline.PEAK_BYTES_PER_S,
                "device_ms": dev_ms,
                "device_pct_of_peak": None
                if dev_ms is None
                else 100 * nbytes / (dev_ms / 1e3) / roofline.PEAK_BYTES_PER_S,
            }
        )

    def grouped_linear_step(self, case: shapes.Case) -> None:
        """fwd + bwd of one GroupedLinear (with bias), BF16 vs each recipe, in both weight-gradient modes:
        "main_grad" (fuse_wgrad_accumulation into an fp32 main_grad, Megatron) and "grad" (weight.grad in the
        weight's dtype, set to None before each step as ``zero_grad(set_to_none=True)`` does: a .grad left to
        accumulate across steps adds an element-wise add per parameter to both sides). The steps of one mode
        take turns call by call (``timing.paired_ms``): timed one after another, BF16's step drifted 8.9 ->
        10.3 ms over three passes on the H100 while FP8's moved 5% (journal 41)."""
        G, M, K, N = case.G, case.M, case.K, case.N
        sizes = torch.tensor(shapes.group_sizes(M, G, seed=self.seed), dtype=torch.int32, device=self.device)
        x = torch.randn(M, K, device=self.device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device=self.device, dtype=torch.bfloat16)
        for mode in ("main_grad", "grad"):
            steps, peaks = {}, {}
            for recipe in ("bf16", *RECIPES):
                module = GroupedLinear(
                    G,
                    K,
                    N,
                    dtype=torch.bfloat16,
                    device=self.device,
                    fuse_wgrad_accumulation=mode == "main_grad",
                    fp8_recipe=None if recipe == "bf16" else recipe,
                )
                if mode == "main_grad":
                    module.weight.main_grad = torch.zeros(G, N, K, device=self.device)

                def step(module=module):
                    x.grad = module.weight.grad = module.bias.grad = None
                    module(x, sizes).backward(dy)

                def step_produced_input(module=module):
                    # The layer's input made inside the step (as a dispatched activation is), so only what
                    # autograd saves keeps it alive: BF16 saves it, FP8 saves its transposed FP8 copy.
                    x.grad = module.weight.grad = module.bias.grad = None
                    module(x * 1.0, sizes).backward(dy)

                step()
                _, peak = timing.call_with_peak_mb(step, self.device)
                step_produced_input()
                _, peak_produced = timing.call_with_peak_mb(step_produced_input, self.device)
                steps[recipe], peaks[recipe] = step, (peak, peak_produced)
            estimate = timing.round_ms(steps, self.device)
            cfg = dataclasses.replace(self.cfg, rep_ms=max(self.cfg.rep_ms, 10 * estimate))
            times = timing.paired_ms(steps, self.device, cfg, estimate)
            # The paired clock is wall time between events: where the host issues a step more slowly than the
            # device runs it (Qwen3-sized steps), it times the host. The device's own time (CUPTI) beside it.
            device = {recipe: timing.device_ms(step, self.device) for recipe, step in steps.items()}
            for recipe, ms in times.items():
                self.extra["grouped_linear_step"].append(
                    {
                        "case": case.name,
                        "mode": mode,
                        "recipe": recipe,
                        "ms": ms,
                        "clock": "paired",
                        "speedup_vs_bf16": times["bf16"] / ms,
                        "device_ms": device[recipe],
                        "device_speedup_vs_bf16": device["bf16"] / device[recipe],
                        "peak_mb": peaks[recipe][0],
                        "peak_mb_produced_input": peaks[recipe][1],
                    }
                )
            del steps
            torch.cuda.empty_cache()


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
) -> dict:
    """The FP8 benchmark; with ``tune_dir``, first times every candidate config per (case, op,
    recipe, accumulation mode) and merges the winners into ``tune_dir``/<device>.json (loaded by
    ``moegemm._src.configs`` when it is the committed directory), then benchmarks with them."""
    from rich.console import Console
    from rich.table import Table

    bench = Fp8Bench(device, cfg)
    console = Console(width=180)
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
    for case in step_cases if not bench.check_only else ():
        bench.grouped_linear_step(case)
    if bench.check_only:
        return _finish_check(console, bench, out)
    table = Table(title="FP8 grouped GEMMs (device time, median)")
    for col in ("case", "op", "impl", "recipe", "ms", "TF/s", "q+gemm ms", "% floor", "relerr", "note"):
        table.add_column(col)
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for r in bench.rows:
        table.add_row(
            r.case,
            r.op,
            r.impl,
            r.recipe or "",
            fmt(r.ms, ".3f"),
            fmt(r.tflops, ".0f"),
            fmt(r.quantize_plus_gemm_ms, ".3f"),
            fmt(r.pct_floor, ".0f"),
            fmt(r.relerr, ".1e"),
            r.note or "",
        )
    console.print(table)
    for q in bench.extra["quantize"]:
        console.print(
            f"quantize {q['case']} {q['recipe']}: {q['ms']:.3f} ms, {q['GBps']:.0f} GB/s ({q['pct_of_peak']:.0f}%)"
            + (f"; device {q['device_ms']:.3f} ms ({q['device_pct_of_peak']:.0f}%)" if q["device_ms"] else "")
        )
    for s in bench.extra["grouped_linear_step"]:
        console.print(
            f"GroupedLinear step {s['case']} {s['mode']} {s['recipe']}: {s['ms']:.3f} ms, {s['speedup_vs_bf16']:.2f}x "
            f"of bf16 (device time {s['device_ms']:.3f} ms, {s['device_speedup_vs_bf16']:.2f}x), peak "
            f"{s['peak_mb']} MB ({s['peak_mb_produced_input']} MB with the input made in the step)"
        )
    result = {
        "meta": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "timing": "cuda-events median (triton do_bench)",
            "tolerance": TOLERANCE,
        },
        "rows": [dataclasses.asdict(r) for r in bench.rows],
        **bench.extra,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        console.print(f"wrote {out}")
    return result


def _finish_check(console, bench: Fp8Bench, out: Path | None) -> dict:
    """The end of a check-only (CPU) run: each FP8 GEMM's error against the dequantized fp32 product."""
    from rich.table import Table

    from moegemm.bench import report

    table = Table(
        title=f"FP8 grouped GEMMs under the interpreter, checked (tolerance {TOLERANCE:.0e}; nothing timed)"
    )
    for col in ("case", "op", "impl", "recipe", "relerr", "check"):
        table.add_column(col)
    for r in bench.rows:
        check = "FAIL: " + r.note if r.note else "pass"
        table.add_row(r.case, r.op, r.impl, r.recipe or "", f"{r.relerr:.1e}", check)
    console.print(table)
    failed = [r for r in bench.rows if r.note]
    verdict = "FAIL" if failed else "PASS"
    console.print(
        f"correctness {verdict}: {len(bench.rows) - len(failed)}/{len(bench.rows)} within tolerance"
    )
    result = {
        "meta": {
            "mode": "correctness",
            "performance": False,
            "notice": report.CPU_NOTICE,
            "device": platform.processor() or platform.machine(),
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "tolerance": TOLERANCE,
        },
        "rows": [dataclasses.asdict(r) for r in bench.rows],
        "failed": len(failed),
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        console.print(f"wrote {out}")
    return result
