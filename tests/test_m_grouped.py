"""m_grouped_mm against the numpy fp64 oracle, one test base run per execution mode.

Modes: TestMGroupedTriton runs the Triton kernels, compiled on a CUDA machine (marked ``gpu``: the
device runs ``pytest -m gpu``) and under the interpreter on CPU; TestMGroupedReference runs the
plain-torch twin. Both are checked against ``moegemm.testing.oracle``, which shares no code with either.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, needs_cuda, record_launches, spy_store_paths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moegemm import shapes
from moegemm._src import configs, plan
from moegemm._src.kernels import m_grouped
from moegemm.testing import assert_rel_close, oracle
from moegemm.torch import k_grouped_mm, m_grouped_mm


def want(x, w, sizes, bias=None) -> torch.Tensor:
    """The oracle's out [M, N] in fp64 on the CPU."""
    b = None if bias is None else bias.double().cpu()
    return torch.from_numpy(oracle.m_grouped_mm(x.double().cpu(), w.double().cpu(), sizes, b))


def make_inputs(M, K, N, G, dtype, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype=dtype, device=DEVICE)
    if layout == "transpose_w":  # [G, N, K] storage seen as [G, K, N]: the fprop/dgrad sharing path
        w = torch.randn(G, N, K, generator=gen).to(dtype=dtype, device=DEVICE).mT
    else:
        w = torch.randn(G, K, N, generator=gen).to(dtype=dtype, device=DEVICE)
    return x, w


class MGroupedTest:
    BACKEND = "triton"

    def check(self, M, K, N, sizes, dtype=torch.bfloat16, layout="transpose_w", seed=0, bias=False):
        x, w = make_inputs(M, K, N, len(sizes), dtype, layout, seed)
        # Offset far from 0 so a bias added to a wrong (or unowned) row cannot hide in the tolerance.
        b = (torch.randn(len(sizes), N) + 3).to(dtype=dtype, device=DEVICE) if bias else None
        gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
        out = m_grouped_mm(x, w, gs, bias=b, backend=self.BACKEND)
        assert out.dtype == dtype and out.shape == (M, N)
        what = f"m_grouped {self.BACKEND} M={M} K={K} N={N} {sizes} bias={bias}"
        assert_rel_close(out.cpu(), want(x, w, sizes, b), dtype, what=what)
        owned = min(sum(max(s, 0) for s in sizes), M)
        assert torch.equal(out[owned:].cpu(), torch.zeros(M - owned, N, dtype=dtype)), "unowned rows not zero"
        return out

    @pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
    @pytest.mark.parametrize("case", shapes.EDGE, ids=lambda c: c.name)
    def test_edge_case(self, case, bias):
        self.check(case.M, case.K, case.N, list(case.sizes), bias=bias)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @pytest.mark.parametrize("layout", ["transpose_w", "k-major"])
    def test_dtype_and_layout(self, dtype, layout):
        self.check(83, 40, 36, [20, 0, 33, 30], dtype=dtype, layout=layout, seed=1)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    def test_bias_dtypes(self, dtype):
        self.check(83, 40, 36, [20, 0, 33, 25], dtype=dtype, seed=2, bias=True)

    def test_strided_bias(self):
        """A bias view with a row stride != N and a column stride != 1 (the epilogue's strided load)."""
        x, w = make_inputs(40, 24, 20, 3, torch.float32, "transpose_w")
        bias = torch.randn(20, 3, device=DEVICE).T  # [G, N] with strides (1, G)
        gs = torch.tensor([15, 0, 20], device=DEVICE)
        out = m_grouped_mm(x, w, gs, bias=bias, backend=self.BACKEND)
        assert_rel_close(out.cpu(), want(x, w, [15, 0, 20], bias), torch.float32, what="strided bias")

    @pytest.mark.parametrize(
        "pattern,sizes", shapes.empty_patterns(), ids=[p[0] for p in shapes.empty_patterns()]
    )
    def test_every_empty_pattern(self, pattern, sizes):
        # Bias on: a group without rows, or the 4 spare rows, must not receive any bias row.
        self.check(40, 16, 16, sizes, bias=True)

    @pytest.mark.parametrize("name,M,sizes", shapes.INVALID_SIZES, ids=[c[0] for c in shapes.INVALID_SIZES])
    def test_invalid_sizes_clamp(self, name, M, sizes):
        x, w = make_inputs(M, 16, 24, len(sizes), torch.float32, "transpose_w")
        gs = torch.tensor(sizes, dtype=torch.int64, device=DEVICE)
        out = m_grouped_mm(x, w, gs, backend=self.BACKEND)
        assert_rel_close(out.cpu(), want(x, w, sizes), torch.float32, what=name)

    @pytest.mark.parametrize("layout", ["transpose_w", "k-major"])
    @pytest.mark.parametrize("stage", [True, False], ids=["staged", "as-given"])
    def test_unaligned_views_read_no_padding(self, layout, stage):
        """x and w as views of wider buffers whose extra columns hold NaN, with odd K and N (rows neither
        16-byte aligned nor padded), bias on: staged or read as given, the padding never enters out."""
        plan.constrain(stage_rows=stage)
        sizes, K, N = [9, 0, 30], 33, 17
        x0, w0 = make_inputs(41, K, N, len(sizes), torch.bfloat16, layout, seed=7)
        x = torch.full((41, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)[:, :K]
        x.copy_(x0)
        # w's unit-stride axis padded with NaN: [G, N, K] for transpose_w (w is its .mT), [G, K, N] for k-major.
        inner = w0.mT if layout == "transpose_w" else w0
        w_buf = torch.full((*inner.shape[:-1], inner.shape[-1] + 7), float("nan"), dtype=torch.bfloat16)
        w_buf = w_buf.to(DEVICE)[..., : inner.shape[-1]]
        w_buf.copy_(inner)
        w = w_buf.mT if layout == "transpose_w" else w_buf
        b = (torch.randn(len(sizes), N) + 3).to(dtype=torch.bfloat16, device=DEVICE)
        gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
        out = m_grouped_mm(x, w, gs, bias=b, backend=self.BACKEND)
        assert_rel_close(
            out.cpu(), want(x0, w0, sizes, b), torch.bfloat16, what=f"padded views {layout} {stage}"
        )

    def test_int64_and_list_group_sizes(self):
        x, w = make_inputs(30, 16, 16, 3, torch.float32, "k-major")
        a = m_grouped_mm(x, w, torch.tensor([5, 10, 15], dtype=torch.int64), backend=self.BACKEND)
        b = m_grouped_mm(x, w, [5, 10, 15], backend=self.BACKEND)
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # The base class runs once per mode subclass, which is intended.
    @settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.differing_executors])
    @given(st.lists(st.integers(0, 20), min_size=1, max_size=6), st.integers(0, 10))
    def test_hypothesis_group_sizes(self, sizes, spare_rows):
        self.check(sum(sizes) + spare_rows, 24, 20, sizes, dtype=torch.float32)


