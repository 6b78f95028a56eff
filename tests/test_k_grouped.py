"""k_grouped_mm against the fp64 reference, one test base run per execution mode."""

from __future__ import annotations

import pytest
import torch
from cases import edge_cases, empty_patterns, invalid_sizes
from conftest import DEVICE

from moegemm.testing import assert_rel_close
from moegemm.torch import k_grouped_mm, k_grouped_mm_reference


def make_inputs(M, K, N, dtype, seed=0, transposed=False):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=gen).to(dtype=dtype, device=DEVICE)
    b = torch.randn(M, N, generator=gen).to(dtype=dtype, device=DEVICE)
    if transposed:  # column-major a: the strided view the kernel must accept as is
        a = torch.randn(K, M, generator=gen).to(dtype=dtype, device=DEVICE).T
    return a, b


def reference(a, b, gs, **kw):
    return k_grouped_mm_reference(a.cpu(), b.cpu(), gs.cpu(), compute_dtype=torch.float64, out_dtype=torch.float64,
                                  **kw)  # fmt: skip


def live(sizes, M):
    """Which groups own at least one row under the clamping rules."""
    owned, flags = 0, []
    for s in sizes:
        s = max(s, 0)
        flags.append(min(owned + s, M) > min(owned, M))
        owned += s
    return flags


class KGroupedTest:
    BACKEND = "triton"

    def check(self, M, K, N, sizes, dtype=torch.bfloat16, out_dtype=torch.float32, transposed=False, seed=0):
        a, b = make_inputs(M, K, N, dtype, seed, transposed)
        gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
        out = k_grouped_mm(a, b, gs, out_dtype=out_dtype, backend=self.BACKEND)
        assert out.dtype == out_dtype and out.shape == (len(sizes), K, N)
        assert_rel_close(out.cpu(), reference(a, b, gs), out_dtype, what=f"k_grouped {self.BACKEND} {sizes}")
        for g, is_live in enumerate(live(sizes, M)):
            if not is_live:
                assert torch.equal(out[g].cpu(), torch.zeros(K, N, dtype=out_dtype)), f"empty group {g} not 0"
        return out

    @pytest.mark.parametrize("name,M,K,N,sizes", edge_cases(), ids=[c[0] for c in edge_cases()])
    def test_edge_case(self, name, M, K, N, sizes):
        self.check(M, K, N, sizes)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
    def test_dtypes(self, dtype, out_dtype):
        self.check(83, 40, 36, [20, 0, 33, 30], dtype=dtype, out_dtype=out_dtype, seed=1)

    def test_strided_a(self):
        self.check(77, 29, 35, [30, 0, 40], transposed=True)

    @pytest.mark.parametrize("pattern,sizes", empty_patterns(), ids=[p[0] for p in empty_patterns()])
    def test_every_empty_pattern(self, pattern, sizes):
        self.check(36, 16, 16, sizes)

    @pytest.mark.parametrize("name,M,sizes", invalid_sizes(), ids=[c[0] for c in invalid_sizes()])
    def test_invalid_sizes_clamp(self, name, M, sizes):
        a, b = make_inputs(M, 16, 24, torch.float32)
        gs = torch.tensor(sizes, dtype=torch.int64, device=DEVICE)
        out = k_grouped_mm(a, b, gs, backend=self.BACKEND)
        assert_rel_close(out.cpu(), reference(a, b, gs), torch.float32, what=name)

    def test_accumulate_into_main_grad(self):
        M, K, N, sizes = 60, 24, 20, [25, 0, 35]
        a, b = make_inputs(M, K, N, torch.bfloat16, seed=2)
        gs = torch.tensor(sizes, device=DEVICE)
        main_grad = torch.randn(3, K, N, device=DEVICE)
        start = main_grad.clone()
        k_grouped_mm(a, b, gs, out=main_grad, accumulate=True, backend=self.BACKEND)
        k_grouped_mm(a, b, gs, out=main_grad, accumulate=True, backend=self.BACKEND)
        want = start.cpu().double() + 2 * reference(a, b, gs)
        assert_rel_close(main_grad.cpu(), want, torch.float32, what="accumulate twice")
        assert torch.equal(main_grad[1], start[1]), "accumulating an empty group must leave out[g] unchanged"

    def test_out_without_accumulate_overwrites(self):
        a, b = make_inputs(40, 16, 16, torch.float16)
        gs = torch.tensor([0, 40], device=DEVICE)
        out = torch.full((2, 16, 16), float("nan"), device=DEVICE)
        k_grouped_mm(a, b, gs, out=out, backend=self.BACKEND)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert_rel_close(out.cpu(), reference(a, b, gs), torch.float32, what="out=")


class TestKGroupedTriton(KGroupedTest):
    BACKEND = "triton"


class TestKGroupedReference(KGroupedTest):
    BACKEND = "reference"
