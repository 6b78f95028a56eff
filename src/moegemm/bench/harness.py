"""Check, then time, one (case, op, impl); and the loop over the suite.

Correctness comes first: each impl's first output (on input copy 0, output buffers NaN-poisoned) is
compared with an fp32 oracle (fp64 on CPU) by relative Frobenius error against the dtype's tolerance
in ``moegemm.testing.REL_TOL``. A failing impl is recorded as failed and not timed. A check-only run
(``RunSpec.check_only``: the CPU main job, where the kernels run under the Triton interpreter and a
time says nothing about a GPU) stops there: its records carry no time, TF/s or roofline floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import platform
import subprocess
from collections.abc import Callable, Iterable

import torch
import triton

from moegemm import shapes, testing
from moegemm._src.torch import ops as _ops
from moegemm.bench import roofline, timing
from moegemm.bench.problem import Problem, make_problem
from moegemm.bench.registry import Impl

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_PEER = "torch._grouped_mm"
RELERR_CHUNK = 2**26  # elements per fp64 chunk in relerr


@dataclasses.dataclass(frozen=True)
class Environment:
    device: str
    device_slug: str
    date: str
    torch: str
    triton: str
    driver: str | None
    cuda: str | None

    @classmethod
    def detect(cls, device: torch.device) -> Environment:
        from moegemm._src import configs

        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"
        return cls(
            device=name,
            device_slug=configs.device_slug(name),
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            torch=torch.__version__,
            triton=triton.__version__,
            driver=_driver_version() if device.type == "cuda" else None,
            cuda=torch.version.cuda,
        )


def _driver_version() -> str | None:
    try:
        cmd = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return (
            subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``moegemm.testing.relerr``; above 2^26 elements the same formula in chunks, to bound fp64 memory."""
    if tuple(out.shape) != tuple(ref.shape):
        return float("inf")
    if out.numel() <= RELERR_CHUNK:
        return testing.relerr(out, ref)
    diff2 = ref2 = 0.0
    for o, r in zip(out.reshape(-1).split(RELERR_CHUNK), ref.reshape(-1).split(RELERR_CHUNK)):
        o, r = o.double(), r.double()
        if torch.isnan(o).any():
            return float("inf")
        diff2 += (o - r).square().sum().item()
        ref2 += r.square().sum().item()
    return (diff2 / ref2) ** 0.5 if ref2 > 0 else diff2**0.5


def _nan_empty(*size, dtype=None, device=None, **kwargs):
    out = torch.empty(*size, dtype=dtype, device=device, **kwargs)
    return out.fill_(float("nan")) if out.is_floating_point() else out


@contextlib.contextmanager
def poisoned_outputs(device: torch.device, nbytes: int):
    """NaN in every buffer moegemm allocates (its ``_ops.empty`` hook), and a freed NaN block of the
    output's size left in the caching allocator, so an impl that skips tiles cannot pass on a stale
    copy of an earlier impl's correct output."""
    if device.type == "cuda":
        torch.empty(nbytes // 4 + 1, dtype=torch.float32, device=device).fill_(float("nan"))
    saved, _ops.empty = _ops.empty, _nan_empty
    try:
        yield
    finally:
        _ops.empty = saved


@contextlib.contextmanager
def config_spy(seen: list[dict]):
    """Wraps ``configs.pick_config`` (whatever it is now, e.g. tune's forced one) and appends each call's
    arguments, returned config and cache key to ``seen``; the launchers look it up through the module. The
    warp-specialized wgrad's pick (``pick_k_ws_config``) is recorded where it routes a launch (op
    "k_grouped_ws")."""
    from moegemm._src import configs

    inner, inner_ws = configs.pick_config, configs.pick_k_ws_config

    def record(op, target, kw, config):
        key = configs.cache_key(
            op, kw.get("dtype", ""), kw.get("G", 0), kw.get("N", 0), kw.get("K", 0), kw.get("M", 0)
        )
        seen.append({"op": op, "target": target, **kw, "config": config, "cache_key": key})

    def spy(op, target, **kw):
        config = inner(op, target, **kw)
        record(op, target, kw, config)
        return config

    def spy_ws(**kw):
        config = inner_ws(**kw)
        if config is not None:
            record("k_grouped_ws", "sm90", kw, config)
        return config

    configs.pick_config, configs.pick_k_ws_config = spy, spy_ws
    try:
        yield seen
    finally:
        configs.pick_config, configs.pick_k_ws_config = inner, inner_ws


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:300]


