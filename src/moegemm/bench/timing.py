"""Timing and memory of one callable.

The headline clock (``paired_stats``): the paired CUDA-event median. Every implementation of a comparison is
warmed, then timed call by call in turns (A, B, C, A, B, C, ...), the L2 flushed before every timed call, CUDA
events around each call with no sync in between; the median per implementation, with its quartiles. Beside it,
never instead of it: ``device_ms`` (the summed GPU time of every kernel in a CUPTI trace of back-to-back calls:
no host gaps, no L2 flush, the one clock torch and JAX share) and ``host_us`` (host time to issue one call).
"wall": median perf_counter of calls that block themselves (JAX's block_until_ready). CPU: perf_counter, not
meaningful for performance, it only proves the path runs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

HEADLINE = "paired CUDA-event median, L2 flushed before every call, implementations taking turns call by call"
DEVICE_CLOCK = (
    "device_ms: summed GPU time of every kernel in a CUPTI trace of back-to-back calls (no L2 flush)"
)
HOST_CLOCK = "host_us: median host time to issue one call, the device drained before each"
SMALL_MS = 1.0  # a call under this is a small problem: it gets at least min_reps timed calls


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    cpu_reps: int = 3
    min_warmup: int = 10  # warm-up calls of each implementation, at least
    min_reps: int = 100  # timed calls of each implementation on a small problem (< SMALL_MS), at least
    min_reps_large: int = 20  # ... on a larger one, where rep_ms buys fewer
    max_reps: int = 500

    @classmethod
    def quick(cls) -> TimingConfig:
        return cls(warmup_ms=10.0, rep_ms=40.0, cpu_reps=1)

    def counts(self, n_impls: int, estimate_ms: float) -> tuple[int, int]:
        """(warm-up calls, timed calls) of each of ``n_impls`` implementations whose calls take ``estimate_ms``
        together: the ms budgets, within the minimums above."""
        per_call = max(estimate_ms, 1e-3) / max(n_impls, 1)
        warmup = max(self.min_warmup, int(self.warmup_ms / per_call))
        floor = self.min_reps if per_call < SMALL_MS else self.min_reps_large
        return warmup, max(floor, min(self.max_reps, int(self.rep_ms / per_call)))

    def meta(self) -> dict:
        """The ``reps`` entry of a result file's meta."""
        return {
            "warmup": self.min_warmup,
            "reps": self.min_reps,
            "reps_large": self.min_reps_large,
            "small_ms": SMALL_MS,
            "max_reps": self.max_reps,
            "warmup_ms": self.warmup_ms,
            "rep_ms": self.rep_ms,
        }


def clock_meta() -> dict:
    """The ``clock`` entry of a result file's meta."""
    return {"headline": HEADLINE, "beside": [DEVICE_CLOCK, HOST_CLOCK]}


def method(device: torch.device, clock: str = "events") -> str:
    if device.type == "cpu":
        return "perf_counter median (CPU: not meaningful)"
    return HEADLINE if clock == "events" else "wall-clock median (blocking)"


def median_ms(fn, device: torch.device, clock: str, cfg: TimingConfig) -> float:
    if device.type == "cuda" and clock == "events":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"))
    if device.type == "cuda":
        return _wall_ms(fn, reps=None, cfg=cfg, sync=torch.cuda.synchronize)
    return _wall_ms(fn, reps=cfg.cpu_reps, cfg=cfg, sync=lambda: None)


def paired_ms(fns: dict, device: torch.device, cfg: TimingConfig, estimate_ms: float) -> dict:
    """Median ms of each callable in ``fns`` on the headline clock (``paired_stats``)."""
    return {name: st["median"] for name, st in paired_stats(fns, device, cfg, estimate_ms).items()}


def paired_stats(fns: dict, device: torch.device, cfg: TimingConfig, estimate_ms: float) -> dict:
    """The headline clock: per callable in ``fns``, {median, q25, q75, reps, warmup} ms, the callables taking
    turns call by call, so a drift of the clock over the run (on the H100, up to 10% between two blocks of
    do_bench of the same kernel, docs/design.md, 'Benchmarks') moves every implementation alike instead of
    whichever was timed in the slow block. Warm-up calls, the L2 flushed before each timed call, CUDA events
    recorded without a sync in between, one sync at the end. ``estimate_ms``: one call of each, summed (sizes
    warm-up and reps, ``TimingConfig.counts``). CPU: perf_counter around each call (not meaningful)."""
    names = list(fns)
    if device.type != "cuda":
        times = {name: [] for name in names}
        for _ in range(max(1, cfg.cpu_reps)):
            for name in names:
                start = time.perf_counter()
                fns[name]()
                times[name].append((time.perf_counter() - start) * 1e3)
        return {name: _stats(t, 0) for name, t in times.items()}
    warmup, reps = cfg.counts(len(names), estimate_ms)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    events = {name: [] for name in names}
    for _ in range(reps):
        for name in names:
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize(device)
    return {name: _stats([s.elapsed_time(e) for s, e in pairs], warmup) for name, pairs in events.items()}


def _stats(times: list[float], warmup: int) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {
        "median": statistics.median(times),
        "q25": q[0],
        "q75": q[2],
        "reps": len(times),
        "warmup": warmup,
    }


def round_ms(fns: dict, device: torch.device) -> float:
    """ms of one call of each callable in ``fns``, back to back, synchronized before and after: the
    ``estimate_ms`` that sizes a ``paired_ms`` run."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for fn in fns.values():
        fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def _wall_ms(fn, *, reps: int | None, cfg: TimingConfig, sync) -> float:
    """Median wall time; reps=None sizes warm-up and reps from the ms budgets like do_bench."""
    if reps is None:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        estimate = max(time.perf_counter() - start, 1e-6) * 1e3
        for _ in range(max(1, int(cfg.warmup_ms / estimate))):
            fn()
        reps = max(3, int(cfg.rep_ms / estimate))
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


DEVICE_TYPE_CUDA = torch.autograd.DeviceType.CUDA


def device_ms(fn, device: torch.device, calls: int = 20) -> float | None:
    """GPU time per call: the summed durations of every kernel, copy and memset the device ran during
    ``calls`` back-to-back calls, divided by ``calls``, read from a CUPTI trace (torch.profiler).

    The one clock every implementation gets, whichever framework or stream launched the work: CUPTI
    records the whole process, XLA's stream included. Gaps between kernels and host dispatch are not
    in it (see :func:`host_us`). None off CUDA.
    """
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: compiled and cached before the trace
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    gpu_ns = sum(
        e.duration_ns() for e in prof.profiler.kineto_results.events() if e.device_type() == DEVICE_TYPE_CUDA
    )
    return gpu_ns / calls / 1e6


def host_us(issue, device: torch.device, calls: int = 50) -> float | None:
    """Host time per call to issue the op without waiting for it (``issue`` must not sync): the median
    over ``calls`` single calls, the device drained before each so a full launch queue never blocks.
    None off CUDA (the interpreter runs the kernel inside the call)."""
    if device.type != "cuda":
        return None
    issue()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        issue()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize(device)
    return statistics.median(times) * 1e6


def call_with_peak_mb(fn, device: torch.device):
    """(output, peak MB allocated above the pre-call level during one call); MB is None off CUDA."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, (torch.cuda.max_memory_allocated(device) - base) / 2**20
