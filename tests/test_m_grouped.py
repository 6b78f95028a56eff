"""m_grouped_mm against the numpy fp64 oracle, one test base run per execution mode.

Modes: TestMGroupedTriton runs the Triton kernels, compiled on a CUDA machine (marked ``gpu``: the
device runs ``pytest -m gpu``) and under the interpreter on CPU; TestMGroupedReference runs the
plain-torch twin. Both are checked against ``moegemm.testing.oracle``, which shares no code with either.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, needs_cuda, spy_store_paths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moegemm import shapes
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
    """2-byte outputs, whole-tile rows stored through a TMA descriptor over out [M, N] (the default where
    out allows one; the interpreter runs the same path), a group's partial last tile from registers. A
    spy fails any test whose launch did not take the path out's layout calls for."""

    BACKEND = "triton"
    pytestmark = pytest.mark.gpu

    @pytest.fixture(autouse=True)
    def spy(self, monkeypatch):
        from moegemm.torch import _launch

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
        """Groups of 1, 31, 33, 64 and 95 rows: whole tiles through the descriptor, each partial last
        tile masked so that it cannot write the next group's first rows, a hot expert's many tiles."""
        self.check(300, 48, 40, [1, 31, 33, 0, 64, 95, 70], bias=True)


class TestMGroupedTritonRegisterStore(MGroupedTest):
    """Every tile stored from registers (MOEGEMM_TMA_STORE=0, and every out no descriptor fits)."""

    BACKEND = "triton"
    pytestmark = pytest.mark.gpu

    @pytest.fixture(autouse=True)
    def no_tma_store(self, monkeypatch):
        from moegemm.torch import _launch

        monkeypatch.setattr(_launch, "TMA_STORE", False)
        monkeypatch.setattr(_launch.M_GROUPED_TMA, "launch", lambda *a: pytest.fail("TMA store launched"))
        yield


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