def base_record(problem: Problem, op: str, impl: str, env: Environment, *, floor: bool = True) -> dict:
    """The record's fields before the check; ``floor=False`` (a check-only run) leaves the roofline out."""
    case = problem.case
    itemsize = problem.copies[0].x.element_size()
    fl = roofline.floor(case, op, itemsize) if floor else None
    return {
        "case": case.name,
        "op": op,
        "impl": impl,
        "status": None,
        "reason": None,
        "backend": None,
        "G": case.G,
        "M": case.M,
        "K": case.K,
        "N": case.N,
        "dtype": str(problem.dtype).removeprefix("torch."),
        "split": problem.split,
        "ms": None,
        "tflops": None,
        "floor_tflops": None if fl is None else fl.tflops,
        "floor_bound": None if fl is None else fl.bound,
        "pct_floor": None,
        "relerr": None,
        "tol": testing.REL_TOL[problem.dtype],
        "peak_mb": None,
        "speedup": {},
        "vs_torch": None,
        "timing": None,
        "copies": len(problem.copies),
        "device": env.device,
        "date": env.date,
        "torch": env.torch,
        "triton": env.triton,
        "driver": env.driver,
    }


def measure(
    problem: Problem,
    op: str,
    impl: Impl,
    env: Environment,
    *,
    tcfg: timing.TimingConfig,
    reference: Callable[[], torch.Tensor],
    keep: dict | None = None,
    check_only: bool = False,
) -> dict:
    """One record: skipped (reason), failed (error or relerr > tol), or ok (checked, then timed; with
    ``check_only``, checked and not timed). ``keep``: where an ok measurement on the events clock leaves
    its callable (impl name -> fn), for the paired timing of ``run``."""
    rec = base_record(problem, op, impl.name, env, floor=not check_only)
    if impl.name == "moegemm":
        from moegemm.bench.impls_torch import backend_label

        rec["backend"] = backend_label(problem.device)
    if op not in impl.ops:
        return {**rec, "status": "skipped", "reason": f"{impl.name} does not implement {op}"}
    why = impl.available(problem, op)
    if why:
        return {**rec, "status": "skipped", "reason": why}
    try:
        fn = impl.prepare(problem, op)
        ref = impl.reference(problem, op) if impl.reference is not None else reference()
        seen: list[dict] = []
        with (
            poisoned_outputs(problem.device, ref.numel() * problem.copies[0].x.element_size()),
            config_spy(seen),
        ):
            out, peak_mb = timing.call_with_peak_mb(fn, problem.device)
        if seen:  # the tile config moegemm's launcher picked (tuned cache hit, model pick or table default)
            rec.update(
                config=dataclasses.asdict(seen[0]["config"]),
                cache_key=seen[0]["cache_key"],
                kernel=seen[0]["op"],
            )
        if not isinstance(out, torch.Tensor):
            out, peak_mb = torch.from_dlpack(out), None  # e.g. a jax.Array: torch's allocator never saw it
        err = relerr(out, ref)
        del out
    except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result to report
        return {**rec, "status": "failed", "reason": _reason(exc)}
    rec.update(relerr=err, peak_mb=peak_mb)
    if not err <= rec["tol"]:
        return {**rec, "status": "failed", "reason": f"relerr {err:.3e} > tol {rec['tol']:.1e}"}
    if check_only:
        return {**rec, "status": "ok"}
    paired = keep is not None and impl.clock == "events"
    try:
        # On the paired clock ``run`` times the kept callables in turns and fills ms; otherwise this clock.
        ms = None if paired else timing.median_ms(fn, problem.device, impl.clock, tcfg)
    except Exception as exc:  # noqa: BLE001
        return {**rec, "status": "failed", "reason": "timing: " + _reason(exc)}
    try:
        dev_ms = timing.device_ms(fn, problem.device)
        issue_us = timing.host_us(getattr(fn, "issue", fn), problem.device)
    except Exception as exc:  # noqa: BLE001
        return {**rec, "status": "failed", "reason": "device/host timing: " + _reason(exc)}
    if paired:
        keep[impl.name] = fn
    rec.update(
        status="ok", device_ms=dev_ms, host_us=issue_us, timing=timing.method(problem.device, impl.clock)
    )
    if ms is not None:
        set_ms(rec, problem.case, op, ms)
    return rec


def set_ms(rec: dict, case: shapes.Case, op: str, ms: float, stats: dict | None = None) -> None:
    """The headline time of an ok record, its TF/s and share of the roofline floor; ``stats``: the paired
    clock's quartiles and counts (``timing.paired_stats``)."""
    tf = roofline.tflops(case, op, ms)
    rec.update(ms=ms, tflops=tf, pct_floor=100 * tf / rec["floor_tflops"])
    if stats is not None:
        rec.update(paired_ms=ms, ms_q25=stats["q25"], ms_q75=stats["q75"], reps=stats["reps"])