class TestMGroupedTriton(MGroupedTest):
    BACKEND = "triton"
    pytestmark = pytest.mark.gpu


class TestMGroupedTritonTmaStore(MGroupedTest):
    """2-byte outputs, every BLOCK_M high tile stored through the kernel's clipped TMA view of out (the default
    where out allows one; the interpreter runs the same path), a group's partial last tile included, half-high
    tiles from registers. A spy fails any test whose launch did not take the path out's layout calls for."""

    BACKEND = "triton"
    pytestmark = pytest.mark.gpu

    @pytest.fixture(autouse=True)
    def spy(self, monkeypatch):
        from moegemm._src.torch import launch as _launch

        self.calls = spy_store_paths(monkeypatch, "m_grouped")
        yield
        _launch.clear_launch_cache()

    def check(self, M, K, N, sizes, dtype=torch.bfloat16, **kwargs):
        before = len(self.calls)
        out = super().check(M, K, N, sizes, dtype=dtype, **kwargs)
        launched = [name for name, _ in self.calls[before:]]
        if dtype != torch.float32 and launched:
            # Rows of out [M, N] are N elements apart: a descriptor needs them 16-byte aligned.
            want_path = "M_GROUPED_TMA" if N % 8 == 0 else "M_GROUPED"
            assert launched == [want_path], f"{dtype} out [{M}, {N}] took {launched}"
        return out

    def test_group_boundaries_inside_tiles(self):
        """Groups of 1, 31, 33, 64 and 95 rows: every tile through the descriptor, each partial last tile
        clipped so that it cannot write the next group's first rows, a hot expert's many tiles."""
        self.check(300, 48, 40, [1, 31, 33, 0, 64, 95, 70], bias=True)


