"""m_grouped_mm against the fp64 reference, one test base run per execution mode."""

from __future__ import annotations

import pytest
import torch
from cases import edge_cases, empty_patterns, invalid_sizes
from conftest import DEVICE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moegemm.testing import assert_rel_close
from moegemm.torch import m_grouped_mm, m_grouped_mm_reference


def make_inputs(M, K, N, G, dtype, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype=dtype, device=DEVICE)
    if layout == "nn-linear":  # [G, N, K] storage seen as [G, K, N]: the fprop/dgrad sharing path
        w = torch.randn(G, N, K, generator=gen).to(dtype=dtype, device=DEVICE).mT
    else:
        w = torch.randn(G, K, N, generator=gen).to(dtype=dtype, device=DEVICE)
    return x, w


class MGroupedTest:
    BACKEND = "triton"

    def check(self, M, K, N, sizes, dtype=torch.bfloat16, layout="nn-linear", seed=0, bias=False):
        x, w = make_inputs(M, K, N, len(sizes), dtype, layout, seed)
        # Offset far from 0 so a bias added to a wrong (or unowned) row cannot hide in the tolerance.
        b = (torch.randn(len(sizes), N) + 3).to(dtype=dtype, device=DEVICE) if bias else None
        gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
        out = m_grouped_mm(x, w, gs, bias=b, backend=self.BACKEND)
        ref = m_grouped_mm_reference(x.cpu(), w.cpu(), gs.cpu(), None if b is None else b.cpu(),
                                     out_dtype=torch.float64, compute_dtype=torch.float64)  # fmt: skip
        assert out.dtype == dtype and out.shape == (M, N)
        what = f"m_grouped {self.BACKEND} M={M} K={K} N={N} {sizes} bias={bias}"
        assert_rel_close(out.cpu(), ref, dtype, what=what)
        owned = min(sum(max(s, 0) for s in sizes), M)
        assert torch.equal(out[owned:].cpu(), torch.zeros(M - owned, N, dtype=dtype)), "unowned rows not zero"
        return out

    @pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
    @pytest.mark.parametrize("name,M,K,N,sizes", edge_cases(), ids=[c[0] for c in edge_cases()])
    def test_edge_case(self, name, M, K, N, sizes, bias):
        self.check(M, K, N, sizes, bias=bias)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @pytest.mark.parametrize("layout", ["nn-linear", "k-major"])
    def test_dtype_and_layout(self, dtype, layout):
        self.check(83, 40, 36, [20, 0, 33, 30], dtype=dtype, layout=layout, seed=1)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    def test_bias_dtypes(self, dtype):
        self.check(83, 40, 36, [20, 0, 33, 25], dtype=dtype, seed=2, bias=True)

    def test_strided_bias(self):
        """A bias view with a row stride != N and a column stride != 1 (the epilogue's strided load)."""
        x, w = make_inputs(40, 24, 20, 3, torch.float32, "nn-linear")
        bias = torch.randn(20, 3, device=DEVICE).T  # [G, N] with strides (1, G)
        gs = torch.tensor([15, 0, 20], device=DEVICE)
        out = m_grouped_mm(x, w, gs, bias=bias, backend=self.BACKEND)
        ref = m_grouped_mm_reference(x.cpu(), w.cpu(), gs.cpu(), bias.cpu(), compute_dtype=torch.float64)
        assert_rel_close(out.cpu(), ref, torch.float32, what="strided bias")

    @pytest.mark.parametrize("pattern,sizes", empty_patterns(), ids=[p[0] for p in empty_patterns()])
    def test_every_empty_pattern(self, pattern, sizes):
        # Bias on: a group without rows, or the 4 spare rows, must not receive any bias row.
        self.check(40, 16, 16, sizes, bias=True)

    @pytest.mark.parametrize("name,M,sizes", invalid_sizes(), ids=[c[0] for c in invalid_sizes()])
    def test_invalid_sizes_clamp(self, name, M, sizes):
        x, w = make_inputs(M, 16, 24, len(sizes), torch.float32, "nn-linear")
        gs = torch.tensor(sizes, dtype=torch.int64, device=DEVICE)
        out = m_grouped_mm(x, w, gs, backend=self.BACKEND)
        ref = m_grouped_mm_reference(x.cpu(), w.cpu(), gs.cpu(), compute_dtype=torch.float64)
        assert_rel_close(out.cpu(), ref, torch.float32, what=name)

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


class TestMGroupedReference(MGroupedTest):
    BACKEND = "reference"
