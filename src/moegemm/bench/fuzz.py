"""Performance fuzz (``python -m moegemm.bench --fuzz N --seed S``, ``--fp8`` for the FP8 kernels): moegemm
on shapes nobody tuned for, against torch where torch accepts the shape and against the nearest aligned
shape where it does not (docs/design.md, 'Performance fuzz').

The distribution (``draw``; numpy ``default_rng(seed)``, one stream, so a seed names the same cases on every
machine). Per case, in this order:

- G: log-uniform integer in [1, 256]; M: log-uniform integer in [1, 65536]. A log-uniform integer in
  [lo, hi] is ``floor(exp(U(log lo, log(hi + 1))))``: v has probability log((v + 1) / v) / log((hi + 1) / lo).
- K, then N: a log-uniform integer in [16, 16384], then an alignment class (``CLASSES``): a multiple of 128
  (25%), of 64 but not 128 (15%), of 8 but not 64 (35%), of 2 but not 8 (15%), odd (10%); the value
  moves to the nearest member of its class inside [16, 16384] (a tie goes down).
- the routing split: Dirichlet (50%), balanced (30%) or one-hot (20%) (``shapes.group_sizes``), and a
  per-case seed in [0, 2^31) for the split and the inputs.
- Rejected and drawn again (from the same stream; the case records how many draws it took): a case whose
  bytes, x + w + dy + the largest op's output in the dtype plus that output as the fp32 oracle, exceed
  ``bytes_cap`` (6 GiB) for the case or its twin, or whose 2*M*N*K exceeds ``FLOPS_CAP`` (2e12), so a
  200-case run stays within minutes of GPU time.

The twin of a case (``twin``): the same G, M, split and seed, K and N each moved to the nearest multiple of
16 (at least 16; a tie goes up: 16-byte rows in FP8 and BF16). torch._grouped_mm refuses BF16 rows that are not 16-byte aligned (K or N
not a multiple of 8): there the reference is moegemm on the twin (target: >= 0.6x the twin's TF/s); where
torch accepts, the reference is torch on the same shape (target: >= 0.95x). Twins are timed only where
they are the reference, unless ``--fuzz-twins all``. In the FP8 fuzz, torch._scaled_grouped_mm with the same
recipe on the same quantized operands (fast accumulation; ``fp8.scaled_grouped_mm_peer``) is the peer of fwd
and dgrad where K and N are multiples of 16, and the wgrad is always measured against its twin.

Each (case, op) is checked before it is timed (``harness.measure``: NaN-poisoned outputs, the fp32 oracle;
FP8: the dequantized fp32 product, as ``fp8`` checks), then timed on the headline clock: moegemm and its
peer take turns call by call on CUDA events, the L2 flushed before each call (``timing.paired_stats``,
quick budgets unless ``--fuzz-timing full``; ``*_ms``, ``vs_torch``). That clock includes the host time of a
launch that outlasts its kernel, as a training step pays it. Device time, the CUPTI durations of every
kernel a call ran (``timing.device_ms``), is recorded beside (``*_device_ms``, ``vs_torch_device``).
Every fuzz shape compiles new kernels (N, K and G are constexprs), so ``--workers W`` first runs each
(case, op) once in W spawned processes on the GPU to fill Triton's on-disk cache in parallel.

Without a GPU the fuzz is a correctness job under the interpreter: drawn shapes shrink (``clamp_cpu``) to
G <= 8 and M*K*N, G*K*N <= ``CPU_VOLUME``, each dim keeping its alignment class; nothing is timed; exit 1 on a
failed check.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from moegemm import shapes

G_RANGE = (1, 256)
M_RANGE = (1, 65536)
DIM_RANGE = (16, 16384)
# Alignment classes of K and N with their probabilities: (name, modulus it is a multiple of, modulus it
# must not be a multiple of (0: none), probability).
CLASSES = (
    ("128", 128, 0, 0.25),
    ("64", 64, 128, 0.15),
    ("8", 8, 64, 0.35),
    ("2", 2, 8, 0.15),
    ("odd", 1, 2, 0.10),
)
SPLITS = (("dirichlet", 0.5), ("balanced", 0.3), ("one-hot", 0.2))
BYTES_CAP = 6 * 2**30
FLOPS_CAP = 2e12
TWIN_MULTIPLE = 16  # rows of 16 elements: 16-byte aligned in FP8 and BF16, so both torch peers take the twin
TARGETS = {"vs_torch": 0.95, "vs_aligned": 0.6}
CPU_G = 8
CPU_VOLUME = 200_000  # M*K*N of a CPU (interpreter) case
FP8_RECIPES = ("rowwise", "tensorwise")
WORST = 10


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """One drawn shape: ``case`` (named fuzz-<seed>-<index>), its split and seed, the alignment classes of K and
    N, how many draws the cap rejected before it, and the shape as drawn before a CPU clamp (None: unclamped)."""

    index: int
    case: shapes.Case
    split: str
    seed: int
    k_class: str
    n_class: str
    redraws: int = 0
    drawn: tuple[int, int, int, int] | None = None

    @property
    def twin(self) -> shapes.Case:
        return twin(self.case)


def distribution(bytes_cap: int = BYTES_CAP) -> dict:
    """The parameters of ``draw``, for the JSON's meta."""
    return {
        "G": {"log_uniform_int": G_RANGE},
        "M": {"log_uniform_int": M_RANGE},
        "K, N": {"log_uniform_int": DIM_RANGE, "snapped_to_class": {c[0]: c[3] for c in CLASSES}},
        "split": dict(SPLITS),
        "reject": {"bytes_cap": bytes_cap, "flops_cap": FLOPS_CAP},
        "twin": f"K, N -> nearest multiple of {TWIN_MULTIPLE} (>= {TWIN_MULTIPLE}); same G, M, split, seed",
        "targets": TARGETS,
        "cpu_clamp": {"G": CPU_G, "MKN and GKN": CPU_VOLUME},
    }