class TestMGroupedTritonTmaLoad(MGroupedTest):
    """x and w read through two TMA descriptors the kernel makes once per program: x [M, K] and w's 2-D
    view, [G * N, K] (K-contiguous) or [G * K, N] (N-contiguous, only without a K tail: a tail step would
    put the next expert's rows into the reduction). A spy checks every launch took the path its inputs
    allow: 2-byte operands, 16-byte row strides, the experts back to back. The per-tile loop (constrain(flat=False));
    TestMGroupedTritonFlat runs the same tests through the flat loop."""

    BACKEND = "triton"
    FLAT = False
    pytestmark = pytest.mark.gpu

    @pytest.fixture(autouse=True)
    def spy(self, monkeypatch):
        from moegemm._src.torch import launch as _launch

        plan.constrain(flat=self.FLAT, tma_load=True, tma_load_min_flops=0)  # the tests' problems are tiny
        _launch.clear_launch_cache()
        self.calls = record_launches(monkeypatch, "m_grouped")
        yield
        _launch.clear_launch_cache()

    def launched_tma_load(self, before: int) -> list[bool]:
        from moegemm._src.torch import launch as _launch

        return [_launch._m_launch(*spec).meta["TMA_LOAD"] for _, spec in self.calls[before:]]

    def check(self, M, K, N, sizes, dtype=torch.bfloat16, layout="transpose_w", **kwargs):
        from moegemm._src.torch import launch as _launch

        before = len(self.calls)
        out = super().check(M, K, N, sizes, dtype=dtype, layout=layout, **kwargs)
        for _, spec in self.calls[before:]:
            block_k = _launch._m_launch(*spec).meta["BLOCK_K"]
            # Rows staged into 16-byte aligned ones (spec's load_pad; plan.stage_rows) leave only the K-tail rule
            # of an N-contiguous w (m_grouped.tma_load_fits). With K = N = 1 both of w's axes have unit stride,
            # and the launcher reads it N-contiguous.
            if spec[-1] > 1:
                k_contiguous = layout == "transpose_w" and min(K, N) > 1
                want_tma = dtype.itemsize == 2 and (k_contiguous or K % block_k == 0)
            else:
                rows_aligned = K % 8 == 0 if layout == "transpose_w" else N % 8 == 0 and K % block_k == 0
                want_tma = dtype.itemsize == 2 and K % 8 == 0 and rows_aligned
            meta, what = _launch._m_launch(*spec).meta, (M, K, N, dtype, layout)
            assert meta["TMA_LOAD"] == want_tma, what
            assert meta["FLAT"] == (self.FLAT and want_tma and K <= m_grouped.FLAT_MAX_K), what
        return out

    @pytest.mark.parametrize("layout", ["transpose_w", "k-major"])
    @pytest.mark.parametrize(
        "sizes",
        [[0, 0, 50, 33], [83, 0, 0, 0], [1, 81, 0, 1], [64, 19], [0, 0, 0, 0]],
        ids=["first-groups-empty", "one-hot-first", "one-row-groups", "tail-of-19", "all-empty"],
    )
    def test_both_layouts_take_tma_loads(self, sizes, layout):
        """K = 128 (no K tail), N = 40 (a partial column tile): both weight layouts through TMA; groups
        ending inside a row tile read the next group's rows, which must never be stored; fp16 too."""
        self.check(sum(sizes) + 5, 128, 40, sizes, layout=layout, seed=2, bias=True)
        self.check(sum(sizes) + 5, 128, 40, sizes, dtype=torch.float16, layout=layout, seed=3)

    @pytest.mark.parametrize("layout", ["transpose_w", "k-major"])
    def test_next_expert_nan_stays_out(self, layout):
        """Expert 1's weight is NaN: a descriptor read past expert 0's N columns (K-contiguous) or K rows
        (N-contiguous: a K tail, which must keep cp.async) would carry it into expert 0's rows."""
        for K in (128, 72):
            x, w = make_inputs(60, K, 40, 2, torch.bfloat16, layout, seed=5)
            w[1] = float("nan")
            before = len(self.calls)
            out = m_grouped_mm(x, w, torch.tensor([33, 27], device=DEVICE), backend=self.BACKEND)
            assert_rel_close(
                out[:33].cpu(), want(x[:33], w[:1], [33]), torch.bfloat16, what=f"{layout} K={K}"
            )
            assert out[33:].isnan().all()
            assert self.launched_tma_load(before) == [layout == "transpose_w" or K == 128], (layout, K)

    def test_weight_views(self):
        """A K-slice of a wider [G, N, K'] weight keeps TMA loads (the descriptor's K extent clips the
        rest); an N-slice leaves its experts apart (group stride != N * row stride): cp.async."""
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(70, 64, generator=gen).to(dtype=torch.bfloat16, device=DEVICE)
        wide = torch.randn(3, 48, 96, generator=gen).to(dtype=torch.bfloat16, device=DEVICE)
        wide[:, :, 64:] = float("nan")  # columns past the K-slice
        gs = torch.tensor([30, 0, 40], device=DEVICE)
        for w, tma in ((wide[:, :, :64], True), (wide[:, :40, :64], False)):
            before = len(self.calls)
            out = m_grouped_mm(x, w.mT, gs, backend=self.BACKEND)
            assert_rel_close(out.cpu(), want(x, w.mT, [30, 0, 40]), torch.bfloat16, what=f"view tma={tma}")
            assert self.launched_tma_load(before) == [tma]

    def test_small_launches_keep_cp_async(self, monkeypatch):
        """Below TMA_LOAD_MIN_FLOPS (plan.launch_work) the launch keeps cp.async (the scratch costs host time)."""
        M, K, N = 40, 64, 24
        x, w = make_inputs(M, K, N, 2, torch.bfloat16, "transpose_w", seed=8)
        gs = torch.tensor([25, 15], device=DEVICE)
        work = plan.launch_work(M, N, K, 2)
        for min_flops, tma in ((work + 1, False), (work, True)):
            plan.constrain(tma_load_min_flops=min_flops)
            before = len(self.calls)
            out = m_grouped_mm(x, w, gs, backend=self.BACKEND)
            assert self.launched_tma_load(before) == [tma]
            assert_rel_close(out.cpu(), want(x, w, [25, 15]), torch.bfloat16, what=f"min_flops {min_flops}")


