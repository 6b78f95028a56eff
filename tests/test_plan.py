"""The launch planner (moegemm._src.plan): its decisions straight from its inputs, no kernel run, no GPU."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from moegemm._src import configs, plan
from moegemm._src.kernels import gluon_hopper, m_grouped

SM90 = plan.Target("sm90", "", 132)
TORCH = plan.Capabilities(host_descriptors=True, global_scratch=True, gluon=True, workspace=True)
needs_gluon = pytest.mark.skipif(not gluon_hopper.supported(), reason="this Triton has no Gluon Hopper API")


def m_problem(M=8192, N=4096, K=2048, G=8, **kw) -> plan.Problem:
    """A forward whose tensors take every descriptor (as the PyTorch launcher would find them)."""
    facts = dict(w_k_contiguous=True, rows_aligned=True, tma_store_layout=True, tma_load_layout=True)
    return plan.Problem(plan.M_GROUPED, M, N, K, G, "bfloat16", **{**facts, **kw})


def k_problem(M=32 * 1024, N=2880, K=2880, G=32, **kw) -> plan.Problem:
    """A wgrad with out contiguous in bf16 whose tensors take every descriptor."""
    facts = dict(tma_store_layout=True, tma_load_layout=True, ws_layout=True, row_strides=(K, N))
    return plan.Problem(plan.K_GROUPED, M, N, K, G, "bfloat16", **{**facts, **kw})


@pytest.mark.parametrize("target", [SM90, plan.INTERPRET], ids=["sm90", "interpret"])
@pytest.mark.parametrize("problem", [m_problem(), k_problem(), k_problem(G=4, M=4 * 65536)], ids=str)
def test_jax_capabilities_never_take_tma_or_gluon(target, problem):
    """The interpreter's JAX executor (``plan.JAX``) passes neither descriptors nor scratch: whatever the
    layout facts say, no TMA path, no warp-specialized kernel, and no config measured only through TMA."""
    chosen = plan.plan(problem, target, plan.JAX)
    assert chosen.kernel == problem.op
    assert not (chosen.scratch or chosen.meta["TMA_LOAD"] or chosen.meta["TMA_STORE"]), chosen.schedule
    assert chosen.config not in configs.TMA_ONLY
    assert not chosen.schedule.flat and not chosen.schedule.flat_whole_tiles


def test_flop_thresholds_gate_tma():
    """Below TMA_STORE_MIN_FLOPS / TMA_LOAD_MIN_FLOPS (``launch_work``) the launch keeps the register store
    and cp.async; at the threshold it takes them (the store where the config has room for its staging tile); a
    constraint moves the threshold. A store-bound launch (a short reduction, a large out) counts its bytes."""
    assert plan.TMA_STORE_MIN_FLOPS == plan.TMA_LOAD_MIN_FLOPS == 5e10
    at, N, K, G = 5000, 5000, 1000, 8
    assert plan.launch_work(at, N, K, G) == 2 * at * N * K == plan.TMA_STORE_MIN_FLOPS
    # 2 M N K = 3.2e10, but 240 x 2 bytes x (M K + M N + G K N) = 7.6e10: out [15854, 9856] is 312 MB.
    short = plan.plan(m_problem(15854, 9856, 104, 51), SM90, TORCH)
    assert short.schedule.tma_load and plan.launch_work(15854, 9856, 104, 51) > 2 * 15854 * 9856 * 104
    assert short.schedule.tma_store == m_grouped.tma_store_fits(short.config, 2), short.config
    below = plan.plan(m_problem(at - 1, N, K, G), SM90, TORCH)
    assert not (below.schedule.tma_store or below.schedule.tma_load or below.scratch), below.schedule
    on = plan.plan(m_problem(at, N, K, G), SM90, TORCH)
    assert on.schedule.tma_load and on.scratch, on.schedule
    assert on.schedule.tma_store == m_grouped.tma_store_fits(on.config, 2), on.config
    small = m_problem(64, 64, 64, 2)
    assert not plan.plan(small, SM90, TORCH).scratch
    forced = plan.Constraints(tma_store_min_flops=0, tma_load_min_flops=0)
    assert plan.plan(small, SM90, TORCH, forced).schedule.tma_load
    with plan.constrain(tma_store_min_flops=0, tma_load_min_flops=0):
        assert plan.plan(small, SM90, TORCH).schedule.tma_load and plan.tma_candidate(1, 1, 1, 1)
    assert not plan.plan(small, SM90, TORCH).scratch and not plan.tma_candidate(64, 64, 64, 2)


def test_tma_needs_layout_and_target():
    """The layout facts the front end found, 2-byte operands, and sm90 or the interpreter."""
    big = m_problem()
    assert plan.plan(big, SM90, TORCH).schedule.tma_load
    assert not plan.plan(dataclasses.replace(big, tma_load_layout=False), SM90, TORCH).schedule.tma_load
    assert not plan.plan(dataclasses.replace(big, tma_store_layout=False), SM90, TORCH).schedule.tma_store
    fp32 = dataclasses.replace(big, dtype="float32", out_itemsize=4)
    assert not plan.plan(fp32, SM90, TORCH).scratch
    assert not plan.plan(big, plan.Target("cuda", "", 108), TORCH).scratch
    accumulate = k_problem(accumulate=True, out_itemsize=4, ws_layout=False)
    assert not plan.plan(accumulate, SM90, TORCH).schedule.tma_store


def test_interpret_target():
    """The interpreter runs the TMA paths (CI covers them) under the same size gate, every half-high tile
    mode on any shape, and never a Gluon kernel."""
    tiny = dict(tma_store_min_flops=0, tma_load_min_flops=0)
    chosen = plan.plan(m_problem(100, 40, 32, 3), plan.INTERPRET, TORCH, plan.Constraints(flat=False, **tiny))
    assert chosen.schedule.tma_load and chosen.schedule.tma_store
    assert chosen.schedule.mixed_m and chosen.schedule.tail_split
    assert chosen.config == configs.candidates("m_grouped", "interpret")[0]
    assert chosen.meta["NUM_PROGRAMS"] <= plan.INTERPRET.programs
    wgrad = plan.plan(k_problem(), plan.INTERPRET, TORCH)
    assert wgrad.kernel == "k_grouped"
    assert not plan.plan(m_problem(100, 40, 32, 3), plan.INTERPRET, TORCH).scratch  # the size gate holds


@needs_gluon
def test_ws_wgrad_rule():
    """sm90 with Gluon: the warp-specialized wgrad for groups of more than K_WS_MIN_ROWS rows on average, with
    both TMA paths, out in the operands' dtype, no accumulation and no column sums; otherwise the Triton
    kernel. Its out descriptor is made on the host."""
    low = configs.K_WS_MIN_ROWS
    G = 32
    at, above = k_problem(M=G * low, G=G), k_problem(M=G * low + 1, G=G)
    assert plan.plan(at, SM90, TORCH).kernel == "k_grouped"
    ws = plan.plan(above, SM90, TORCH)
    assert ws.kernel == "k_grouped_ws" and ws.schedule.host_out_descriptor and ws.scratch
    assert ws.config == configs.candidates("k_grouped_ws", "sm90")[0]
    for other in (
        dataclasses.replace(above, ws_layout=False),
        dataclasses.replace(above, a_colsum=True),
        dataclasses.replace(above, tma_load_layout=False),
    ):
        assert plan.plan(other, SM90, TORCH).kernel == "k_grouped", other
    assert plan.plan(above, SM90, dataclasses.replace(TORCH, gluon=False)).kernel == "k_grouped"
    assert plan.plan(above, SM90, dataclasses.replace(TORCH, host_descriptors=False)).kernel == "k_grouped"
    assert plan.plan(above, plan.INTERPRET, TORCH).kernel == "k_grouped"
    assert plan.plan(above, SM90, TORCH, plan.Constraints(ws_wgrad=False)).kernel == "k_grouped"
    assert plan.plan(above, SM90, TORCH, plan.Constraints(tma_store=False)).kernel == "k_grouped"


@needs_gluon
@pytest.mark.parametrize("op", [plan.M_GROUPED, plan.K_GROUPED])
def test_fp8_ws_rule(op):
    """FP8 on sm90 with Gluon: promoted accumulation with a layout cp.async reads takes the warp-specialized
    kernel where the config rule routes it; fast tensorwise accumulation, the interpreter's JAX capabilities and
    fp8_ws=False keep Triton. JAX's GPU executor (scratch and Gluon, no host descriptors) takes it, the wgrad
    making out's descriptor itself."""
    M, N, K, G = 8 * 4096, 7168, 4096, 8
    facts = dict(ws_layout=True, row_strides=(K, K) if op == plan.M_GROUPED else (M, M), recipe="blockwise")
    if op == plan.K_GROUPED:  # the wgrad stores through a host descriptor over out, loads through device ones
        facts |= dict(out_itemsize=4, out_span=N * K, tma_store_layout=True)
    problem = plan.Problem(op, M, N, K, G, "float8_e4m3fn", max_stride=M, **facts)
    assert plan.plan(problem, SM90, TORCH).kernel == f"{op}_fp8_ws"
    jax_gpu = plan.plan(problem, SM90, plan.JAX_GPU)
    assert jax_gpu.kernel == f"{op}_fp8_ws"
    if op == plan.K_GROUPED:
        assert (
            jax_gpu.meta["OUT_DESC_ON_DEVICE"]
            and not plan.plan(problem, SM90, TORCH).meta["OUT_DESC_ON_DEVICE"]
        )
        no_scratch = dataclasses.replace(TORCH, global_scratch=False)
        assert plan.plan(problem, SM90, no_scratch).kernel == "k_grouped_fp8"
        assert (
            plan.plan(dataclasses.replace(problem, tma_store_layout=False), SM90, TORCH).kernel
            == "k_grouped_fp8"
        )
    triton_kernel = f"{op}_fp8"
    assert plan.plan(problem, SM90, plan.JAX).kernel == triton_kernel
    assert plan.plan(problem, SM90, TORCH, plan.Constraints(fp8_ws=False)).kernel == triton_kernel
    assert plan.plan(dataclasses.replace(problem, ws_layout=False), SM90, TORCH).kernel == triton_kernel
    fast = dataclasses.replace(problem, recipe="tensorwise", fast_accum=True)
    assert plan.plan(fast, SM90, TORCH).kernel == triton_kernel