def add_speedups(records: list[dict]) -> None:
    """speedup[peer] = peer ms / this ms within each (case, op, seed), on the headline clock (``ms``: the paired
    one on a GPU); vs_torch is the torch._grouped_mm one; device_speedup the same on device time."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["case"], r["op"], r["split"], r.get("seed")), []).append(r)
    for group in groups.values():
        ok = [r for r in group if r["status"] == "ok" and r["ms"] is not None]  # check-only: none timed
        for r in ok:
            r["speedup"] = {p["impl"]: p["ms"] / r["ms"] for p in ok if p is not r}
            r["vs_torch"] = r["speedup"].get(TORCH_PEER)
            if r.get("paired_ms"):  # the same on the paired clock (RunSpec.paired)
                r["paired_speedup"] = {
                    p["impl"]: p["paired_ms"] / r["paired_ms"]
                    for p in ok
                    if p is not r and p.get("paired_ms")
                }
                r["paired_vs_torch"] = r["paired_speedup"].get(TORCH_PEER)
            if r.get("device_ms"):  # the same ratios on the one clock all frameworks share
                r["device_speedup"] = {
                    p["impl"]: p["device_ms"] / r["device_ms"]
                    for p in ok
                    if p is not r and p.get("device_ms")
                }


def lazy(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Computes the oracle on first use only, so an op whose impls all skip costs nothing."""
    box: list[torch.Tensor] = []
    return lambda: box[0] if box else (box.append(fn()) or box[0])


@dataclasses.dataclass
class RunSpec:
    cases: list[shapes.Case]
    ops: list[str]
    impls: list[Impl]
    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    split: str = "dirichlet"
    seed: int = 0
    # Routing seeds: each case is run once per seed (its group sizes and data drawn from it); records carry it.
    seeds: tuple[int, ...] | None = None
    jagged: list[int] | None = None
    timing: timing.TimingConfig = dataclasses.field(default_factory=timing.TimingConfig)
    # The headline clock (timing.paired_stats): the ok implementations of each (case, op) taking turns call by
    # call; ms is its median (also paired_ms, with ms_q25/ms_q75). Off: each implementation on its own clock.
    paired: bool = False
    # Check every output against the oracle and time nothing (the CPU main job: interpreter times are
    # not performance); records then hold no ms, TF/s or roofline floor, and paired is ignored.
    check_only: bool = False

    def all_seeds(self) -> tuple[int, ...]:
        return tuple(self.seeds) if self.seeds else (self.seed,)

    def problem(self, case: shapes.Case, seed: int | None = None) -> Problem:
        """The inputs of ``case`` under this run's device, dtype, split, seed (default ``self.seed``) and ops."""
        return make_problem(
            case,
            device=self.device,
            dtype=self.dtype,
            split=self.split,
            seed=self.seed if seed is None else seed,
            jagged=self.jagged,
            ops=self.ops,
        )


def run(
    spec: RunSpec,
    env: Environment,
    progress: Callable[[str], None] = lambda _: None,
    on_case: Callable[[list[dict]], None] = lambda _: None,
) -> list[dict]:
    """Every (case, op, impl) of ``spec``; ``on_case(records so far)`` after each case."""
    records = []
    for case in spec.cases:
        for seed in spec.all_seeds():
            records.extend(_run_case(spec, env, case, seed, progress))
            _free(spec.device)
        add_speedups(records)
        on_case(records)
    return records


def _run_case(spec: RunSpec, env: Environment, case: shapes.Case, seed: int, progress) -> list[dict]:
    problem = spec.problem(case, seed)
    records = []
    for op in spec.ops:
        reference = lazy(functools.partial(problem.reference, op))
        kept: dict = {}
        mine = []
        for impl in spec.impls:
            progress(f"{problem.case.name} {op} {impl.name}" + (f" seed {seed}" if spec.seeds else ""))
            keep = kept if spec.paired and not spec.check_only else None
            rec = measure(
                problem,
                op,
                impl,
                env,
                tcfg=spec.timing,
                reference=reference,
                keep=keep,
                check_only=spec.check_only,
            )
            mine.append({**rec, "seed": seed})
        if kept:
            progress(f"{problem.case.name} {op} paired")
            estimate = timing.round_ms(kept, spec.device)
            stats = timing.paired_stats(kept, spec.device, spec.timing, estimate)
            for r in mine:
                if r["impl"] in stats:
                    set_ms(r, problem.case, op, stats[r["impl"]]["median"], stats[r["impl"]])
        records.extend(mine)
        del reference, kept
        _free(spec.device)
    return records


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def steps(spec: RunSpec) -> int:
    """Progress steps of ``run``: one per (case, seed, op, impl), and one per (case, seed, op) for the paired
    timing."""
    per_seed = len(spec.ops) * (len(spec.impls) + (spec.paired and not spec.check_only))
    return len(spec.cases) * len(spec.all_seeds()) * per_seed


def iter_ok(records: Iterable[dict], impl: str) -> Iterable[dict]:
    return (r for r in records if r["impl"] == impl and r["status"] == "ok")