class TestMGroupedTritonFlat(TestMGroupedTritonTmaLoad):
    """The TMA-load tests through the flat loop (configs.M_FLAT): one loop over every step of a program's
    tiles, every tile BLOCK_M high; the spy checks each launch with TMA loads and K <= FLAT_MAX_K took it."""

    FLAT = True


class TestMGroupedTritonFlatTmaStore(TestMGroupedTritonFlat):
    """The flat loop with the TMA store: every tile, a group's partial last one included, leaves in one bulk
    copy through the clipped 3-D view of out, and the loop has no masked store. out is NaN-poisoned and groups
    end inside row tiles, so a copy that wrote the next group's first rows (or skipped a row) fails. Configs
    without room for the staging tile give way to the table's default (``spy_store_paths``); the spy checks
    each flat launch whose out takes a descriptor stored this way."""

    @pytest.fixture(autouse=True)
    def tma_store(self, monkeypatch):
        self.store_calls = spy_store_paths(monkeypatch, "m_grouped")
        yield

    def check(self, M, K, N, sizes, dtype=torch.bfloat16, layout="transpose_w", **kwargs):
        from moegemm._src.torch import launch as _launch

        before = len(self.store_calls)
        out = super().check(M, K, N, sizes, dtype=dtype, layout=layout, **kwargs)
        for _, spec in self.store_calls[before:]:
            meta = _launch._m_launch(*spec).meta
            # out is contiguous: its rows are 16-byte aligned where N % 8 == 0.
            assert meta["TMA_STORE"] == (N % 8 == 0 and dtype.itemsize == 2), (M, K, N, dtype, layout)
        return out

    @pytest.mark.parametrize("layout", ["transpose_w", "k-major"])
    @pytest.mark.parametrize(
        "sizes",
        [[128, 0, 256, 128], [128, 5, 251, 128], [0, 0, 0, 0]],
        ids=["whole-tiles", "partial-tiles", "all-empty"],
    )
    def test_whole_tiles_pick_the_loop(self, monkeypatch, sizes, layout):
        """FLAT_MAX_K < K <= FLAT_WHOLE_TILES_MAX_K: one kernel carries both loops, and the group sizes on the
        device pick one: the flat loop where every group fills whole row tiles (128-row multiples are whole for
        every BLOCK_M), the per-tile loop with its half-high tiles where one does not. Both must be right; 7 rows
        past the groups are unowned (zeros)."""
        from moegemm._src.torch import launch as _launch

        monkeypatch.setattr(m_grouped, "FLAT_MAX_K", 32)
        _launch.clear_launch_cache()
        flat_calls = []
        if DEVICE == "cpu":  # the interpreter looks the loop up at run time: count the programs that ran it
            inner = m_grouped._m_flat_loop
            monkeypatch.setattr(m_grouped, "_m_flat_loop", lambda *a: (flat_calls.append(1), inner(*a)))
        before = len(self.store_calls)
        self.check(sum(sizes) + 7, 64, 48, sizes, layout=layout, seed=11, bias=True)
        metas = [_launch._m_launch(*spec).meta for _, spec in self.store_calls[before:]]
        assert metas and all(m["FLAT_WHOLE_TILES"] and not m["FLAT"] for m in metas), metas
        if DEVICE == "cpu":
            assert bool(flat_calls) == (sizes != [128, 5, 251, 128]), (sizes, len(flat_calls))