@needs_gluon
@pytest.mark.parametrize("K", [7168, 2048], ids=["wide-tile", "narrow-tile"])
def test_fp8_ws_store_rule(K):
    """The m-grouped FP8 kernel's epilogue store (``plan.fp8_ws_store``), in PyTorch and JAX: a 2-byte out goes
    through the staging tiles where they fit beside the config's ring (each table config), by TMA where out
    takes a descriptor and tma_store is on, except blockwise (rows); an fp32 out or a ring too deep for the
    staging tiles keeps the register stores."""
    from moegemm._src.kernels import m_grouped_fp8_ws as ws

    M, N, G = 8 * 4096, 4096, 8
    facts = dict(ws_layout=True, row_strides=(K, K), out_itemsize=2, tma_store_layout=True)
    problem = plan.Problem(
        plan.M_GROUPED, M, N, K, G, "float8_e4m3fn", max_stride=M, recipe="rowwise", **facts
    )
    blockwise = dataclasses.replace(problem, recipe="blockwise")
    for caps in (TORCH, plan.JAX_GPU):
        for p, store in ((problem, ws.STORE_TMA), (blockwise, ws.STORE_ROWS)):
            chosen = plan.plan(p, SM90, caps)
            assert chosen.kernel == "m_grouped_fp8_ws" and chosen.meta["STORE"] == store, (caps, p.recipe)
    for other, constraints, store in (
        (dataclasses.replace(problem, out_itemsize=4), plan.NONE, ws.STORE_REGISTERS),
        (dataclasses.replace(blockwise, out_itemsize=4), plan.NONE, ws.STORE_REGISTERS),
        (dataclasses.replace(problem, tma_store_layout=False), plan.NONE, ws.STORE_ROWS),
        (problem, plan.Constraints(tma_store=False), ws.STORE_ROWS),
    ):
        chosen = plan.plan(other, SM90, TORCH, constraints)
        assert chosen.kernel == "m_grouped_fp8_ws" and chosen.meta["STORE"] == store, (other, constraints)
    config = plan.plan(problem, SM90, TORCH).config
    deep = dataclasses.replace(config, num_stages=config.num_stages + 1)  # the ring alone fills shared memory
    forced = plan.Constraints(config=lambda op, p, t, picked: deep if op == "m_grouped_fp8_ws" else picked)
    assert plan.plan(problem, SM90, TORCH, forced).meta["STORE"] == ws.STORE_REGISTERS