def log_uniform_int(rng: np.random.Generator, lo: int, hi: int) -> int:
    return min(hi, int(math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def alignment_class(v: int) -> str:
    """The class of ``CLASSES`` that ``v`` belongs to."""
    for name, mult, not_mult, _ in CLASSES:
        if v % mult == 0 and (not not_mult or v % not_mult):
            return name
    raise AssertionError(v)


def snap(v: int, cls: str, lo: int = DIM_RANGE[0], hi: int = DIM_RANGE[1]) -> int:
    """The member of class ``cls`` in [lo, hi] nearest to ``v`` (a tie goes down)."""
    for d in range(hi - lo + 1):
        for c in (v - d, v + d):
            if lo <= c <= hi and alignment_class(c) == cls:
                return c
    raise ValueError(f"no {cls}-class value in [{lo}, {hi}]")


def twin(case: shapes.Case) -> shapes.Case:
    """The nearest aligned shape: K and N to the nearest multiple of TWIN_MULTIPLE (at least that; a tie goes
    up)."""

    def align(v: int) -> int:
        return max(TWIN_MULTIPLE, (v + TWIN_MULTIPLE // 2) // TWIN_MULTIPLE * TWIN_MULTIPLE)

    return dataclasses.replace(case, name=f"{case.name}-twin", K=align(case.K), N=align(case.N))


def case_bytes(case: shapes.Case, itemsize: int = 2) -> int:
    """x + w + dy + the largest op's output in the dtype, plus that output once more as the fp32 oracle."""
    G, M, K, N = case.G, case.M, case.K, case.N
    largest = max(M * N, M * K, G * N * K)
    return (M * K + G * N * K + M * N + largest) * itemsize + 4 * largest


def accepted(case: shapes.Case, bytes_cap: int = BYTES_CAP) -> bool:
    return (
        max(case_bytes(case), case_bytes(twin(case))) <= bytes_cap
        and 2 * case.M * case.N * case.K <= FLOPS_CAP
    )


def draw(n: int, seed: int, bytes_cap: int = BYTES_CAP) -> list[FuzzCase]:
    """``n`` cases of the distribution in the module docstring, the same for the same seed."""
    rng = np.random.default_rng(seed)
    names, class_p = [c[0] for c in CLASSES], [c[3] for c in CLASSES]
    split_names, split_p = [s[0] for s in SPLITS], [s[1] for s in SPLITS]
    cases = []
    for index in range(n):
        redraws = 0
        while True:
            G = log_uniform_int(rng, *G_RANGE)
            M = log_uniform_int(rng, *M_RANGE)
            k_raw, k_class = log_uniform_int(rng, *DIM_RANGE), str(rng.choice(names, p=class_p))
            n_raw, n_class = log_uniform_int(rng, *DIM_RANGE), str(rng.choice(names, p=class_p))
            split = str(rng.choice(split_names, p=split_p))
            case_seed = int(rng.integers(2**31))
            case = shapes.Case(
                f"fuzz-{seed}-{index}", G, M, snap(k_raw, k_class), snap(n_raw, n_class), ("fuzz",)
            )
            if accepted(case, bytes_cap):
                break
            redraws += 1
        cases.append(FuzzCase(index, case, split, case_seed, k_class, n_class, redraws))
    return cases


def clamp_cpu(fc: FuzzCase) -> FuzzCase:
    """A shape the interpreter runs in seconds: G <= CPU_G; K and N scaled by one factor f and snapped back to
    their class, M = min(M, CPU_VOLUME // (K*N)); f shrinks by 0.7 until M*K*N and G*K*N (the wgrad's
    output) are <= CPU_VOLUME."""
    c = fc.case
    G = min(c.G, CPU_G)
    f = min(1.0, (CPU_VOLUME / max(1, max(c.M, G) * c.K * c.N)) ** (1 / 3))
    while True:
        K = snap(max(DIM_RANGE[0], round(c.K * f)), fc.k_class, hi=max(c.K, 128))
        N = snap(max(DIM_RANGE[0], round(c.N * f)), fc.n_class, hi=max(c.N, 128))
        M = max(1, min(c.M, CPU_VOLUME // (K * N)))
        if max(M, G) * K * N <= CPU_VOLUME or f < 1e-3:
            break
        f *= 0.7
    small = dataclasses.replace(c, G=G, M=M, K=K, N=N)
    return dataclasses.replace(fc, case=small, drawn=(c.G, c.M, c.K, c.N))


# ---------------------------------------------------------------- which reference a case-op gets


def torch_accepts(case: shapes.Case, device: torch.device, dtype: torch.dtype, fp8: bool) -> bool:
    """Whether torch's grouped GEMM takes the shape: BF16 asks the benchmark's own torch._grouped_mm impl
    (``impls_torch._grouped_mm_available``: rows 16-byte aligned); FP8 rows of 1 byte need K and N multiples
    of 16 (``fp8.scaled_grouped_mm_call``)."""
    if fp8:
        return case.K % 16 == 0 and case.N % 16 == 0 and hasattr(torch, "_scaled_grouped_mm")
    from moegemm.bench import impls_torch
    from moegemm.bench.problem import Inputs

    empty = torch.empty(0, dtype=dtype)
    stand_in = SimpleNamespace(case=case, device=device, copies=[Inputs(empty, empty, empty)])
    return impls_torch._grouped_mm_available(stand_in, "fwd") is None


def twin_ops(accepts: bool, ops: list[str], fp8: bool, twins: str) -> list[str]:
    """The ops whose reference is the twin: all where torch refuses (or ``twins == "all"``); FP8 wgrad always
    (torch._scaled_grouped_mm's k-grouped form is not run, see ``fp8``)."""
    if twins == "all" or not accepts:
        return list(ops)
    return [op for op in ops if fp8 and op == "wgrad"]


def _impls() -> dict:
    """The registry with the torch impls in it (moegemm, torch._grouped_mm), without the JAX peers that
    ``registry.load_impls`` would import."""
    from moegemm.bench import impls_torch, registry

    del impls_torch  # imported for its register() calls
    return registry.REGISTRY


# ---------------------------------------------------------------- the compile-warming pass


def _warm_init(fraction: float) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(fraction)


def warm_one(job: dict) -> dict:
    """Runs moegemm once per op on one case (a spawned worker): compiles its kernels into Triton's on-disk
    cache. Best effort: an error (e.g. out of this worker's share of memory) leaves the compile to the
    main process."""
    device = torch.device(job["device"])
    case = shapes.Case(**job["case"])
    start = time.perf_counter()
    try:
        if job["fp8"]:
            from moegemm.bench import fp8

            sizes, gs, x, w, dy = fp8.inputs(case, device, job["seed"], split=job["split"])
            for recipe in job["recipes"]:
                calls = _fp8_calls(recipe, x, w, dy, gs, sizes)
                for op in job["ops"]:
                    calls[op][0]()
        else:
            from moegemm.bench.problem import make_problem

            problem = make_problem(
                case, device=device, dtype=getattr(torch, job["dtype"]), split=job["split"], seed=job["seed"]
            )
            for op in job["ops"]:
                _impls()["moegemm"].prepare(problem, op)()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        error = None
    except Exception as exc:  # noqa: BLE001 - warming is best effort
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return {"case": case.name, "s": time.perf_counter() - start, "error": error}


def warm(jobs: list[dict], workers: int, say: Callable[[str], None]) -> dict:
    """``warm_one`` over ``jobs`` in ``workers`` spawned processes, each held to 0.75 / workers of the GPU's
    memory (a larger case then compiles in the main process instead)."""
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    errors = []
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_warm_init, initargs=(0.75 / workers,)
    ) as pool:
        for i, result in enumerate(pool.map(warm_one, jobs), 1):
            if result["error"]:
                errors.append(f"{result['case']}: {result['error']}")
            if i % max(1, len(jobs) // 10) == 0:
                say(f"warming: {i}/{len(jobs)} cases compiled ({time.perf_counter() - start:.0f} s)")
    return {"workers": workers, "jobs": len(jobs), "s": time.perf_counter() - start, "errors": errors}


# ---------------------------------------------------------------- FP8 helpers (fp8.py's, with a split)


def _fp8_calls(recipe, x, w, dy, gs, sizes) -> dict:
    """op -> (moegemm's call, its dequantized fp32 reference, torch's ``fp8.Peer`` of the same recipe on the
    same quantized operands) for one recipe; fast accumulation for fwd and dgrad (fp8.py's wgrad is promoted
    only)."""
    from moegemm.bench import fp8
    from moegemm.torch import quantize_fp8

    x_q = quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
    w_q = quantize_fp8(w, recipe, transpose=True)
    dy_q = quantize_fp8(dy, recipe, group_sizes=gs, transpose=True)
    return {
        op: (
            *fp8._op_calls(op, op != "wgrad", x_q, w_q, dy_q, gs, sizes),
            fp8.scaled_grouped_mm_peer(op, recipe, x_q, w_q, dy_q, sizes),
        )
        for op in fp8.OPS
    }


# ---------------------------------------------------------------- measuring


@dataclasses.dataclass
class Fuzz:
    """One fuzz run's settings; ``measure_case`` returns a case's records."""

    env: object
    device: torch.device
    dtype: torch.dtype
    ops: list[str]
    tcfg: object
    fp8: bool = False
    twins: str = "refused"
    # The CUPTI device ms of the last _time call, by impl (recorded beside the headline paired medians).
    beside: dict = dataclasses.field(default_factory=dict)

    @property
    def check_only(self) -> bool:
        return self.device.type != "cuda"

    def measure_case(self, fc: FuzzCase) -> list[dict]:
        from moegemm.bench import harness

        accepts = torch_accepts(fc.case, self.device, self.dtype, self.fp8)
        t_ops = twin_ops(accepts, self.ops, self.fp8, self.twins)
        main = self._fp8(fc.case, fc, self.ops, accepts) if self.fp8 else self._bf16(fc.case, fc, self.ops)
        harness._free(self.device)
        twin_results = {}
        if t_ops:
            tw = fc.twin
            side = self._fp8(tw, fc, t_ops, False) if self.fp8 else self._bf16(tw, fc, t_ops, twin=True)
            twin_results = {(r["op"], r.get("recipe")): r for r in side}
            harness._free(self.device)
        records = []
        for r in main:
            t = twin_results.get((r["op"], r.get("recipe")))
            rec = {
                "case": fc.case.name,
                "op": r["op"],
                **({"recipe": r["recipe"]} if self.fp8 else {}),
                "index": fc.index,
                "G": fc.case.G,
                "M": fc.case.M,
                "K": fc.case.K,
                "N": fc.case.N,
                "split": fc.split,
                "seed": fc.seed,
                "k_class": fc.k_class,
                "n_class": fc.n_class,
                "drawn": None if fc.drawn is None else dict(zip("GMKN", fc.drawn)),
                "redraws": fc.redraws,
                "torch_accepts": accepts,
                **{k: v for k, v in r.items() if k not in ("op", "recipe")},
                "twin": {"G": fc.twin.G, "M": fc.twin.M, "K": fc.twin.K, "N": fc.twin.N},
                "twin_status": None if t is None else t["status"],
                "twin_reason": None if t is None else t["reason"],
                "twin_relerr": None if t is None else t["relerr"],
                "twin_ms": None if t is None else t["moegemm_ms"],
                "twin_tflops": None if t is None else t["moegemm_tflops"],
            }
            rec["vs_torch"] = _ratio(rec["torch_ms"], rec["moegemm_ms"])
            rec["vs_torch_device"] = _ratio(rec.get("torch_device_ms"), rec.get("moegemm_device_ms"))
            rec["vs_aligned"] = _ratio(rec["moegemm_tflops"], rec["twin_tflops"])
            key = "vs_torch" if accepts and not (self.fp8 and r["op"] == "wgrad") else "vs_aligned"
            rec["reference"] = {"vs_torch": "torch", "vs_aligned": "aligned twin"}[key]
            rec["target"] = TARGETS[key]
            rec["meets_target"] = None if rec[key] is None else rec[key] >= TARGETS[key]
            records.append(rec)
        return records

    def _bf16(self, case, fc, ops, twin=False) -> list[dict]:
        from moegemm.bench import harness
        from moegemm.bench.problem import make_problem

        problem = make_problem(
            case, device=self.device, dtype=self.dtype, split=fc.split, seed=fc.seed, ops=ops
        )
        registered = _impls()
        impls = [registered["moegemm"]] + ([] if twin else [registered[harness.TORCH_PEER]])
        out = []
        for op in ops:
            reference = harness.lazy(functools.partial(problem.reference, op))
            fns, checked = {}, {}
            for impl in impls:
                rec = harness.measure(
                    problem, op, impl, self.env, tcfg=self.tcfg, reference=reference, check_only=True
                )
                checked[impl.name] = rec
                if rec["status"] == "ok" and not self.check_only:
                    fns[impl.name] = impl.prepare(problem, op)
            ms = self._time(fns)
            m, t = checked["moegemm"], checked.get(harness.TORCH_PEER)
            out.append(
                {
                    "op": op,
                    "status": m["status"],
                    "reason": m["reason"],
                    "relerr": m["relerr"],
                    "tol": m["tol"],
                    "config": m.get("config"),
                    "cache_key": m.get("cache_key"),
                    "kernel": m.get("kernel"),
                    "moegemm_ms": ms.get("moegemm"),
                    "moegemm_device_ms": self.beside.get("moegemm"),
                    "moegemm_tflops": _tflops(case, op, ms.get("moegemm")),
                    "torch_status": None if t is None else t["status"],
                    "torch_reason": None if t is None else t["reason"],
                    "torch_relerr": None if t is None else t["relerr"],
                    "torch_ms": ms.get(harness.TORCH_PEER),
                    "torch_device_ms": self.beside.get(harness.TORCH_PEER),
                    "torch_tflops": _tflops(case, op, ms.get(harness.TORCH_PEER)),
                }
            )
            del reference
        del problem
        return out

    def _fp8(self, case, fc, ops, accepts) -> list[dict]:
        """Each recipe's moegemm call against torch._scaled_grouped_mm with the same recipe on the same
        quantized operands (``fp8.scaled_grouped_mm_peer``; none where torch lacks the recipe): both checked
        before they are timed, every checked call taking turns."""
        from moegemm.bench import fp8

        sizes, gs, x, w, dy = fp8.inputs(case, self.device, fc.seed, split=fc.split)
        calls = {recipe: _fp8_calls(recipe, x, w, dy, gs, sizes) for recipe in FP8_RECIPES}
        out = []
        for op in ops:
            fns, checks, peers = {}, {}, {}
            for recipe in FP8_RECIPES:
                fn, ref, peer = calls[recipe][op]
                checks[recipe] = _check(
                    lambda fn=fn, ref=ref: (fn(), ref()), _out_bytes(case, op), self.device
                )
                if checks[recipe]["status"] == "ok" and not self.check_only:
                    fns[recipe] = fn
                if not accepts or op == "wgrad" or self.check_only:
                    continue
                if peer.skip:
                    peers[recipe] = {"status": "skipped", "reason": peer.skip, "relerr": None}
                    continue
                peers[recipe] = _check(lambda p=peer: (p.fn(), p.ref()), _out_bytes(case, op), self.device)
                if peers[recipe]["status"] == "ok":
                    fns[f"torch-{recipe}"] = peer.fn
            ms = self._time(fns)
            for recipe in FP8_RECIPES:
                c, peer = checks[recipe], peers.get(recipe)
                t_ms = ms.get(f"torch-{recipe}")
                out.append(
                    {
                        "op": op,
                        "recipe": recipe,
                        "fast_accum": op != "wgrad",
                        "status": c["status"],
                        "reason": c["reason"],
                        "relerr": c["relerr"],
                        "tol": fp8.TOLERANCE,
                        "moegemm_ms": ms.get(recipe),
                        "moegemm_device_ms": self.beside.get(recipe),
                        "moegemm_tflops": _tflops(case, op, ms.get(recipe)),
                        "torch_recipe": None if peer is None else recipe,
                        "torch_status": None if peer is None else peer["status"],
                        "torch_reason": None if peer is None else peer["reason"],
                        "torch_relerr": None if peer is None else peer["relerr"],
                        "torch_ms": t_ms,
                        "torch_device_ms": self.beside.get(f"torch-{recipe}"),
                        "torch_tflops": _tflops(case, op, t_ms),
                    }
                )
        del calls, x, w, dy
        return out

    def _time(self, fns: dict) -> dict:
        """The headline ms of each callable (``timing.paired_ms``: the callables taking turns, L2 flushed, CUDA
        events), with the CUPTI device ms (``timing.device_ms``) in ``self.beside``; {} on CPU."""
        from moegemm.bench import timing

        self.beside = {}
        if not fns or self.check_only:
            return {}
        self.beside = {name: timing.device_ms(fn, self.device) for name, fn in fns.items()}
        return timing.paired_ms(fns, self.device, self.tcfg, timing.round_ms(fns, self.device))


def _out_bytes(case: shapes.Case, op: str) -> int:
    """An upper bound on an FP8 op's output bytes (wgrad: fp32 [G, N, K])."""
    return {"fwd": 2 * case.M * case.N, "dgrad": 2 * case.M * case.K, "wgrad": 4 * case.G * case.N * case.K}[
        op
    ]


def _check(run: Callable, nbytes: int, device: torch.device) -> dict:
    """FP8's check (``fp8.relerr`` against the dequantized fp32 product, ``fp8.TOLERANCE``) with moegemm's
    buffers NaN-poisoned (``harness.poisoned_outputs``)."""
    from moegemm.bench import fp8, harness

    tol = fp8.TOLERANCE
    try:
        with harness.poisoned_outputs(device, nbytes):
            out, ref = run()
        err = fp8.relerr(out.float(), ref)
    except Exception as exc:  # noqa: BLE001 - a failure is a result to report
        return {"status": "failed", "reason": harness._reason(exc), "relerr": None}
    if not err <= tol:
        return {"status": "failed", "reason": f"relerr {err:.3e} > tol {tol:.1e}", "relerr": err}
    return {"status": "ok", "reason": None, "relerr": err}


def _tflops(case, op, ms) -> float | None:
    from moegemm.bench import roofline

    return None if ms is None else roofline.tflops(case, op, ms)


def _ratio(a, b) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


# ---------------------------------------------------------------- summary and output


def summarize(records: list[dict], by_recipe: bool = True) -> dict:
    """Per ratio (vs_torch, vs_aligned): count, min, p5, median, geomean, how many fall below the target, and
    the WORST case-ops by name; the checks' counts; per FP8 recipe when the records have one."""
    recipes = sorted({r["recipe"] for r in records if r.get("recipe")})
    if recipes and by_recipe:
        return {recipe: summarize([r for r in records if r["recipe"] == recipe], False) for recipe in recipes}
    out = {
        "case_ops": len(records),
        "passed": sum(r["status"] == "ok" for r in records),
        "failed": [_label(r) + f": {r['reason']}" for r in records if r["status"] != "ok"],
        "twin_failed": [
            _label(r) + f": {r['twin_reason']}" for r in records if r.get("twin_status") == "failed"
        ],
        "torch_failed": [
            _label(r) + f": {r['torch_reason']}" for r in records if r.get("torch_status") == "failed"
        ],
    }
    for key, target in TARGETS.items():
        rs = sorted((r for r in records if r.get(key) is not None), key=lambda r: r[key])
        vals = [r[key] for r in rs]
        out[key] = {
            "target": target,
            "count": len(vals),
            "min": vals[0] if vals else None,
            "p5": float(np.percentile(vals, 5)) if vals else None,
            "median": float(np.median(vals)) if vals else None,
            "geomean": math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None,
            "below_target": sum(v < target for v in vals),
            "worst": [
                {
                    "case": r["case"],
                    "op": r["op"],
                    "shape": {d: r[d] for d in "GMKN"},
                    "classes": f"K {r['k_class']}, N {r['n_class']}",
                    "split": r["split"],
                    key: r[key],
                    "moegemm_ms": r["moegemm_ms"],
                    "reference_ms": r["torch_ms"] if key == "vs_torch" else r["twin_ms"],
                }
                for r in rs[:WORST]
            ],
        }
    return out


def _label(r: dict) -> str:
    return f"{r['case']} {r['op']}" + (f" {r['recipe']}" if r.get("recipe") else "")


def write(path: Path, meta: dict, records: list[dict], summary: dict | None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "summary": summary, "records": records}
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def _summary_lines(summary: dict) -> list[str]:
    if all(isinstance(v, dict) and "vs_torch" in v for v in summary.values()):  # per FP8 recipe
        return [f"{recipe}: {line}" for recipe, s in summary.items() for line in _summary_lines(s)]
    lines = []
    for key, target in TARGETS.items():
        s = summary[key]
        if not s["count"]:
            lines.append(f"{key}: no case-op")
            continue
        lines.append(
            f"{key}: {s['count']} case-ops, min {s['min']:.2f}x, p5 {s['p5']:.2f}x, median {s['median']:.2f}x, "
            f"geomean {s['geomean']:.3f}x; {s['below_target']} below the {target}x target"
        )
    return lines


def _worst_table(summary: dict, title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in (
        "recipe",
        "ratio",
        "case",
        "op",
        "G",
        "M",
        "K",
        "N",
        "classes",
        "split",
        "value",
        "ms",
        "ref ms",
    ):
        t.add_column(col)
    per = summary.items() if "vs_torch" not in summary else [("", summary)]
    for recipe, s in per:
        for key in TARGETS:
            for w in s[key]["worst"]:
                t.add_row(
                    recipe,
                    key,
                    w["case"],
                    w["op"],
                    *(str(w["shape"][d]) for d in "GMKN"),
                    w["classes"],
                    w["split"],
                    f"{w[key]:.2f}x",
                    f"{w['moegemm_ms']:.4f}",
                    f"{w['reference_ms']:.4f}",
                    style="bold red" if w[key] < TARGETS[key] else None,
                )
    return t


def _check_table(records: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("case", "op", "recipe", "G", "M", "K", "N", "classes", "split", "relerr", "check"):
        t.add_column(col)
    for r in records:
        bad = [x for x in (r["status"], r.get("twin_status")) if x not in (None, "ok")]
        why = r["reason"] if r["status"] != "ok" else r.get("twin_reason")
        t.add_row(
            r["case"],
            r["op"],
            r.get("recipe") or "",
            *(str(r[d]) for d in "GMKN"),
            f"K {r['k_class']}, N {r['n_class']}",
            r["split"],
            "-" if r["relerr"] is None else f"{r['relerr']:.1e}",
            "pass" if not bad else f"FAIL: {why}",
            style="bold red" if bad else None,
        )
    return t


# ---------------------------------------------------------------- the CLI's --fuzz


def main(args, argv, env, device: torch.device, console) -> int:
    """``--fuzz N``: draw, warm the compile cache, check and time every case, write the JSON after each case;
    returns the exit status (1 when a check failed)."""

    from moegemm.bench import harness, report, timing

    fp8 = bool(args.fp8)
    dtype = torch.bfloat16 if fp8 else harness.DTYPES[args.dtype]
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    cases = draw(args.fuzz, args.seed, int(args.fuzz_max_gib * 2**30))
    check_only = device.type != "cuda"
    if check_only:
        cases = [clamp_cpu(fc) for fc in cases]
    tcfg = timing.TimingConfig() if args.fuzz_timing == "full" else timing.TimingConfig.quick()
    fuzz = Fuzz(env, device, dtype, ops, tcfg, fp8=fp8, twins=args.fuzz_twins)
    out = args.out or report.default_out(env.device, args.name or ("fuzz-fp8" if fp8 else "fuzz"))
    workers = args.workers if args.workers is not None else min(16, os.cpu_count() or 1)
    meta = {
        **report.run_meta(env, check_only, argv, benchmark="fuzz-fp8" if fp8 else "fuzz", tcfg=tcfg),
        "seed": args.seed,
        "n": args.fuzz,
        "dtype": "fp8" if fp8 else str(dtype).removeprefix("torch."),
        "recipes": list(FP8_RECIPES) if fp8 else None,
        "ops": ops,
        "distribution": distribution(int(args.fuzz_max_gib * 2**30)),
        "redraws": sum(fc.redraws for fc in cases),
        "twins": args.fuzz_twins,
        "timing": None
        if check_only
        else "headline: paired CUDA events, L2 flushed (timing.paired_ms: *_ms, vs_torch); beside: CUPTI device "
        "time (timing.device_ms: *_device_ms, vs_torch_device)",
        "timing_config": None if check_only else dataclasses.asdict(tcfg),
        "warming": None,
        "elapsed_s": None,
        "partial": True,
    }
    started = time.perf_counter()
    if not check_only and workers > 0:
        jobs = []
        for fc in cases:
            accepts = torch_accepts(fc.case, device, dtype, fp8)
            t_ops = twin_ops(accepts, ops, fp8, args.fuzz_twins)
            for case, case_ops in ((fc.case, ops), (fc.twin, t_ops)):
                if case_ops:
                    jobs.append(
                        {
                            "device": str(device),
                            "case": dataclasses.asdict(case),
                            "split": fc.split,
                            "seed": fc.seed,
                            "ops": case_ops,
                            "fp8": fp8,
                            "recipes": list(FP8_RECIPES),
                            "dtype": str(dtype).removeprefix("torch."),
                        }
                    )
        console.print(f"warming the compile cache: {len(jobs)} shapes in {workers} processes")
        meta["warming"] = warm(jobs, workers, console.print)
        console.print(
            f"warmed in {meta['warming']['s']:.0f} s; {len(meta['warming']['errors'])} left to the main process"
        )
    records: list[dict] = []
    for fc in cases:
        c = fc.case
        records.extend(fuzz.measure_case(fc))
        mine = [r for r in records if r["case"] == c.name]
        failed = [_label(r) for r in mine if r["status"] != "ok" or r.get("twin_status") == "failed"]
        console.print(
            f"[{time.perf_counter() - started:5.0f} s] {c.name} G={c.G} M={c.M} K={c.K} ({fc.k_class}) "
            f"N={c.N} ({fc.n_class}) {fc.split}" + (f": failed {', '.join(failed)}" if failed else ""),
            highlight=False,
        )
        # A checkpoint: a run cut short (a time limit) still leaves its finished cases on disk.
        partial = None if check_only else summarize(records)
        write(out, {**meta, "elapsed_s": time.perf_counter() - started}, records, partial)
    meta.update(partial=False, elapsed_s=time.perf_counter() - started)
    failed = [r for r in records if r["status"] != "ok" or r.get("twin_status") == "failed"]
    title = f"fuzz seed {args.seed}, n {args.fuzz} | {env.device} | {meta['dtype']}"
    if check_only:
        console.print(_check_table(records, f"{title} | correctness only"))
        verdict = "FAIL" if failed else "PASS"
        console.print(
            f"correctness {verdict}: {len(records) - len(failed)}/{len(records)} case-ops pass",
            highlight=False,
        )
        for r in failed:
            console.print(f"  failed: {_label(r)}: {r['reason'] or r.get('twin_reason')}", highlight=False)
        meta["correctness"] = {"checked": len(records), "failed": [_label(r) for r in failed]}
        console.print(f"wrote {write(out, meta, records, None)}")
        return 1 if failed else 0
    summary = summarize(records)
    console.print(_worst_table(summary, f"{title}: worst case-ops"))
    for line in _summary_lines(summary):
        console.print(line, highlight=False)
    console.print(f"wrote {write(out, meta, records, summary)}")
    console.print(f"done in {meta['elapsed_s']:.0f} s")
    return 1 if failed else 0