class TestMGroupedTritonStaged(MGroupedTest):
    """Every operand whose rows are not 16-byte aligned staged into zero-padded rows
    (constrain(stage_rows=True)), whatever the rule would weigh: the odd edge cases read through LOAD_PAD
    masks. A spy fails any test where a launch with such rows was not staged."""

    BACKEND = "triton"
    pytestmark = pytest.mark.gpu

    @pytest.fixture(autouse=True)
    def staged(self, monkeypatch):
        from moegemm._src.torch import launch as _launch

        plan.constrain(stage_rows=True)
        _launch.clear_launch_cache()
        self.calls = record_launches(monkeypatch, "m_grouped")
        yield

    def check(self, M, K, N, sizes, dtype=torch.bfloat16, **kwargs):
        before = len(self.calls)
        out = super().check(M, K, N, sizes, dtype=dtype, **kwargs)
        pad = 16 // dtype.itemsize
        for _, spec in self.calls[before:]:
            if K % pad and M > 0 and N > 0:  # x's rows (K) are not 16-byte aligned: staged
                assert spec[-1] == pad, (M, K, N, dtype, spec)
        return out


class TestMGroupedTritonSplitK(MGroupedTest):
    """Every launch's reduction in 3 slices (constrain(split_k=3)), fp32 partials summed by the reduction
    kernel: empty groups, unowned rows, bias (added once), K tails and slices with no steps. A spy fails any
    test whose launch did not split."""

    BACKEND = "triton"
    pytestmark = pytest.mark.gpu

    @pytest.fixture(autouse=True)
    def split(self, monkeypatch):
        from moegemm._src.torch import launch as _launch

        plan.constrain(split_k=3)
        _launch.clear_launch_cache()
        calls = record_launches(monkeypatch, "m_grouped")
        yield
        for _, spec in calls:
            assert _launch._m_launch(*spec).meta["SPLIT_K"] == 3, spec


class TestMGroupedTritonRegisterStore(MGroupedTest):
    """Every tile stored from registers (constrain(tma_store=False), and every out no descriptor fits)."""

    BACKEND = "triton"
    pytestmark = pytest.mark.gpu

    @pytest.fixture(autouse=True)
    def no_tma_store(self, monkeypatch):
        from moegemm._src.torch import launch as _launch

        plan.constrain(tma_store=False)
        _launch.clear_launch_cache()
        calls = record_launches(monkeypatch, "m_grouped")
        yield
        assert "M_GROUPED_TMA" not in [name for name, _ in calls], "TMA store launched"


class TestMGroupedTritonUniformM(MGroupedTest):
    """Every row tile BLOCK_M high (constrain(mixed_m=False, tail_split=False)): no half-high tiles. A spy
    fails any test whose launch had them on."""

    BACKEND = "triton"
    pytestmark = pytest.mark.gpu

    @pytest.fixture(autouse=True)
    def uniform(self, monkeypatch):
        from moegemm._src.torch import launch as _launch

        plan.constrain(mixed_m=False, tail_split=False)
        _launch.clear_launch_cache()
        self.calls = record_launches(monkeypatch, "m_grouped")
        yield
        for _, spec in self.calls:
            meta = _launch._m_launch(*spec).meta
            assert not meta["MIXED_M"] and not meta["TAIL_SPLIT"]
        _launch.clear_launch_cache()


def half_tile_launches(monkeypatch, tma: bool) -> tuple:
    """The half-high tile tests' setup: TMA loads as given (at any problem size), the per-tile loop (the flat
    one runs every tile full height) and the table's default config (128 rows on sm90), whatever the model
    would pick for their small problems. Returns (target, device name, that config, the recorded launches)."""
    from moegemm._src.torch import launch as _launch

    plan.constrain(tma_load=tma, tma_load_min_flops=0, flat=False)
    target, device_name, _ = _launch._target(torch.device(DEVICE))
    default = configs.candidates("m_grouped", target)[0]
    plan.constrain(config=lambda op, problem, target, picked: default if op == "m_grouped" else picked)
    return target, device_name, default, record_launches(monkeypatch, "m_grouped")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["transpose_w", "k-major"])