def test_half_tiles_need_aligned_rows_and_constraints():
    """Mixed heights and the split tail where the rows are 16-element aligned and no constraint turns them off;
    the flat loop (short K with TMA loads) runs every tile full height."""
    per_tile = plan.Constraints(flat=False)
    on = plan.plan(m_problem(K=1024), SM90, TORCH, per_tile).schedule
    assert on.mixed_m and on.tail_split and not on.flat
    off = plan.plan(m_problem(K=1024, rows_aligned=False), SM90, TORCH, per_tile).schedule
    assert not (off.mixed_m or off.tail_split)
    none = plan.Constraints(flat=False, mixed_m=False, tail_split=False)
    assert not plan.plan(m_problem(K=1024), SM90, TORCH, none).schedule.mixed_m
    flat = plan.plan(m_problem(K=1024), SM90, TORCH).schedule
    assert flat.flat and not (flat.mixed_m or flat.tail_split)


def test_group_offset_picks_for_local_rows():
    """With a group offset (expert parallelism) the config is picked for the rows the local groups can expect."""
    seen = []
    inner = configs.pick_config
    try:
        configs.pick_config = lambda *a, **kw: (seen.append(kw["M"]), inner(*a, **kw))[1]
        plan.plan(m_problem(8000, G=4, g_total=16), SM90, plan.JAX)
        plan.plan(m_problem(8000, G=4), SM90, plan.JAX)
    finally:
        configs.pick_config = inner
    assert seen == [2000, 8000]


