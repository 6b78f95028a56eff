"""Timing and memory of one callable.

GPU ("events"): ``triton.testing.do_bench`` (CUDA events on the current stream, warm-up runs
excluded, the L2 flushed before every run, median). "wall": median perf_counter of calls that block
themselves (JAX's block_until_ready). CPU: median of a few perf_counter runs; not meaningful for
performance, it only proves the path runs. Beside that ``ms``, every implementation also gets
``device_ms`` (GPU time from a CUPTI trace, the same clock for torch and JAX) and ``host_us`` (host
time to issue one call without waiting for it).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    cpu_reps: int = 3

    @classmethod
    def quick(cls) -> TimingConfig:
        return cls(warmup_ms=10.0, rep_ms=40.0, cpu_reps=1)


def method(device: torch.device, clock: str = "events") -> str:
    if device.type == "cpu":
        return "perf_counter median (CPU: not meaningful)"
    return "cuda-events median (triton do_bench)" if clock == "events" else "wall-clock median (blocking)"


def median_ms(fn, device: torch.device, clock: str, cfg: TimingConfig) -> float:
    if device.type == "cuda" and clock == "events":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"))
    if device.type == "cuda":
        return _wall_ms(fn, reps=None, cfg=cfg, sync=torch.cuda.synchronize)
    return _wall_ms(fn, reps=cfg.cpu_reps, cfg=cfg, sync=lambda: None)


def paired_ms(fns: dict, device: torch.device, cfg: TimingConfig, estimate_ms: float) -> dict:
    """Median ms of each callable in ``fns``, the callables taking turns call by call: a drift of the
    clock over the run (on the H100, up to 10% between two blocks of do_bench of the same kernel,
    docs/design.md, 'Benchmarks') then moves every implementation alike instead of whichever was timed in the
    slow block. As do_bench: warm-up calls, the L2 flushed before each timed call, CUDA events recorded
    without a sync in between, one sync at the end. ``estimate_ms``: one call of each, summed (sizes the reps
    to ``cfg.rep_ms`` per implementation). CPU: perf_counter around each call (not meaningful)."""
    names = list(fns)
    if device.type != "cuda":
        times = {name: [] for name in names}
        for _ in range(max(1, cfg.cpu_reps)):
            for name in names:
                start = time.perf_counter()
                fns[name]()
                times[name].append((time.perf_counter() - start) * 1e3)
        return {name: statistics.median(t) for name, t in times.items()}
    calls_per_ms = len(fns) / max(estimate_ms, 1e-3)  # calls of one implementation per ms of budget
    reps = max(10, min(500, int(cfg.rep_ms * calls_per_ms)))
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    for _ in range(max(1, int(cfg.warmup_ms * calls_per_ms) // len(fns))):
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
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


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