@pytest.mark.parametrize("tma", [False, True], ids=["cp-async", "tma-load"])
@pytest.mark.parametrize("K,N", [(96, 80), (88, 72)], ids=["16-element-rows", "16-byte-rows"])
def test_mixed_m_half_tiles_match_full_tiles(monkeypatch, layout, tma, K, N):
    """Groups whose last row tile has 1, BLOCK_M / 2 - 1, BLOCK_M / 2 (half-high tiles), BLOCK_M / 2 + 1
    and BLOCK_M - 1 rows (full tiles), an empty group and one hot expert: the same out with mixed tile
    heights as with every tile full height, and the launch must have had them on. On a GPU the two agree
    bitwise (each element's reduction runs in the same order in both tile heights)."""
    from moegemm._src.torch import launch as _launch

    target, _, default, calls = half_tile_launches(monkeypatch, tma)
    block_m = default.block_m
    assert m_grouped.mixed_m_fits(block_m, K, N, target == "interpret"), default
    half = block_m // 2
    sizes = [block_m + 1, 0, half - 1, block_m + half, 2 * block_m + half + 1, block_m - 1, 3 * block_m]
    M = sum(sizes) + 5
    x, w = make_inputs(M, K, N, len(sizes), torch.bfloat16, layout, seed=3)
    b = (torch.randn(len(sizes), N) + 3).to(dtype=torch.bfloat16, device=DEVICE)
    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    outs = {}
    for mixed in (True, False):
        plan.constrain(mixed_m=mixed)
        _launch.clear_launch_cache()
        outs[mixed] = m_grouped_mm(x, w, gs, bias=b)
        assert _launch._m_launch(*calls[-1][1]).meta["MIXED_M"] == mixed
    _launch.clear_launch_cache()
    assert_rel_close(outs[True].cpu(), want(x, w, sizes, b), torch.bfloat16, what=f"mixed-m {layout} {tma}")
    assert_rel_close(outs[True].cpu(), outs[False].cpu(), torch.bfloat16, what="mixed vs uniform")
    if DEVICE != "cpu":
        assert torch.equal(outs[True], outs[False])