def test_constraints_clear_front_end_caches_and_restore():
    """constrain() merges into the active constraints, clears the registered caches, and as a context manager
    restores the previous ones."""
    cleared = []
    plan.on_change(lambda: cleared.append(plan.active()))
    try:
        plan.constrain(tma_store=False)
        with plan.constrain(mixed_m=False) as inside:
            assert inside == plan.Constraints(tma_store=False, mixed_m=False) == plan.active()
        assert plan.active() == plan.Constraints(tma_store=False)
        assert cleared[-3:] == [
            plan.Constraints(tma_store=False),
            plan.Constraints(tma_store=False, mixed_m=False),
            plan.Constraints(tma_store=False),
        ]
        plan.reset()
        assert plan.active() == plan.NONE
    finally:
        plan._listeners.pop()


def test_torch_front_end_plans_through_the_planner():
    """The PyTorch launcher's memoized plan is the planner's, and a constraint reaches it (its caches clear)."""
    torch = pytest.importorskip("torch")
    from moegemm._src.torch import launch as _launch

    spec = (32768, 1024, 1024, 8, torch.bfloat16, torch.device("cpu"), 1024, True, False, True, True, True)
    chosen = _launch._m_launch(*spec)
    assert (
        chosen.meta
        == plan.plan(
            m_problem(32768, 1024, 1024, 8, max_stride=1024), plan.INTERPRET, _launch.CAPABILITIES
        ).meta
    )
    assert chosen.schedule.tma_load
    with plan.constrain(tma_load=False):
        assert not _launch._m_launch(*spec).schedule.tma_load
    assert _launch._m_launch(*spec).schedule.tma_load


def test_switches_from_env():
    assert plan.Switches.from_env({}) == plan.Switches(check=False, direct_launch=True)
    env = {"MOEGEMM_CHECK": "1", "MOEGEMM_DIRECT_LAUNCH": "0"}
    assert plan.Switches.from_env(env) == plan.Switches(check=True, direct_launch=False)
    assert not plan.Switches.from_env({"MOEGEMM_CHECK": ""}).check


