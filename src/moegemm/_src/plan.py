"""The launch planner: which kernel runs a grouped GEMM, on which schedule, with which tile config.

``plan(problem, target, capabilities, constraints=None) -> Plan`` is the one place a launch is decided,
for both front ends and every dtype. It imports neither torch nor jax: a front end describes the launch
(:class:`Problem`: the static facts of the GEMM and its operands' layout), the device (:class:`Target`) and
what its launcher can pass (:class:`Capabilities`), and gets back a frozen :class:`Plan` with the kernel
family, the schedule (:class:`Schedule`), the tile config and the kernel's launch description (grid and
meta-parameters). Front ends memoize plans per static key, so the per-call cost is their own cache
lookup (``moegemm._src.torch.launch`` keys its plans on the spec its direct launches key on).

Rules, in the order ``plan`` applies them (docs/design.md, 'Launch plans', says why each pays):

- Kernel family. BF16/FP16/FP32 m-grouped (fwd, dgrad) and k-grouped (wgrad) run the Triton kernels
  (``kernels/m_grouped.py``, ``kernels/k_grouped.py``). A 2-byte wgrad that takes both TMA paths below, with
  out contiguous in the operands' dtype and no column sums, runs the warp-specialized Gluon wgrad
  (``kernels/k_grouped_ws.py``) on sm90 where ``configs.pick_k_ws_config`` routes it (groups of more than
  ``configs.K_WS_MIN_ROWS`` rows on average). FP8 runs the Triton FP8 kernels, or, for promoted accumulation
  on sm90 with a layout 16-byte cp.async reads, the warp-specialized FP8 kernels where
  ``configs.pick_fp8_ws_config`` routes them. Gluon kernels need ``Capabilities.gluon`` (PyTorch only).
- TMA store (2-byte out through a descriptor the kernel makes in Triton's global scratch) and TMA loads
  (operands through descriptors the kernel makes): on sm90 and the interpreter, where the launcher has
  global scratch (``Capabilities.global_scratch``: PyTorch's allocator, JAX's GPU executor), where the
  operands' layout takes a descriptor (``Problem.tma_store_layout`` / ``tma_load_layout``), and on
  launches of at least ``TMA_STORE_MIN_FLOPS`` / ``TMA_LOAD_MIN_FLOPS`` (``launch_work``): the scratch and the
  descriptors cost host time that only a longer launch hides. The kernels' launch descriptions then keep
  what their shared memory and tail rules allow (``m_grouped.tma_store_fits``, ``tma_load_fits``).
- m-grouped schedule: mixed tile heights (``mixed_m``) and the split tail round (``tail_split``) where the
  rows are 16-byte aligned (``Problem.rows_aligned``), the flat loop (``flat``); their K limits and
  shared-memory fits are the kernel's (``m_grouped.MIXED_M_MAX_K``, ``FLAT_MAX_K``,
  ``FLAT_WHOLE_TILES_MAX_K``, ``half_tiles_fit``, ``flat_fits``), applied by ``MGroupedLaunch.make``, which
  only this module calls.
- Split reduction (launchers with a workspace): m-grouped, where even one group holding every row leaves too
  few tiles to fill the GPU and the reduction is long (``_split_k``); k-grouped, where its tiles leave the GPU
  idle and the groups' rows are many (``_split_r``). It wins over the warp-specialized wgrad there.
- Tile config: ``configs.pick_config`` (tuned cache, cost model, table default), without the TMA-only
  candidates where the launch takes no TMA loads; with a group offset (expert parallelism) the BF16 config
  is picked for the rows the local groups can expect.

Tests and benchmarks steer the plan through :class:`Constraints` (``constrain(...)``), never by patching
module globals. Environment switches are read here, once, at import (``SWITCHES``):

================================  =======  ==================================================================
Switch                            Default  Purpose
================================  =======  ==================================================================
``MOEGEMM_CHECK``                 ``0``    ``1``: the PyTorch ops sync and validate group sizes (and FP8
                                           inputs), raising with the values, as ``check=True`` does.
``MOEGEMM_DIRECT_LAUNCH``         ``1``    ``0``: every PyTorch launch goes through ``JITFunction.run``
                                           instead of the bound launcher (to measure the direct path, or for
                                           a tool that wraps ``run``; launch hooks take that path anyway).
================================  =======  ==================================================================

The experiment switches ``MOEGEMM_TMA_STORE``, ``MOEGEMM_TMA_LOAD``, ``MOEGEMM_MIXED_M``,
``MOEGEMM_TAIL_SPLIT``, ``MOEGEMM_M_FLAT``, ``MOEGEMM_WS_WGRAD`` and ``MOEGEMM_FP8_WS`` are gone: each mode is
on where the rules above say, and ``Constraints`` turns it off for a test or an A/B benchmark.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from moegemm._src import configs, fp8
from moegemm._src.kernels import k_grouped_fp8_ws, k_grouped_ws, m_grouped_fp8_ws
from moegemm._src.kernels.k_grouped import KGroupedLaunch
from moegemm._src.kernels.k_grouped_fp8 import KGroupedFp8Launch
from moegemm._src.kernels.m_grouped import MGroupedLaunch
from moegemm._src.kernels.m_grouped_fp8 import MGroupedFp8Launch
from moegemm._src.kernels.schedule import sm90_shared_fits

# ---------------------------------------------------------------- environment switches


@dataclasses.dataclass(frozen=True)
class Switches:
    """The environment switches (the module docstring's table), read once at import: ``os.environ.get``
    costs ~3 us, which a per-call read would add to every launch."""

    check: bool = False
    direct_launch: bool = True

    @staticmethod
    def from_env(env=os.environ) -> Switches:
        return Switches(
            check=env.get("MOEGEMM_CHECK", "0") not in ("", "0"),
            direct_launch=env.get("MOEGEMM_DIRECT_LAUNCH", "1") != "0",
        )


SWITCHES = Switches.from_env()

# ---------------------------------------------------------------- thresholds

# BF16/FP16 output tiles go through a TMA descriptor (the bulk copy runs under the next tile's main loop) on
# launches of at least TMA_STORE_MIN_FLOPS (2 M N K): on the H100 that gained 0.6% geomean device time over
# the 57 suite and held-out case-ops (three A/B runs; +7% on one case, -9% on another). The descriptor lives in
# Triton's global scratch, whose per-call allocation costs host time (+0.4 us a launch over TMA loads alone,
# m-grouped; +4.4 us over the register store, k-grouped), which only a longer launch hides
# (docs/design.md, 'TMA stores').
TMA_STORE_MIN_FLOPS = 5e10
# TMA loads (bf16/fp16, sm90): the m-grouped kernel reads x and w through two descriptors it makes once per
# program, the flat k-grouped loop reads a and b through descriptors it makes per group (configs with
# tma_load): no address or mask arithmetic per step. The scratch costs host time (wgrad 32.3 vs 24.4 us, fwd
# 20.2 vs 15.5 us on the H100), so only launches of at least TMA_LOAD_MIN_FLOPS take them; below, the same
# config loads through cp.async. Measured gain of the m-grouped loads, paired: +0.4-0.6% geomean over 34
# fwd/dgrad case-ops, -1.4% to +6% per case (docs/design.md, 'TMA loads').
TMA_LOAD_MIN_FLOPS = 5e10
# Both gates weigh a launch's work, not only its FLOPs: max(2 M N K, BYTES_TO_FLOPS x the bytes of x, w and
# out), so a store-bound launch (a short reduction writing a large out) takes the TMA store too. The H100 runs
# about 240 bf16 FLOPs in the time it moves one byte of HBM (660 TF/s dense, 2.8 TB/s measured;
# docs/design.md, 'TMA stores').
BYTES_TO_FLOPS = 240


def launch_work(M: int, N: int, K: int, G: int, itemsize: int = 2) -> float:
    """The work the TMA gates weigh (above): both ops move x/a [M, K], dy/b [M, N] and w/out [G, K, N]."""
    return max(2 * M * N * K, BYTES_TO_FLOPS * itemsize * (M * K + M * N + G * K * N))


# ---------------------------------------------------------------- inputs

M_GROUPED, K_GROUPED = "m_grouped", "k_grouped"  # Problem.op: fwd/dgrad, wgrad


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static facts of one grouped GEMM launch.

    op "m_grouped": ``for g: out[rows(g)] = x[rows(g)] @ w[g]``, x [M, K], w [G, K, N], out [M, N].
    op "k_grouped": ``for g: out[g] (+)= a[rows(g)]^T @ b[rows(g)]``, a [M, K], b [M, N], out [G, K, N].
    dtype: the operands' dtype name ("bfloat16", "float16", "float32"; FP8: the FP8 data's, such as
    "float8_e4m3fn", which ``fp8.config_dtype`` turns into the configs' key). out_itemsize: bytes per element
    of out. g_total: expert parallelism, G of g_total groups from a device-side offset (None: no offset).
    max_stride: the largest row/column stride (None: contiguous).
    Layout facts the front end checked on its tensors: tma_store_layout (out takes a descriptor: N
    contiguous, 16-byte aligned row strides and base), tma_load_layout (the operands do, as the launchers
    say), rows_aligned (x's, w's and out's rows 16-byte aligned, unit inner strides: half-high tiles),
    ws_layout (the warp-specialized kernels read and write this layout), row_strides and out_span (what the
    warp-specialized kernels' ``supported_problem`` checks). FP8: recipe ("tensorwise", "rowwise",
    "blockwise"; None: not FP8) and fast_accum. load_pad: the front end staged the operands into rows
    zero-padded to a multiple of this many elements (``stage_rows``; 1: none). The expert block's options
    (docs/design.md, 'Fused expert block'): gather names the operands read through a row index ("x"; "a", "b"),
    epilogue the m-grouped epilogue ("swiglu", "swiglu_bwd"; "" none). fill_tail: False leaves the m-grouped out's
    rows past the last group untouched (docs/design.md, 'Expert parallelism').
    """

    op: str
    M: int
    N: int
    K: int
    G: int
    dtype: str
    out_itemsize: int = 2
    g_total: int | None = None
    max_stride: int | None = None
    w_k_contiguous: bool = False
    a_k_contiguous: bool = True
    has_bias: bool = False
    accumulate: bool = False
    a_colsum: bool = False
    rows_aligned: bool = False
    tma_store_layout: bool = False
    tma_load_layout: bool = False
    ws_layout: bool = False
    row_strides: tuple[int, ...] = ()
    out_span: int = 0
    recipe: str | None = None
    fast_accum: bool = False
    load_pad: int = 1
    gather: tuple[str, ...] = ()
    epilogue: str = ""
    fill_tail: bool = True

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K


class Target(NamedTuple):
    """Where a launch runs: ``name`` the configs.TABLE target ("sm90", "cuda" for other GPUs, "interpret"),
    ``device_name`` the tuned cache's device, ``programs`` the persistent grid's cap (the SM count)."""

    name: str
    device_name: str
    programs: int


INTERPRET = Target("interpret", "", 3)  # odd and small, so the persistent stride loop is exercised


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a front end's launcher can pass to a kernel. host_descriptors: TensorDescriptors made on the
    host (the warp-specialized wgrad's out); global_scratch: Triton's allocator for descriptors a kernel
    makes on the device (TMA loads and stores); gluon: Gluon kernels launch (this Triton has Gluon's Hopper
    API); workspace: the split-K schedule (``split_k``). JAX's GPU executor has scratch and Gluon, the
    interpreter's neither; no JAX launcher has host descriptors."""

    host_descriptors: bool = False
    global_scratch: bool = False
    gluon: bool = False
    workspace: bool = False  # allocates a split-K launch's fp32 partials and runs the reduction after it


JAX = Capabilities()  # the interpreter's executor (its launches have no scratch allocator)
# The GPU executor (``moegemm._src.jax.gpu``) passes Triton's global scratch; no host descriptors (a JAX array has
# no address while the launch is built), no workspace.
JAX_GPU = Capabilities(global_scratch=True, gluon=k_grouped_fp8_ws.supported())


@dataclasses.dataclass(frozen=True)
class Constraints:
    """Overrides of the plan's choices, for tests and A/B benchmarks (as triton_kernels'
    ``update_opt_flags_constraints``). None keeps the rule; False turns a mode off (True keeps it where it
    applies). The min-flops fields replace TMA_STORE_MIN_FLOPS / TMA_LOAD_MIN_FLOPS."""

    tma_store: bool | None = None
    tma_load: bool | None = None
    tma_store_min_flops: float | None = None
    tma_load_min_flops: float | None = None
    mixed_m: bool | None = None
    tail_split: bool | None = None
    flat: bool | None = None  # the m-grouped flat loop
    ws_wgrad: bool | None = None  # the warp-specialized BF16/FP16 wgrad
    fp8_ws: bool | None = None  # the warp-specialized FP8 kernels
    quantize_pair: bool | None = None  # the one-read FP8 quantize (data and data_t from one read of x)
    stage_rows: bool | None = None  # copy operands whose rows are not 16-byte aligned into padded ones
    split_k: bool | int | None = None  # the split reduction (both ops); an int > 1 forces that many slices
    # The expert block's wgrads read x's and dy's rows by token index in the kernel (True) or from gathered
    # copies through the plain wgrad (False; ``wgrad_gathers_rows``)
    wgrad_gather: bool | None = None
    # The FP8 expert block's gathered SwiGLU launches split into a row copy, the plain launch and the SwiGLU row
    # kernel (True) or fused (False; ``fp8_epilogue_split``)
    fp8_epilogue_split: bool | None = None
    # A tile config in place of the pick: config(op, problem, target, picked) -> the config to use, op the
    # pick's table ("m_grouped", "k_grouped", "k_grouped_ws", "m_grouped_fp8_ws", "k_grouped_fp8_ws", or an
    # FP8 Triton table such as "m_grouped_fp8_fast"); for a warp-specialized op, picked None (and a None
    # returned) means the Triton kernel.
    config: Callable[[str, Problem, Target, Any], Any] | None = None

    def on(self, field: str) -> bool:
        return getattr(self, field) is not False


NONE = Constraints()

# ---------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The schedule options a plan took (after the kernel's own fits): TMA loads and store, mixed tile
    heights, split tail round, flat loop (and the flat loop for whole-tile groups), the out descriptor
    made on the host (the warp-specialized wgrad)."""

    tma_load: bool = False
    tma_store: bool = False
    mixed_m: bool = False
    tail_split: bool = False
    flat: bool = False
    flat_whole_tiles: bool = False
    host_out_descriptor: bool = False
    split_k: int = 1


# Plan.kernel values.
KERNELS = (
    "m_grouped",  # kernels/m_grouped.py, Triton
    "k_grouped",  # kernels/k_grouped.py, Triton
    "k_grouped_ws",  # kernels/k_grouped_ws.py, Gluon, warp-specialized (sm90)
    "m_grouped_fp8",  # kernels/m_grouped_fp8.py, Triton
    "k_grouped_fp8",  # kernels/k_grouped_fp8.py, Triton
    "m_grouped_fp8_ws",  # kernels/m_grouped_fp8_ws.py, Gluon (sm90)
    "k_grouped_fp8_ws",  # kernels/k_grouped_fp8_ws.py, Gluon (sm90)
)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """One launch, decided: the kernel family (one of KERNELS), its schedule, its tile config and the
    kernel's launch description (``grid``, ``meta``: what ``kernel[grid](..., **meta)`` takes). scratch:
    the kernel makes descriptors in Triton's global scratch (the launcher installs an allocator)."""

    kernel: str
    schedule: Schedule
    config: Any
    launch: Any

    @property
    def grid(self) -> tuple[int, ...]:
        return self.launch.grid

    @property
    def meta(self) -> dict:
        return self.launch.meta

    @property
    def scratch(self) -> bool:
        return self.schedule.tma_load or self.schedule.tma_store


def plan(
    problem: Problem, target: Target, capabilities: Capabilities, constraints: Constraints | None = None
) -> Plan:
    """The launch of ``problem`` on ``target`` through a launcher with ``capabilities`` (module docstring).
    ``constraints`` None: the active ones (``constrain``). Not memoized here: a front end memoizes plans on
    its own launch key (PyTorch per call spec; JAX builds a launch once per trace), and clears them on
    ``on_change`` and when it swaps configs (tuning)."""
    c = _active if constraints is None else constraints
    if problem.recipe is not None:
        return _plan_fp8(problem, target, capabilities, c)
    if problem.op == M_GROUPED:
        return _plan_m(problem, target, capabilities, c)
    if problem.op == K_GROUPED:
        triton_plan = _plan_k(problem, target, capabilities, c)
        if triton_plan.schedule.split_k > 1:  # few tiles: the split rows win over any unsplit kernel
            return triton_plan
        ws = _plan_k_ws(problem, target, capabilities, c)
        return ws if ws is not None else triton_plan
    raise ValueError(f"unknown op {problem.op!r}")


def _tma(p: Problem, t: Target, caps: Capabilities, c: Constraints) -> tuple[bool, bool]:
    """(TMA store, TMA loads) the rules allow, before the kernel's shared-memory and tail fits."""
    if not (caps.global_scratch and t.name in ("sm90", "interpret")):
        return False, False
    store_min = TMA_STORE_MIN_FLOPS if c.tma_store_min_flops is None else c.tma_store_min_flops
    load_min = TMA_LOAD_MIN_FLOPS if c.tma_load_min_flops is None else c.tma_load_min_flops
    two_byte = p.dtype in ("bfloat16", "float16")
    work = launch_work(p.M, p.N, p.K, p.G)
    store = c.on("tma_store") and p.tma_store_layout and p.out_itemsize == 2 and work >= store_min
    load = c.on("tma_load") and p.tma_load_layout and two_byte and work >= load_min and 0 < p.M < 2**31
    if p.op == M_GROUPED:
        w_rows = p.N if p.w_k_contiguous else p.K
        load = load and p.K > 0 and p.G * w_rows < 2**31
    else:
        store = store and not p.accumulate and p.N > 0
    return store, load


def _config_rows(p: Problem) -> int:
    """The rows a config is picked for: with a group offset, those the local groups can expect
    (M * G / g_total): measured on the H100, picking for all rows gave qwen3-30b-fc1 wgrad at ep=2 an 11%
    slower tile than its local-rows run."""
    if p.g_total is None:
        return p.M
    return max(1, -(-p.M * p.G // max(p.g_total, 1)))


def _override(c: Constraints, op: str, p: Problem, t: Target, picked):
    return picked if c.config is None else c.config(op, p, t, picked)


def _pick(op: str, p: Problem, t: Target, c: Constraints, tma: bool):
    # Through the module attribute: benchmarks' tuning and config spies swap configs.pick_config.
    picked = configs.pick_config(
        op,
        t.name,
        device_name=t.device_name,
        dtype=p.dtype,
        sms=t.programs,
        tma=tma and t.name == "sm90",
        G=p.G,
        N=p.N,
        K=p.K,
        M=_config_rows(p),
    )
    return _override(c, op, p, t, picked)


# Split-K (m-grouped): where even with every row in one group the launch has too few tiles to fill the GPU
# (a few tokens, or one hot expert, against a long reduction), each tile's reduction runs in slices on
# several programs, whose fp32 partials a second kernel sums in order (docs/design.md, 'Split reduction').
SPLIT_K_MAX = 8
SPLIT_K_MIN_STEPS = 4  # BLOCK_K steps per slice at least
SPLIT_K_MAX_BYTES = 1 << 28  # of the partials, split_k x M x N x 4


def _split_k(p: Problem, t: Target, caps: Capabilities, c: Constraints, config) -> int:
    """Slices per tile of an m-grouped launch (1: none). The tiles' lower bound, cdiv(M, BLOCK_M) x
    cdiv(N, BLOCK_N) (every row in one group), is what the rule can count on: more groups only add tiles."""
    if not (caps.workspace and p.g_total is None and p.M > 0 and c.split_k is not False):
        return 1
    tiles = -(-p.M // config.block_m) * -(-p.N // config.block_n)
    return _slices(c, t, config, tiles, -(-p.K // config.block_k), p.M * p.N)


def _split_r(p: Problem, t: Target, caps: Capabilities, c: Constraints, config) -> int:
    """Row slices per tile of a k-grouped launch (1: none): where its G x cdiv(K, BLOCK_K) x cdiv(N, BLOCK_N)
    tiles leave the GPU idle and the groups' rows are many (a few experts' weight gradients over many
    tokens). Not with accumulation, column sums or a group offset."""
    if not (caps.workspace and p.g_total is None and p.M > 0 and c.split_k is not False):
        return 1
    if p.accumulate or p.a_colsum:
        return 1
    tiles = p.G * -(-p.K // config.block_k) * -(-p.N // config.block_n)
    row_steps = p.M // max(p.G, 1) // config.block_r  # a group's BLOCK_R steps, on average
    return _slices(c, t, config, tiles, row_steps, p.G * p.K * p.N)


def _slices(c: Constraints, t: Target, config, tiles: int, steps: int, partial_elements: int) -> int:
    """The split count both split rules share: the constraint's int if it forces one; else as many slices as
    fill the programs the launch's ``tiles`` leave idle, each of at least SPLIT_K_MIN_STEPS of the ``steps``,
    at most SPLIT_K_MAX, and fp32 partials (``partial_elements`` a slice) within SPLIT_K_MAX_BYTES; 1: none."""
    if isinstance(c.split_k, int) and not isinstance(c.split_k, bool):
        return c.split_k
    split = min(SPLIT_K_MAX, t.programs * config.ctas_per_sm // tiles, steps // SPLIT_K_MIN_STEPS)
    while split > 1 and split * partial_elements * 4 > SPLIT_K_MAX_BYTES:
        split -= 1
    return split if split >= 2 else 1


# The widest tile the SwiGLU backward epilogue takes (docs/design.md, 'Fused expert block'): at 128 x 256 its
# registers spilled 1.8 KB on sm_90a even worked in two column halves; 128 x 128 spills 8 bytes.
SWIGLU_BWD_MAX_BLOCK_N = 128


def _plan_m(p: Problem, t: Target, caps: Capabilities, c: Constraints) -> Plan:
    tma_store, tma_load = _tma(p, t, caps, c)
    # The m-grouped TMA-only candidates were measured on forward launches (K-contiguous w) with TMA loads.
    config = _pick(M_GROUPED, p, t, c, tma_load and p.w_k_contiguous)
    if p.epilogue == "swiglu_bwd" and t.name == "sm90":
        config = _override(c, M_GROUPED, p, t, configs.candidates("m_grouped_swiglu_bwd", "sm90")[0])
    elif p.epilogue == "swiglu_bwd" and t.name != "interpret" and config.block_n > SWIGLU_BWD_MAX_BLOCK_N:
        config = _override(c, M_GROUPED, p, t, dataclasses.replace(config, block_n=SWIGLU_BWD_MAX_BLOCK_N))
    split_k = 1 if p.epilogue or not p.fill_tail else _split_k(p, t, caps, c, config)
    launch = MGroupedLaunch.make(
        p.M,
        p.N,
        p.K,
        p.G,
        config=config,
        num_programs_cap=t.programs,
        fp32_inputs=p.dtype == "float32",
        interpret=t.name == "interpret",
        max_stride=p.max_stride,
        w_k_contiguous=p.w_k_contiguous,
        has_bias=p.has_bias,
        g_total=p.g_total,
        tma_store=tma_store,
        tma_load=tma_load,
        mixed_m=c.on("mixed_m") and p.rows_aligned,
        tail_split=c.on("tail_split") and p.rows_aligned,
        flat=c.on("flat"),
        load_pad=p.load_pad,
        split_k=split_k,
        gather="x" in p.gather,
        epilogue=p.epilogue,
        fill_tail=p.fill_tail,
    )
    meta = launch.meta
    schedule = Schedule(
        tma_load=meta["TMA_LOAD"],
        tma_store=meta["TMA_STORE"],
        mixed_m=meta["MIXED_M"],
        tail_split=meta["TAIL_SPLIT"],
        flat=meta["FLAT"],
        flat_whole_tiles=meta["FLAT_WHOLE_TILES"],
        split_k=meta["SPLIT_K"],
    )
    return Plan("m_grouped", schedule, config, launch)


def _plan_k(p: Problem, t: Target, caps: Capabilities, c: Constraints) -> Plan:
    tma_store, tma_load = _tma(p, t, caps, c)
    # The k-grouped TMA-only candidates (flat 128 x 256) keep their staging tile without the TMA store too;
    # they are left out only where the launcher has no global scratch at all.
    config = _pick(K_GROUPED, p, t, c, caps.global_scratch)
    if p.gather and t.name == "sm90":
        config = _override(c, K_GROUPED, p, t, configs.candidates("k_grouped_gather", "sm90")[0])
    split_r = _split_r(p, t, caps, c, config)
    launch = KGroupedLaunch.make(
        p.M,
        p.N,
        p.K,
        p.G,
        config=config,
        num_programs_cap=t.programs,
        fp32_inputs=p.dtype == "float32",
        accumulate=p.accumulate,
        interpret=t.name == "interpret",
        max_stride=p.max_stride,
        a_k_contiguous=p.a_k_contiguous,
        a_colsum=p.a_colsum,
        g_total=p.g_total,
        out_itemsize=p.out_itemsize,
        tma_store=tma_store,
        tma_load=tma_load,
        load_pad=p.load_pad,
        split_r=split_r,
        gather_a="a" in p.gather,
        gather_b="b" in p.gather,
    )
    meta = launch.meta
    schedule = Schedule(
        tma_load=meta["TMA_LOAD"], tma_store=meta["TMA_STORE"], flat=meta["FLAT"], split_k=meta["SPLIT_R"]
    )
    return Plan("k_grouped", schedule, config, launch)


def _ws_target(t: Target, caps: Capabilities) -> bool:
    """The warp-specialized kernels run here: a launcher that launches Gluon kernels, an sm90 GPU (wgmma,
    setmaxnreg)."""
    return caps.gluon and t.name == "sm90"


def _plan_k_ws(p: Problem, t: Target, caps: Capabilities, c: Constraints) -> Plan | None:
    """The warp-specialized BF16/FP16 wgrad (TMA loader, TMA-store epilogue through a host descriptor over
    out), or None: where both TMA paths apply, out is contiguous in the operands' dtype, no column sums and
    no group offset (``ws_layout``), the kernel takes the problem and ``configs.pick_k_ws_config`` routes it."""
    if not (
        c.on("ws_wgrad")
        and p.ws_layout
        and p.g_total is None
        and _ws_target(t, caps)
        and caps.host_descriptors
    ):
        return None
    if p.a_colsum or p.accumulate or p.gather or _tma(p, t, caps, c) != (True, True):
        return None
    itemsize = {"bfloat16": 2, "float16": 2}.get(p.dtype, 0)
    if not k_grouped_ws.supported_problem(p.K, p.N, itemsize, p.row_strides, p.M):
        return None
    config = configs.pick_k_ws_config(device_name=t.device_name, dtype=p.dtype, G=p.G, N=p.N, K=p.K, M=p.M)
    config = _override(c, "k_grouped_ws", p, t, config)
    if config is None:
        return None
    launch = k_grouped_ws.KGroupedWsLaunch.make(
        p.M, p.N, p.K, p.G, config=config, num_programs_cap=t.programs
    )
    schedule = Schedule(tma_load=True, tma_store=True, host_out_descriptor=True)
    return Plan("k_grouped_ws", schedule, config, launch)


def _plan_fp8(p: Problem, t: Target, caps: Capabilities, c: Constraints) -> Plan:
    ws = _plan_fp8_ws(p, t, caps, c)
    if ws is not None:
        return ws
    op = "m_grouped_fp8" if p.op == M_GROUPED else "k_grouped_fp8"
    table = fp8.config_op(op, p.recipe, p.fast_accum)
    config = configs.pick_config(
        table,
        t.name,
        device_name=t.device_name,
        dtype=fp8.config_dtype(p.recipe, p.dtype, p.fast_accum),
        G=p.G,
        N=p.N,
        K=p.K,
        M=p.M,
    )
    config = _override(c, table, p, t, config)
    if p.epilogue == "swiglu_bwd" and t.name != "interpret" and config.block_n > SWIGLU_BWD_MAX_BLOCK_N:
        config = _override(c, table, p, t, dataclasses.replace(config, block_n=SWIGLU_BWD_MAX_BLOCK_N))
    common = dict(
        recipe=p.recipe,
        config=config,
        num_programs_cap=t.programs,
        interpret=t.name == "interpret",
        max_stride=p.max_stride,
        fast_accum=p.fast_accum,
        g_total=p.g_total,
    )
    if p.op == M_GROUPED:
        launch = MGroupedFp8Launch.make(
            p.M, p.N, p.K, p.G, has_bias=p.has_bias, gather="x" in p.gather, epilogue=p.epilogue, **common
        )
    else:
        launch = KGroupedFp8Launch.make(p.M, p.N, p.K, p.G, accumulate=p.accumulate, **common)
    return Plan(op, Schedule(), config, launch)


def fp8_ws_store(p: Problem, config, c: Constraints = NONE) -> int:
    """The m-grouped FP8 kernel's epilogue store (``m_grouped_fp8_ws.STORE_*``): through the staging tiles where
    out is 2-byte and they fit beside the config's ring, by TMA where out takes a descriptor, except blockwise,
    whose staging tiles store rows (docs/design.md, 'Warp-specialized FP8 kernels', has the A/B)."""
    staged = m_grouped_fp8_ws.shared_bytes(config.block_n, config.num_stages, m_grouped_fp8_ws.STORE_ROWS)
    if p.out_itemsize != 2 or not sm90_shared_fits(staged, 1):
        return m_grouped_fp8_ws.STORE_REGISTERS
    if p.recipe != "blockwise" and c.on("tma_store") and p.tma_store_layout:
        return m_grouped_fp8_ws.STORE_TMA
    return m_grouped_fp8_ws.STORE_ROWS


def _plan_fp8_ws(p: Problem, t: Target, caps: Capabilities, c: Constraints) -> Plan | None:
    """The warp-specialized FP8 kernels, or None where the Triton kernel runs: fast accumulation, a layout
    TMA cannot read (``ws_layout``: K-contiguous operands, or token-contiguous transposed copies,
    with 16-byte aligned row strides), a problem or device the kernel does not take, or a shape
    ``configs.pick_fp8_ws_config`` keeps on the Triton kernel."""
    promoted = p.recipe == "blockwise" or not p.fast_accum
    # The expert block's gathered rows and epilogues are options of the Triton kernel only (TMA has no row gather).
    if p.gather or p.epilogue or not (c.on("fp8_ws") and promoted and p.ws_layout and _ws_target(t, caps)):
        return None
    row_stride = max(map(abs, p.row_strides))
    dtype = fp8.config_dtype(p.recipe, p.dtype, p.fast_accum)
    if not caps.global_scratch:  # the loaders make their TMA descriptors on the device
        return None
    if p.op == M_GROUPED:
        if not m_grouped_fp8_ws.supported_problem(p.K, p.g_total is not None, row_stride, p.M, p.G * p.N):
            return None
        config = configs.pick_fp8_ws_config(
            "m_grouped_fp8_ws",
            recipe=p.recipe,
            device_name=t.device_name,
            dtype=dtype,
            G=p.G,
            N=p.N,
            K=p.K,
            M=p.M,
        )
        config = _override(c, "m_grouped_fp8_ws", p, t, config)
        if config is None:
            return None
        launch = m_grouped_fp8_ws.MGroupedFp8WsLaunch.make(
            p.M,
            p.N,
            p.K,
            p.G,
            recipe=p.recipe,
            config=config,
            num_programs_cap=t.programs,
            has_bias=p.has_bias,
            store=fp8_ws_store(p, config, c),
        )
        return Plan("m_grouped_fp8_ws", Schedule(), config, launch)
    # The wgrad's epilogue stores through out's descriptor: the front end's, or one it makes in the global scratch
    # the loader's descriptors live in (a launcher without host descriptors: JAX).
    if not (
        p.tma_store_layout
        and k_grouped_fp8_ws.supported_problem(p.g_total is not None, row_stride, p.out_span)
    ):
        return None
    config = configs.pick_fp8_ws_config(
        "k_grouped_fp8_ws",
        recipe=p.recipe,
        device_name=t.device_name,
        dtype=dtype,
        G=p.G,
        N=p.N,
        K=p.K,
        M=p.M,
        out_itemsize=p.out_itemsize,
        accumulate=p.accumulate,
    )
    config = _override(c, "k_grouped_fp8_ws", p, t, config)
    if config is None:
        return None
    launch = k_grouped_fp8_ws.KGroupedFp8WsLaunch.make(
        p.M,
        p.N,
        p.K,
        p.G,
        recipe=p.recipe,
        config=config,
        num_programs_cap=t.programs,
        accumulate=p.accumulate,
        out_itemsize=p.out_itemsize,
        out_desc_on_device=not caps.host_descriptors,
    )
    return Plan("k_grouped_fp8_ws", Schedule(), config, launch)


def fp8_epilogue_split(
    p: Problem, target: Target, caps: Capabilities, constraints: Constraints | None = None
) -> bool:
    """The FP8 expert block's gathered launch with a SwiGLU epilogue (``p``: gather ("x",), an epilogue; the plain
    problem's layout facts ws_layout and row_strides as the gathered copy would have them): True runs it as a copy
    of the gathered FP8 rows, the plain launch and the SwiGLU row kernel (``kernels/swiglu.py``), False as one
    Triton launch. Split where the plain problem takes the warp-specialized kernel (promoted accumulation on
    sm90), which has no row gather or epilogue: the Triton promoted kernel with them ran fc2's dgrad at 592 TF/s
    on DeepSeek-V3 EP8 where the warp-specialized dgrad runs 1124 (H100, 2026-11-27; docs/design.md, 'FP8 expert
    block')."""
    c = _active if constraints is None else constraints
    if c.fp8_epilogue_split is not None:
        return c.fp8_epilogue_split
    plain = dataclasses.replace(p, gather=(), epilogue="")
    return _plan_fp8_ws(plain, target, caps, c) is not None


# Staging: one pass over a misaligned operand costs about 2 x its bytes at this rate (read and write) plus a
# launch; the GEMM's own time is estimated from its FLOPs at GEMM_FLOPS_PER_S and its bytes at the same rate.
STAGE_BYTES_PER_S = 2.5e12
STAGE_LAUNCH_S = 2e-6
GEMM_FLOPS_PER_S = 6e14
# Staging pays up to this many times the GEMM's estimated time (docs/design.md, 'Unaligned rows'). As given,
# a forward reads its K-contiguous weight tiles element by element once per row tile: with several rows per
# expert that ran 10-25x slower than staged on the H100 (a 19k-token forward on 86 experts at K = 8529: 5.4
# ms against 0.55); with about one row tile per expert, and in dgrad and wgrad, it ran 0.5-3x the staged time.
STAGE_MAX_RATIO = 8
STAGE_MAX_RATIO_LIGHT = 1.5


def wgrad_gathers_rows(M: int, N: int, K: int, G: int, target: Target, caps: Capabilities | None) -> bool:
    """Whether the expert block's wgrads (M token rows, expert dim N = n, hidden K = d) read their token rows by
    index in the Triton kernel (True), or the front end first copies them into expert order for the plain wgrad,
    the warp-specialized kernel where it runs (False: a transient [M, K] copy; docs/design.md, 'Fused expert
    block'). A front end without a workspace (JAX) gathers in the kernel."""
    if _active.wgrad_gather is not None:
        return _active.wgrad_gather
    # Measured on the H100 (fwd+bwd device time, skewed routing): the copies won 5-10% from n = 2048 up
    # (sonic-n2048, DeepSeek-V3 EP8, gpt-oss-120b) for 0.7-1.0 GiB more peak, 2-4% at n 768-1024 for 0.75-1 GiB,
    # and lost 10% at n = 256 (k 16: 4 GiB of copies). The wgrads' N here is n: the rule keeps the in-kernel
    # gather below 2048, where the memory outweighs a few percent.
    return N < WGRAD_COPY_MIN_N or caps is None or not caps.workspace


# The expert dimension n from which the expert block's wgrads read gathered copies (``wgrad_gathers_rows``).
WGRAD_COPY_MIN_N = 2048


def stage_rows(
    staged_bytes: int,
    M: int,
    N: int,
    K: int,
    G: int,
    itemsize: int,
    *,
    k_contiguous_weight: bool = False,
    constraints: Constraints | None = None,
) -> int:
    """The load_pad of a BF16/FP16/FP32 launch (``Problem.load_pad``): 1 (read as given), or ``16 //
    itemsize`` where the front end copies every operand whose rows are not 16-byte aligned (their extent,
    row or group stride, or base; ``staged_bytes`` of them, 0: none) into rows zero-padded to that many
    elements, so the kernels read whole 16-byte vectors (docs/design.md, 'Unaligned rows').

    Element-wise loads ran an H100 forward with real work 10-25x slower than staged, but staging costs
    a pass over the whole operand: a weight of many experts of which a few tokens touch few. So it stages
    where that pass costs at most STAGE_MAX_RATIO times the GEMM's estimated time (an m-grouped launch with a
    K-contiguous weight, the forward, and at least 4 rows per expert on average), STAGE_MAX_RATIO_LIGHT times
    otherwise; the GEMM's bytes count the experts M rows can reach (min(G, M)). Measured on the H100, that
    keeps a few-token forward on 85 experts at 9.6 us instead of 70 us staged, and stages a 5003-token one (57
    us instead of 540 as given). ``Constraints.stage_rows``: False never, True always (the A/B arms)."""
    c = _active if constraints is None else constraints
    if staged_bytes == 0 or c.stage_rows is False or itemsize >= 16:
        return 1
    if c.stage_rows is None:
        stage_s = 2 * staged_bytes / STAGE_BYTES_PER_S + STAGE_LAUNCH_S
        gemm_bytes = itemsize * (M * K + M * N + min(G, M) * K * N)
        gemm_s = max(2 * M * N * K / GEMM_FLOPS_PER_S, gemm_bytes / STAGE_BYTES_PER_S)
        heavy = k_contiguous_weight and M >= 4 * G
        if stage_s > (STAGE_MAX_RATIO if heavy else STAGE_MAX_RATIO_LIGHT) * gemm_s:
            return 1
    return 16 // itemsize


def quantize_config(target: Target) -> configs.QuantizeConfig:
    """The FP8 quantize kernels' config on ``target``."""
    return configs.pick_config("quantize_fp8", target.name)


# ptxas releases whose build of quantize_fp8.fp8_quantize_pair_kernel wrote the twin's bytes on the H100, on
# every case of the byte check (docs/design.md, 'Quantize'). Another release may miscompile a kernel that
# stores FP8 values in two orders, silently (https://github.com/triton-lang/triton/issues/11111: ptxas before
# 13.3 corrupts the transposed 1-byte store), so it gets the two launches.
PAIR_QUANTIZE_PTXAS: frozenset[str] = frozenset({"12.8", "13.0", "13.4"})  # triton 3.6's, CUDA 13.0's, 3.9's


# Mean rows a group from which rowwise takes the pair kernel: its maxima pass reads 256-row tiles. H100, 2026-11-28
# (docs/design.md, 'Quantize'): dsv3-ep8-fc1's dy (1024 rows a group) quantized in 0.43 ms against 0.56 with the
# rows and columns launches; qwen3-30b-fc1's (128) made the step 1.082 ms against 1.060.
ROWWISE_PAIR_MIN_ROWS = 256


def quantize_pair(
    recipe: str,
    transpose: bool,
    data: bool,
    rows_aligned: bool,
    group_rows: float,
    target: Target,
    caps: Capabilities,
    ptxas: str,
) -> bool:
    """Whether a quantize launch writes data and data_t with the one-read pair kernel (else a launch for each,
    each reading x): both copies wanted, x's rows and width in multiples of 16 elements with unit column stride
    (``rows_aligned``: its cp.async copies are 16 bytes), on sm90 through Gluon, compiled by a ptxas release in
    PAIR_QUANTIZE_PTXAS (``ptxas``: its 'X.Y'); rowwise where its groups average ROWWISE_PAIR_MIN_ROWS rows or
    more (``group_rows``). ``Constraints.quantize_pair`` False turns it off, True keeps it where it applies (the
    ptxas check included)."""
    if _active.quantize_pair is False or not (transpose and data and rows_aligned):
        return False
    if recipe == "rowwise" and group_rows < ROWWISE_PAIR_MIN_ROWS:
        return False
    return target.name == "sm90" and caps.gluon and ptxas in PAIR_QUANTIZE_PTXAS


def colsum_fused(recipe: str, transpose: bool, amax_given: bool) -> bool:
    """Whether a quantize of activations takes their per-group column sums (dy's bias gradient) from its own read
    of x: tensorwise's amax pass (unless the amax is given) and rowwise's transposed-copy sweep; else a launch of
    their own (docs/design.md, 'FP8 bias gradient')."""
    return (recipe == "rowwise" and transpose) or (recipe == "tensorwise" and not amax_given)


# ---------------------------------------------------------------- per-call gate


def tma_candidate(M: int, N: int, K: int, G: int) -> bool:
    """Whether a launch of ``launch_work(M, N, K, G)`` may take a TMA path at all under the active
    constraints, so that a front end checks its tensors' layout for descriptors (data pointers cost host
    time) only then."""
    return launch_work(M, N, K, G) >= _tma_gate_flops


# ---------------------------------------------------------------- constraints


_active = NONE
_tma_gate_flops = min(TMA_STORE_MIN_FLOPS, TMA_LOAD_MIN_FLOPS)
_listeners: list[Callable[[], None]] = []


def active() -> Constraints:
    """The constraints plans are made under now."""
    return _active


def on_change(clear: Callable[[], None]) -> None:
    """Registers a front end's cache clearer, called whenever the active constraints change (memoized
    launches depend on them)."""
    _listeners.append(clear)


def _set(constraints: Constraints) -> None:
    global _active, _tma_gate_flops
    _active = constraints
    gates = []
    if constraints.on("tma_store"):
        gates.append(
            TMA_STORE_MIN_FLOPS
            if constraints.tma_store_min_flops is None
            else constraints.tma_store_min_flops
        )
    if constraints.on("tma_load"):
        gates.append(
            TMA_LOAD_MIN_FLOPS if constraints.tma_load_min_flops is None else constraints.tma_load_min_flops
        )
    _tma_gate_flops = min(gates, default=float("inf"))
    for clear in _listeners:
        clear()


class _Restore:
    """What ``constrain`` returns: the new constraints are active at once; as a context manager, the
    previous ones come back at exit."""

    def __init__(self, previous: Constraints) -> None:
        self.previous = previous

    def __enter__(self) -> Constraints:
        return _active

    def __exit__(self, *exc) -> None:
        _set(self.previous)


def constrain(**overrides) -> _Restore:
    """Updates the active constraints with ``overrides`` (Constraints fields), clearing memoized plans and
    launches. ``with constrain(tma_store=False): ...`` restores the previous ones at exit; a bare call lasts
    until ``reset()`` (the tests' conftest resets after every test)."""
    previous = _active
    _set(dataclasses.replace(_active, **overrides))
    return _Restore(previous)


def reset() -> None:
    """Back to no constraints (the rules alone)."""
    if _active != NONE:
        _set(NONE)


@contextlib.contextmanager
def constrained(constraints: Constraints) -> Iterator[Constraints]:
    """The given constraints, replacing the active ones, for the block."""
    previous = _active
    _set(constraints)
    try:
        yield constraints
    finally:
        _set(previous)