def m_tiles_total(sizes: list[int], M: int, block_m: int, n_tiles: int) -> int:
    """Tiles of an m-grouped launch without a group offset, as m_grouped_mm_kernel lays them out: each
    group's row tiles, then the unowned rows' (zero-filled), times the column tiles."""
    return (sum(-(-s // block_m) for s in sizes) + -(-(M - sum(sizes)) // block_m)) * n_tiles


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["transpose_w", "k-major"])
@pytest.mark.parametrize("tma", [False, True], ids=["cp-async", "tma-load"])
@pytest.mark.parametrize("K,N", [(96, 80), (88, 72)], ids=["16-element-rows", "16-byte-rows"])
def test_tail_split_halves_match_whole_tiles(monkeypatch, layout, tma, K, N):
    """TAIL_SPLIT: the last, partial round's tiles run as two half-high halves each. The programs count is
    set so that round holds (by column tiles) the unowned rows' zero tile; also a group's 1-row last tile;
    also a full tile and a group's BLOCK_M / 2 - 1-row last tile (an empty lower half); and, on a launch of
    many empty groups, every tile (less than one round). Each launch must have TAIL_SPLIT on and a
    programs count under which the kernel's rule splits (2 x tail <= NUM_PROGRAMS), write every element of
    a NaN-poisoned out (unowned rows 0), match the oracle and, on a GPU, the whole-tile launch bitwise
    (whether the rule split is not visible in out: the halves compute what the whole tile would)."""
    from moegemm._src.torch import launch as _launch

    target, device_name, default, calls = half_tile_launches(monkeypatch, tma)
    bm, half = default.block_m, default.block_m // 2
    n_tiles = -(-N // default.block_n)
    rounds = [3 * bm, bm - 1, 2 * bm + half + 1, bm + half, half - 1, 0, bm + 1]
    sparse = [0, half - 1, 0, 0, bm - 1, 0, 0, 0]
    scenarios = [(rounds, tail * n_tiles) for tail in (1, 2, 4)] + [(sparse, None)]
    for sizes, tail in scenarios:
        M = sum(sizes) + 5
        total = m_tiles_total(sizes, M, bm, n_tiles)
        # One whole round of total - tail programs leaves `tail` tiles; None: more programs than tiles (the
        # launch caps them at its bound on the tile count, which is at least twice the tiles here).
        programs = total - tail if tail is not None else 1 << 20
        x, w = make_inputs(M, K, N, len(sizes), torch.bfloat16, layout, seed=len(sizes) + (tail or 0))
        if layout == "transpose_w":
            w, transpose_w = w.mT, True  # the [G, N, K] storage, as the autograd forward passes it
        else:
            transpose_w = False
        b = (torch.randn(len(sizes), N) + 3).to(dtype=torch.bfloat16, device=DEVICE)
        gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
        monkeypatch.setattr(
            _launch, "_target", lambda device, p=programs: plan.Target(target, device_name, p)
        )
        what = f"tail split {layout} {tma} sizes {sizes} tail {tail}"
        outs = {}
        for split in (True, False):
            plan.constrain(tail_split=split)
            _launch.clear_launch_cache()
            out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
            _launch.launch_m_grouped(x, w, gs, out, bias=b, transpose_w=transpose_w)
            meta = _launch._m_launch(*calls[-1][1]).meta
            assert meta["TAIL_SPLIT"] == split, what
            launched = meta["NUM_PROGRAMS"]
            assert (launched == programs and 2 * tail <= programs) or (tail is None and 2 * total <= launched)
            outs[split] = out
        assert not outs[True].isnan().any(), what
        assert torch.equal(outs[True][sum(sizes) :].cpu(), torch.zeros(5, N, dtype=torch.bfloat16)), what
        assert_rel_close(
            outs[True].cpu(), want(x, w.mT if transpose_w else w, sizes, b), torch.bfloat16, what=what
        )
        if DEVICE != "cpu":
            assert torch.equal(outs[True], outs[False]), what
    _launch.clear_launch_cache()


def test_flat_rule():
    """Where launches take the flat loop: TMA loads, no group offset, K <= FLAT_MAX_K, the ring and scratch of
    the config's CTAs fit an SM; then with neither mixed heights nor a split tail, and with the TMA store where
    the ring and the staging tile fit (128 x 256 at 3 stages: 208 KB)."""
    big = configs.MGroupedConfig(128, 256, 64)
    limit = m_grouped.FLAT_MAX_K

    def meta(K, tma_load=True, g_total=None, flat=True, config=big, tma_store=True):
        return m_grouped.MGroupedLaunch.make(
            4096, 2048, K, 8, config=config, num_programs_cap=132, fp32_inputs=False, interpret=False,
            tma_load=tma_load, tma_store=tma_store, mixed_m=True, tail_split=True, flat=flat, g_total=g_total,
        ).meta  # fmt: skip

    assert meta(limit)["FLAT"] and meta(64)["FLAT"]
    assert not meta(limit + 64)["FLAT"] and not meta(1024, tma_load=False)["FLAT"]
    assert not meta(1024, g_total=16)["FLAT"] and not meta(1024, flat=False)["FLAT"]
    # Two CTAs of 128 x 128 at 8 warps: 3 ring stages and 32 KB of scratch each do not fit an SM together.
    assert not meta(1024, config=configs.MGroupedConfig(128, 128, 64, 8, 8, 3, 2))["FLAT"]
    assert meta(1024, config=configs.MGroupedConfig(128, 128, 64, 8, 4, 3, 2))["FLAT"]
    on = meta(1024)
    assert on["TMA_STORE"] and not (on["MIXED_M"] or on["TAIL_SPLIT"]), on
    off = meta(1024, flat=False)
    assert off["MIXED_M"] and off["TAIL_SPLIT"] and off["TMA_STORE"], off
    # 4 stages of 128 x 256: the 192 KB ring fits the flat loop with its 32 KB scratch, not with a 64 KB staging.
    deep = meta(1024, config=configs.MGroupedConfig(128, 256, 64, 8, 8, 4))
    assert deep["FLAT"] and not deep["TMA_STORE"], deep
    # Beyond FLAT_MAX_K, up to FLAT_WHOLE_TILES_MAX_K: both loops compiled in, the group sizes picking; only with
    # TMA loads and the TMA store, without a group offset.
    whole, top = meta(2048), m_grouped.FLAT_WHOLE_TILES_MAX_K
    assert whole["FLAT_WHOLE_TILES"] and whole["TMA_STORE"] and whole["MIXED_M"] and whole["TAIL_SPLIT"], (
        whole
    )
    assert not whole["FLAT"] and meta(top)["FLAT_WHOLE_TILES"] and not meta(top + 64)["FLAT_WHOLE_TILES"]
    assert not any(
        m["FLAT_WHOLE_TILES"]
        for m in (
            meta(limit),
            meta(2048, flat=False),
            meta(2048, tma_store=False),
            meta(2048, tma_load=False),
        )
    )
    assert not meta(2048, g_total=16)["FLAT_WHOLE_TILES"]


def test_mixed_m_rule():
    """Where the GPU runs half-high tail tiles: 128-row configs, K <= MIXED_M_MAX_K, K and N multiples of 16
    (odd rows miscomputed on the H100, docs/design.md, 'Mixed tile heights'); the interpreter runs them on any
    tile."""
    from moegemm._src import configs
    from moegemm._src.kernels import m_grouped

    big, small = configs.MGroupedConfig(128, 256, 64), configs.MGroupedConfig(64, 256, 64)
    limit = m_grouped.MIXED_M_MAX_K

    def mixed(config, K, N, interpret=False, allowed=True):
        launch = m_grouped.MGroupedLaunch.make(
            4096, N, K, 8, config=config, num_programs_cap=132, fp32_inputs=False, interpret=interpret,
            mixed_m=allowed,
        )  # fmt: skip
        return launch.meta["MIXED_M"]

    assert mixed(big, 2048, 1408) and mixed(big, limit // 16 * 16, 16)
    assert not mixed(big, limit + 1, 1408) and not mixed(big, 4096, 1408)
    assert mixed(big, 2048, 1400) and mixed(
        big, 1000, 1400
    )  # 16-byte rows (docs/design.md, 'Unaligned rows')
    assert not mixed(big, 2048, 1402) and not mixed(big, 31, 17) and not mixed(small, 2048, 1408)
    assert not mixed(big, 2048, 1408, allowed=False)
    assert mixed(configs.MGroupedConfig(32, 32, 32), 31, 17, interpret=True)


@pytest.mark.parametrize("layout", ["transpose_w", "k-major"])
def test_staging_rule_sees_the_weight_layout(monkeypatch, layout):
    """The launcher asks plan.stage_rows with the misaligned operands' bytes and whether w is read K-contiguous
    (the forward's nn.Linear weight, whose as-given reads cost most: docs/design.md, 'Unaligned rows')."""
    from moegemm._src.torch import launch as _launch

    asked = []
    inner = plan.stage_rows

    def spy(staged_bytes, M, N, K, G, itemsize, **kw):
        asked.append((staged_bytes, M, N, K, G, kw))
        return inner(staged_bytes, M, N, K, G, itemsize, **kw)

    monkeypatch.setattr(plan, "stage_rows", spy)
    _launch.clear_launch_cache()
    x, w = make_inputs(40, 33, 24, 2, torch.bfloat16, layout)
    m_grouped_mm(x, w, torch.tensor([15, 25], device=DEVICE))
    ((staged_bytes, M, N, K, G, kw),) = asked
    # x [40, 33] and w (33-element rows for transpose_w; k-major w [2, 33, 24] has 48-byte rows) are misaligned.
    want_bytes = 2 * (40 * 33 + (2 * 24 * 33 if layout == "transpose_w" else 0))
    assert (staged_bytes, M, N, K, G) == (want_bytes, 40, 24, 33, 2)
    assert kw == {"k_contiguous_weight": layout == "transpose_w"}


def test_mixed_m_needs_aligned_rows(monkeypatch):
    """The PyTorch launcher allows half-high tiles only where x's, w's and out's rows are 16-byte aligned with
    unit inner strides: a column-major x launches without them; an x view with 36-element rows (72 bytes)
    launches without them as given and with them staged into aligned rows, as the same x contiguous does."""
    from moegemm._src.torch import launch as _launch

    calls = record_launches(monkeypatch, "m_grouped")
    wide = torch.randn(64, 36, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(2, 16, 32, device=DEVICE, dtype=torch.bfloat16)
    gs = torch.tensor([30, 34], device=DEVICE)
    column_major = wide[:, :32].T.contiguous().T
    for x, stage, want_mixed in (
        (column_major, None, False),
        (wide[:, :32], False, False),
        (wide[:, :32], True, True),
        (wide[:, :32].contiguous(), None, True),
    ):
        plan.constrain(tma_load=False, stage_rows=stage)
        out = m_grouped_mm(x, w.mT, gs)
        assert_rel_close(out.cpu(), want(x, w.mT, [30, 34]), torch.bfloat16, what=f"x stride {x.stride()}")
        assert _launch._m_launch(*calls[-1][1]).meta["MIXED_M"] == want_mixed, x.stride()
    _launch.clear_launch_cache()


@pytest.mark.gpu
@needs_cuda
def test_int64_addressing():
    """x with more than 2^31 elements: the last group's rows sit past the int32 element range."""
    M, K, N = 262_400, 8192, 64
    x = torch.zeros(M, K, device=DEVICE, dtype=torch.bfloat16)
    x[-512:].normal_()  # only the last groups' rows matter here; random data there, zero elsewhere
    w = torch.randn(2, N, K, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.zeros(M, N, device=DEVICE, dtype=torch.bfloat16)
    dy[-512:].normal_()
    gs = torch.tensor([M - 300, 300], device=DEVICE)
    out = m_grouped_mm(x, w.mT, gs)
    tail = slice(M - 512, M)
    assert_rel_close(out[tail].cpu(), want(x[tail], w.mT, [212, 300]), torch.bfloat16, what="int64 m_grouped")
    dw = k_grouped_mm(x, dy, gs)
    ref = torch.from_numpy(oracle.k_grouped_mm(x[tail].double().cpu(), dy[tail].double().cpu(), [212, 300]))
    assert_rel_close(dw.cpu(), ref, torch.float32, what="int64 k_grouped")


class TestMGroupedReference(MGroupedTest):
    BACKEND = "reference"