def test_env_is_read_only_by_the_planner():
    """No module of the library but the planner reads a MOEGEMM_ switch (bench and testing tools may set
    the environment of what they run)."""
    root = Path(plan.__file__).resolve().parents[1]
    read = re.compile(r"""(\.get\(|getenv\(|environ\[)\s*["']MOEGEMM_""")
    readers = {
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if read.search(path.read_text()) and path.relative_to(root).parts[0] not in ("bench", "testing")
    }
    assert readers == {"_src/plan.py"}


def test_config_constraint_replaces_the_pick():
    """Constraints.config sees each pick (op, problem, target, picked) and gives the config the plan uses;
    for a warp-specialized op a None keeps the Triton kernel."""
    seen = []
    small = configs.MGroupedConfig(64, 128, 64, 8, 4, 4, 2)

    def force(op, problem, target, picked):
        seen.append(op)
        return small if op == "m_grouped" else None if op == "k_grouped_ws" else picked

    forced = plan.Constraints(config=force)
    assert plan.plan(m_problem(), SM90, TORCH, forced).config == small
    assert plan.plan(k_problem(), SM90, TORCH, forced).kernel == "k_grouped"
    assert seen[0] == "m_grouped" and set(seen[1:]) == {"k_grouped", "k_grouped_ws"}


def test_split_k_rule():
    """Split-K where even one group holding every row leaves too few tiles for the GPU and the reduction is
    long: a few tokens against K = 13312; not for a long M, a short K, a group offset, a launcher without a
    workspace (JAX), or under constrain(split_k=False); an int forces the count."""
    few = plan.plan(m_problem(43, 2176, 13312, 12), SM90, TORCH)
    assert 2 <= few.schedule.split_k <= plan.SPLIT_K_MAX, few.schedule
    assert not (
        few.schedule.tma_store or few.schedule.mixed_m or few.schedule.tail_split or few.schedule.flat
    )
    assert plan.plan(m_problem(32768, 4096, 7168, 32), SM90, TORCH).schedule.split_k == 1
    assert plan.plan(m_problem(43, 2176, 128, 12), SM90, TORCH).schedule.split_k == 1
    assert plan.plan(m_problem(43, 2176, 13312, 12, g_total=96), SM90, TORCH).schedule.split_k == 1
    assert plan.plan(m_problem(43, 2176, 13312, 12), SM90, plan.JAX).schedule.split_k == 1
    assert (
        plan.plan(
            m_problem(43, 2176, 13312, 12), SM90, TORCH, plan.Constraints(split_k=False)
        ).schedule.split_k
        == 1
    )
    assert (
        plan.plan(m_problem(4096, 64, 64, 2), SM90, TORCH, plan.Constraints(split_k=5)).schedule.split_k == 5
    )


def test_stage_rows_rule():
    """Rows that are not 16-byte aligned are staged where the pass over them costs at most STAGE_MAX_RATIO
    times the GEMM's estimate for a forward with several rows per expert, STAGE_MAX_RATIO_LIGHT otherwise (the
    H100 numbers of plan.STAGE_MAX_RATIO's comment); aligned rows never stage; the constraint forces either
    arm."""

    def staged(G, M, K, N, fwd=True, nbytes=None):
        nbytes = 2 * (M * K + G * N * K) if nbytes is None else nbytes
        return plan.stage_rows(nbytes, M, N, K, G, 2, k_contiguous_weight=fwd)

    assert staged(7, 5003, 1001, 1400) == 8 and staged(16, 16384, 4095, 1402) == 8
    assert staged(86, 18973, 8529, 64) == 8  # as given: 5.4 ms against 0.55 staged
    assert staged(85, 8, 28, 6262) == 1 and staged(11, 7, 20, 24) == 1
    assert staged(36, 59, 789, 6277) == 1  # a row tile per expert: 293 us as given, 484 staged
    assert plan.stage_rows(0, 5003, 1400, 1001, 7, 2) == 1
    with plan.constrain(stage_rows=True):
        assert staged(11, 7, 20, 24) == 8
        assert plan.stage_rows(4, 1, 2, 2, 1, 4) == 4  # fp32: 4 elements make 16 bytes
    with plan.constrain(stage_rows=False):
        assert staged(7, 5003, 1001, 1400) == 1
