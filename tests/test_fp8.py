"""FP8: quantize, m_grouped_mm and k_grouped_mm on quantized operands, and GroupedLinear's FP8 recipes.

One test base per op, run per execution mode as the BF16 tests are: the Triton kernels (compiled on
a GPU under ``pytest -m gpu``, the interpreter on CPU) and the plain-torch twins. Oracles:
- quantize: the kernel matches the twin bit for bit, and independently (numpy), every scale is
  amax / 448 of its block and data * scale is within half an FP8 step of x;
- GEMMs: an fp64 product of the dequantized operands (``moegemm.testing.oracle``), relerr <= 1e-3
  with an fp32 output (the issue's bound; measured ~1e-7 under the interpreter's exact products).
Inputs carry outliers (a few values 100x larger per row and per group), where scaling matters.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import BACKENDS, DEVICE, needs_cuda

from moegemm import shapes
from moegemm._src import fp8
from moegemm.testing import oracle
from moegemm.testing.accuracy import relerr
from moegemm.torch import (
    GroupedLinear,
    k_grouped_mm,
    k_grouped_mm_reference,
    m_grouped_mm,
    m_grouped_mm_reference,
    quantize_fp8,
)

RECIPES = list(fp8.RECIPES)
GEMM_TOL = 1e-3
# The op against its twin (dequantize, multiply in fp32): equal but for summation order under the interpreter;
# on the GPU the FP8 tensor cores keep fewer accumulator bits between promotions (up to 3.1e-4 on the H100).
TWIN_TOL = 1e-5 if DEVICE == "cpu" else 1e-3


def poison_storage(byte: int = 0xFF, mib: int = 64) -> None:
    """Fills mib MiB of fresh device storage with ``byte`` and frees it at once: the caching allocator hands
    that storage to the next allocations, so an element a kernel leaves unwritten reads as the poison (0xFF:
    NaN in every float dtype)."""
    torch.full((mib << 20,), byte, dtype=torch.uint8, device=DEVICE)


def outliers(M, K, seed, scale=1.0):
    """randn with a few entries 100x larger, in different rows and columns."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * scale
    idx = torch.randint(0, max(M * K, 1), (max(1, M * K // 200),), generator=gen)
    x.view(-1)[idx] *= 100
    return x


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


def fp8_rows(sizes, M):
    return oracle.rows(sizes, M)


class QuantizeTest:
    BACKEND = "triton"

    def quantize(self, x, recipe, sizes=None, **kw):
        gs = None if sizes is None else torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
        return quantize_fp8(x.to(DEVICE), recipe, group_sizes=gs, transpose=True, backend=self.BACKEND, **kw)

    @pytest.mark.parametrize("recipe", RECIPES)
    @pytest.mark.parametrize(
        "M,K,sizes",
        [
            (150, 200, [40, 0, 70, 25]),  # sum < M, an empty group, K not a multiple of 128
            (70, 33, [70, 0, 0]),  # one hot expert
            (64, 16, [0, 0]),  # every group empty: data 0, scales 1
            (45, 130, None),  # one group over all rows
            # K a multiple of 16: a different specialization, which the bundled ptxas miscompiled for
            # the tensorwise transposed copy on the H100 (see fp8_quantize_tiles_kernel).
            (96, 48, [10, 33, 0, 0, 31, 22]),
            (200, 256, [120, 0, 80]),
        ],
        ids=["skew-empty-tail", "one-hot", "all-empty", "ungrouped", "k48", "k256"],
    )
    def test_matches_twin_and_numpy(self, recipe, M, K, sizes):
        x = outliers(M, K, seed=M + K)
        q = self.quantize(x, recipe, sizes)
        r = quantize_fp8(
            x,
            recipe,
            group_sizes=None if sizes is None else torch.tensor(sizes),
            transpose=True,
            backend="reference",
        )
        assert torch.equal(as_bytes(q.data), as_bytes(r.data)), "data differs from the twin"
        assert torch.equal(q.scale.cpu(), r.scale), "scale differs from the twin"
        assert torch.equal(q.dequantize_t().cpu(), r.dequantize_t()), "transposed copy differs from the twin"
        self.check_semantics(x, q, recipe, sizes)

    def check_semantics(self, x, q, recipe, sizes):
        """Numpy, independent of the library: scales are block amax / 448; data * scale ~ x."""
        M, K = x.shape
        groups = fp8_rows(sizes if sizes is not None else [M], M)
        xn = x.numpy().astype(np.float32)
        owned = np.zeros(M, bool)
        for r in groups:
            owned[r.start : r.stop] = True
        want = np.where(owned[:, None], xn, 0)
        for name, deq in (("data", q.dequantize()), ("data_t", q.dequantize_t())):
            deq = deq.cpu().numpy()
            assert np.isfinite(deq).all(), f"{name}: non-finite values"
            # e4m3 keeps 3 mantissa bits: |error| <= 2^-4 |x| for normals, and half a subnormal step
            # (2^-10 scale) near 0; the scales are <= amax / 448 of the block.
            bound = np.abs(want) * 2.0**-4 + np.abs(want).max(initial=0) / 448 * 2.0**-9 * 4 + 1e-30
            bad = np.abs(deq - want) > bound
            assert not bad.any(), f"{name}: {bad.sum()} elements off, e.g. {np.argwhere(bad)[:3].tolist()}"
        s = q.scale.cpu().numpy()
        if recipe == "tensorwise":
            for g, r in enumerate(groups):
                amax = np.abs(xn[r.start : r.stop]).max(initial=0)
                assert s[g] == (np.float32(amax) / np.float32(448) if amax > 0 else 1), f"group {g} scale"
        elif recipe == "rowwise":
            amax = np.abs(xn).max(1)
            live = owned & (amax > 0)
            assert np.array_equal(s[live], amax[live] / np.float32(448)), "row scales"
            assert (s[~owned] == 1).all(), "rows past the last group: scale 1"
        else:
            for b in range(fp8.cdiv(K, 128)):
                amax = np.abs(xn[:, b * 128 : (b + 1) * 128]).max(1)
                live = owned & (amax > 0)
                assert np.array_equal(s[live, b], amax[live] / np.float32(448)), f"1x128 scales, block {b}"

    @pytest.mark.parametrize("recipe", RECIPES)
    @pytest.mark.parametrize(
        "N,K", [(72, 200), (130, 33), (64, 48)], ids=["k-unaligned", "n-unaligned", "aligned"]
    )
    def test_weight(self, recipe, N, K):
        w = torch.stack([outliers(N, K, seed=s) for s in range(3)])
        w[1] = 0  # an all-zero expert: scale 1, data 0, never inf/NaN
        q = quantize_fp8(w.to(DEVICE), recipe, transpose=True, backend=self.BACKEND)
        r = quantize_fp8(w, recipe, transpose=True, backend="reference")
        assert torch.equal(as_bytes(q.data), as_bytes(r.data)) and torch.equal(
            as_bytes(q.data_t), as_bytes(r.data_t)
        )
        assert torch.equal(q.scale.cpu(), r.scale) and torch.equal(q.scale_t.cpu(), r.scale_t)
        for deq in (q.dequantize().cpu(), q.dequantize_t().cpu()):
            assert torch.isfinite(deq).all() and (deq[1] == 0).all()
            assert relerr(deq, w) < 0.05
        assert (q.scale[1].cpu() == 1).all()

    @pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
    def test_formats(self, dtype):
        x = outliers(40, 48, seed=3)
        q = self.quantize(x, "blockwise", [40], dtype=dtype)
        assert q.data.dtype == dtype
        fmax = fp8.FP8_MAX[str(dtype).removeprefix("torch.")]
        assert q.data.float().abs().max().item() == fmax  # the block amax maps to the format's max
        assert relerr(q.dequantize().cpu(), x) < (0.04 if dtype == torch.float8_e4m3fn else 0.08)

    def test_check_refuses_non_finite(self):
        x = torch.randn(8, 16)
        x[3, 2] = float("inf")
        with pytest.raises(ValueError, match="inf/NaN"):
            self.quantize(x, "tensorwise", [8], check=True)


class GemmTest:
    BACKEND = "triton"

    def operands(self, recipe, M, K, N, sizes, seed=0):
        gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
        x = outliers(M, K, seed).to(DEVICE)
        dy = outliers(M, N, seed + 1).to(DEVICE)
        w = torch.stack([outliers(N, K, seed + 2 + g, 0.05) for g in range(len(sizes))]).to(DEVICE)
        kw = dict(transpose=True, backend=self.BACKEND)
        return (
            gs,
            quantize_fp8(x, recipe, group_sizes=gs, **kw),
            quantize_fp8(w, recipe, **kw),
            quantize_fp8(dy, recipe, group_sizes=gs, **kw),
        )

    def check_all(self, recipe, M, K, N, sizes, bias=False):
        gs, x_q, w_q, dy_q = self.operands(recipe, M, K, N, sizes)
        b = (torch.randn(len(sizes), N) + 3).to(DEVICE) if bias else None
        xd, wd, dyd = (t.dequantize(torch.float64).cpu() for t in (x_q, w_q, dy_q))
        out = m_grouped_mm(x_q, w_q, gs, bias=b, out_dtype=torch.float32, backend=self.BACKEND)
        want = oracle.m_grouped_mm(xd, wd.mT, sizes, None if b is None else b.double().cpu())
        err = relerr(out.cpu(), torch.from_numpy(want))
        assert err <= GEMM_TOL, f"fprop {recipe} {sizes}: relerr {err:.2e}"
        owned = min(sum(max(s, 0) for s in sizes), M)
        assert (out[owned:] == 0).all(), "rows past the last group must be 0"
        twin = m_grouped_mm_reference(x_q, w_q, gs, b, out_dtype=torch.float32)
        assert relerr(out.cpu(), twin.cpu()) <= TWIN_TOL, f"fprop {recipe}: the op and its twin differ"
        dx = m_grouped_mm(dy_q, w_q.t(), gs, out_dtype=torch.float32, backend=self.BACKEND)
        want = oracle.m_grouped_mm(dyd, w_q.t().dequantize(torch.float64).cpu().mT, sizes)
        err = relerr(dx.cpu(), torch.from_numpy(want))
        assert err <= GEMM_TOL, f"dgrad {recipe} {sizes}: relerr {err:.2e}"
        dw = k_grouped_mm(dy_q, x_q, gs, backend=self.BACKEND)
        want = oracle.k_grouped_mm(
            dy_q.dequantize_t(torch.float64).cpu(), x_q.dequantize_t(torch.float64).cpu(), sizes
        )
        err = relerr(dw.cpu(), torch.from_numpy(want))
        assert err <= GEMM_TOL, f"wgrad {recipe} {sizes}: relerr {err:.2e}"
        assert relerr(dw.cpu(), k_grouped_mm_reference(dy_q, x_q, gs).cpu()) <= TWIN_TOL, (
            f"wgrad {recipe}: twin"
        )
        for g, r in enumerate(oracle.rows(sizes, M)):
            if not len(r):
                assert (dw[g] == 0).all(), f"empty group {g}: dW must be exact zeros"
        return gs, x_q, dy_q

    @pytest.mark.parametrize("recipe", RECIPES)
    @pytest.mark.parametrize(
        "M,K,N,sizes",
        [
            (150, 200, 72, [40, 0, 70, 25]),
            (70, 33, 20, [70, 0, 0, 0]),
            (96, 40, 48, list(shapes.group_sizes(96, 6, seed=3, empty=2))),
            (20, 16, 16, [0, 0, 0]),
            (129, 130, 33, [64, 1, 64]),
        ],
        ids=["skew-empty-tail", "one-hot", "dirichlet", "all-empty", "odd-dims"],
    )
    def test_fprop_dgrad_wgrad(self, recipe, M, K, N, sizes):
        self.check_all(recipe, M, K, N, sizes)

    @pytest.mark.parametrize("recipe", RECIPES)
    def test_bias(self, recipe):
        self.check_all(recipe, 83, 40, 36, [20, 0, 33, 25], bias=True)

    @pytest.mark.parametrize("recipe", RECIPES)
    def test_wgrad_accumulates_into_main_grad(self, recipe):
        sizes = [30, 0, 41]
        gs, x_q, w_q, dy_q = self.operands(recipe, 80, 40, 24, sizes)
        main = torch.randn(3, 24, 40, device=DEVICE)
        main[1] = -0.0
        before = main.clone()
        k_grouped_mm(dy_q, x_q, gs, out=main, accumulate=True, backend=self.BACKEND)
        want = oracle.k_grouped_mm(
            dy_q.dequantize_t(torch.float64).cpu(),
            x_q.dequantize_t(torch.float64).cpu(),
            sizes,
            c=before.double().cpu(),
        )
        assert relerr(main.cpu(), torch.from_numpy(want)) <= GEMM_TOL
        assert torch.equal(as_bytes(main[1]), as_bytes(before[1])), (
            "an empty group's main_grad must be untouched"
        )

    @pytest.mark.parametrize("name,M,sizes", shapes.INVALID_SIZES, ids=[c[0] for c in shapes.INVALID_SIZES])
    def test_bad_sizes_are_clamped(self, name, M, sizes):
        """Device-side sizes that break the contract: the kernels clamp as the twins do."""
        gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
        x = outliers(M, 24, 0).to(DEVICE)
        w = torch.randn(len(sizes), 16, 24, device=DEVICE)
        results = []
        for backend in (self.BACKEND, "reference"):
            x_q = quantize_fp8(x, "blockwise", group_sizes=gs, transpose=True, backend=backend)
            w_q = quantize_fp8(w, "blockwise", transpose=True, backend=backend)
            out = m_grouped_mm(x_q, w_q, gs, out_dtype=torch.float32, backend=backend).cpu()
            results.append((out, k_grouped_mm(x_q, x_q, gs, backend=backend).cpu()))
        (out, dw), (want_out, want_dw) = results
        assert torch.isfinite(out).all() and torch.isfinite(dw).all(), (
            f"{name}: unwritten or garbage elements"
        )
        assert relerr(out, want_out) <= GEMM_TOL and relerr(dw, want_dw) <= GEMM_TOL, name

    def test_operand_errors(self):
        gs, x_q, w_q, dy_q = self.operands("blockwise", 40, 32, 16, [20, 20])
        with pytest.raises(ValueError, match="one recipe"):
            m_grouped_mm(quantize_fp8(torch.randn(40, 32, device=DEVICE), "rowwise"), w_q, gs)
        with pytest.raises(ValueError, match="transpose=True"):
            k_grouped_mm(
                quantize_fp8(torch.randn(40, 16, device=DEVICE), "blockwise", group_sizes=gs), x_q, gs
            )
        with pytest.raises(ValueError, match="same group_sizes"):
            k_grouped_mm(
                dy_q,
                quantize_fp8(
                    torch.randn(40, 32, device=DEVICE), "blockwise", group_sizes=gs.clone(), transpose=True
                ),
                gs,
            )
        with pytest.raises(ValueError, match="matching K"):
            m_grouped_mm(dy_q, w_q, gs)

    def test_mixed_operands_name_both(self):
        """An Fp8Tensor next to a high-precision tensor is refused, in either position, naming both."""
        gs, x_q, w_q, dy_q = self.operands("rowwise", 40, 32, 16, [20, 20])
        w = torch.randn(2, 32, 16, device=DEVICE)
        mix = r"x is an Fp8Tensor \(rowwise, torch.float8_e4m3fn, shape \(40, 32\)\) but w is a torch.float32 tensor"
        with pytest.raises(TypeError, match=mix):
            m_grouped_mm(x_q, w, gs, backend=self.BACKEND)
        with pytest.raises(TypeError, match=r"x is a torch.float32 tensor but w is an Fp8Tensor"):
            m_grouped_mm(torch.randn(40, 32, device=DEVICE), w_q, gs, backend=self.BACKEND)
        with pytest.raises(TypeError, match=r"a is a torch.float32 tensor but b is an Fp8Tensor"):
            k_grouped_mm(torch.randn(40, 16, device=DEVICE), x_q, gs, backend=self.BACKEND)
        with pytest.raises(TypeError, match="x is an Fp8Tensor .* but w is a torch.float32 tensor"):
            m_grouped_mm_reference(x_q, w, gs)
        with pytest.raises(ValueError, match="options of quantized operands"):
            m_grouped_mm(torch.randn(40, 32, device=DEVICE), w, gs, fast_accum=True, backend=self.BACKEND)
        with pytest.raises(ValueError, match="fast_accum is an option of quantized operands"):
            k_grouped_mm(
                torch.randn(40, 32, device=DEVICE), torch.randn(40, 8, device=DEVICE), gs, fast_accum=True
            )

    def test_wgrad_takes_the_operands_group_sizes(self):
        """Quantized wgrad operands carry their group sizes: group_sizes may be left out."""
        gs, x_q, _, dy_q = self.operands("rowwise", 40, 32, 16, [30, 0, 10])
        given = k_grouped_mm(dy_q, x_q, gs, backend=self.BACKEND)
        assert torch.equal(k_grouped_mm(dy_q, x_q, backend=self.BACKEND), given)

    def test_bias_gradient(self):
        """Of a quantized call, the bias is differentiable: dbias[g] = sum(dy[rows(g)], 0), in its dtype."""
        sizes = [20, 0, 15]
        gs, x_q, w_q, _ = self.operands("blockwise", 40, 32, 16, sizes)
        b = torch.randn(3, 16, device=DEVICE, requires_grad=True)
        dy = torch.randn(40, 16, device=DEVICE)
        m_grouped_mm(x_q, w_q, gs, bias=b, out_dtype=torch.float32, backend=self.BACKEND).backward(dy)
        want = torch.stack([dy[r.start : r.stop].sum(0) for r in oracle.rows(sizes, 40)])
        assert relerr(b.grad.cpu(), want.cpu()) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_quantize_transposed_only_matches_full(recipe, backend):
    """data=False (what GroupedLinear's forward uses after its GEMM) writes the same transposed copy
    and scales as the full call, and no data; tensorwise refuses it (its copy needs the data call's
    group scales)."""
    from moegemm._src.torch import ops as _ops

    sizes = [40, 0, 70, 25]
    x = outliers(150, 208, seed=7).to(DEVICE)
    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    full = _ops.quantize(x, gs, recipe, torch.float8_e4m3fn, True, len(sizes), backend)
    t_only = _ops.quantize(x, gs, recipe, torch.float8_e4m3fn, True, len(sizes), backend, False)
    assert t_only[0].numel() == 0 and t_only[1].numel() == 0, "data=False returns no data or scale"
    cols = sum(fp8.cdiv(s, 16) * 16 for s in sizes)
    blocks = sum(fp8.cdiv(s, 128) for s in sizes) if recipe == "blockwise" else len(sizes)
    assert torch.equal(as_bytes(t_only[2])[:, :cols], as_bytes(full[2])[:, :cols]), "data_t differs"
    assert torch.equal(t_only[3][:blocks].cpu(), full[3][:blocks].cpu()), "scale_t differs"
    with pytest.raises(ValueError, match="transposed copy only"):
        _ops.quantize(x, gs, "tensorwise", torch.float8_e4m3fn, True, len(sizes), backend, False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose", [True, False], ids=["pair", "data"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    "M,K,sizes",
    [
        # sum < M (rows past it count in no group), an empty group, 2 column tiles
        (150, 208, [40, 0, 70, 25]),
        (70, 33, [70, 0, 0]),  # one hot expert over several row tiles, K unaligned
        (64, 16, [0, 0]),  # every group empty: 0
        (45, 130, None),  # one group over all rows
        (0, 48, [0, 0, 0]),  # T = 0
        (600, 40, [520, 0, 60]),  # a group over several of the amax pass's row tiles
        (1100, 272, [600, 0, 500]),  # groups long enough for rowwise's pair kernel (plan.quantize_pair)
    ],
    ids=["skew-empty-tail", "one-hot", "all-empty", "ungrouped", "no-rows", "tall-group", "long-groups"],
)
def test_quantize_column_sums(M, K, sizes, recipe, transpose, backend, monkeypatch):
    """colsum[g] = sum(x[rows(g)], 0) against fp64 (the FP8 bias gradient), written over a poisoned buffer, in
    fp32 and bf16, with the quantize's outputs unchanged; tensorwise's amax pass and rowwise's transposed copy
    take it from their own read of x, the other paths from a launch of their own (docs/design.md, 'FP8 bias
    gradient')."""
    from moegemm._src.torch import ops as _ops

    x = (outliers(M, K, seed=11) if M else torch.zeros(0, K)).to(DEVICE)
    gs = None if sizes is None else torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    G = 1 if sizes is None else len(sizes)
    want = torch.zeros(G, K, dtype=torch.float64)
    for g, r in enumerate(oracle.rows(sizes or [M], M)):
        want[g] = x[r.start : r.stop].cpu().double().sum(0)
    from moegemm._src import plan
    from moegemm._src.torch import launch_fp8 as _launch_fp8

    launches, pairs = [], []
    real, pair = _ops.grouped_column_sums, _launch_fp8.QUANTIZE_PAIR.launch
    monkeypatch.setattr(_ops, "grouped_column_sums", lambda *a: launches.append(a) or real(*a))
    monkeypatch.setattr(_launch_fp8.QUANTIZE_PAIR, "launch", lambda *a: (pairs.append(a[0]), pair(*a)))
    # rowwise takes the pair kernel only where groups are long (the long-groups case), on sm90 with a checked ptxas
    takes_pair = (
        backend == "triton"
        and transpose
        and M > 0
        and K % 16 == 0
        and _launch_fp8._quantize_pair(recipe, True, True, M >= plan.ROWWISE_PAIR_MIN_ROWS * G, x.device)
    )
    plain = _ops.quantize_activation_views(x, gs, recipe, torch.float8_e4m3fn, transpose, backend)
    assert plain[4] is None and not launches
    pairs.clear()
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
        poison_storage()
        launches.clear()
        got = _ops.quantize_activation_views(
            x, gs, recipe, torch.float8_e4m3fn, transpose, backend, colsum_dtype=dtype
        )
        assert got[4].dtype == dtype and tuple(got[4].shape) == (G, K)
        err = relerr(got[4].cpu().double(), want) if want.norm() > 0 else got[4].abs().max().item()
        assert err <= tol, f"{dtype}: {err:.2e}"
        for name, a, b in zip(("data", "scale", "data_t", "scale_t"), got, plain):
            same = a is None or torch.equal(as_bytes(a.reshape(-1)), as_bytes(b.reshape(-1)))
            assert (a is None) == (b is None) and same, name
        assert bool(pairs) == takes_pair, f"{recipe}: pair launches {len(pairs)}"
        pairs.clear()
        fused = backend == "triton" and (recipe == "tensorwise" or (recipe == "rowwise" and transpose))
        # One group without a sizes tensor sums with torch.sum (no sizes made on the host).
        assert len(launches) == (0 if fused or sizes is None else 1), f"{recipe}: {len(launches)} launches"


def test_quantize_column_sums_refuses_other_launches():
    from moegemm._src.torch.launch_fp8 import launch_quantize_fp8

    x = torch.randn(20, 32, device=DEVICE)
    gs = torch.tensor([10, 10], dtype=torch.int32, device=DEVICE)
    q = torch.empty(20, 32, dtype=torch.float8_e4m3fn, device=DEVICE)
    s = torch.empty(20, device=DEVICE)
    qt = torch.empty(32, fp8.transposed_columns(20, 2), dtype=torch.float8_e4m3fn, device=DEVICE)
    st = torch.empty(2, 32, device=DEVICE)
    for recipe, t, colsum, match in (
        ("rowwise", (qt, st), torch.empty(2, 16, device=DEVICE), r"\[G, C\] = \(2, 32\).*got \(2, 16\)"),
        ("rowwise", (None, None), torch.empty(2, 32, device=DEVICE), "transposed copy None"),
        ("blockwise", (qt, st), torch.empty(2, 32, device=DEVICE), r"\(blockwise"),
    ):
        with pytest.raises(ValueError, match=match):
            launch_quantize_fp8(x, gs, recipe, q, s, *t, rows_per_group=20, G=2, colsum=colsum)


@pytest.mark.parametrize("colsum", [False, True], ids=["maxima", "maxima+colsum"])
@pytest.mark.parametrize(
    "M,K,sizes",
    [
        (150, 208, [40, 0, 70, 25]),  # rows past the sum, an empty group, 2 column tiles
        (600, 40, [520, 0, 60]),  # a group over several of the pass's row tiles
        (64, 16, [0, 0]),  # every group empty
        (45, 130, None),  # one group over all rows
        (6, 300, 3),  # a weight [3, 2, 300]: 3 uniform groups of 2 rows
    ],
    ids=["skew-empty-tail", "tall-group", "all-empty", "ungrouped", "weight"],
)
def test_rowwise_maxima_pass(M, K, sizes, colsum):
    """fp8_group_amax_kernel's ROWWISE run and grouped_columns_kernel (the rowwise pair quantize's first read):
    every grouped row's maximum per 128 columns, each group's column scales (the twin's scale_t, bit for bit) and,
    with colsum, its column sums against fp64, over poisoned buffers."""
    from moegemm._src.torch import launch_fp8 as _launch_fp8
    from moegemm._src.torch import ops as _ops

    x = outliers(M, K, seed=M + K).to(DEVICE)
    x[min(3, M - 1)] = 0.0  # a zero row
    uniform = isinstance(sizes, int)
    G = sizes if uniform else (1 if sizes is None else len(sizes))
    rows_per_group = M // G if uniform else M
    gs = None if uniform or sizes is None else torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    st = torch.full((G, K), float("nan"), device=DEVICE)
    sums = torch.full((G, K), float("nan"), device=DEVICE) if colsum else None
    # Freed at once: the maxima's buffers come from storage poisoned with 0x7f (3.4e38), which a stray read of
    # an unwritten partial turns into a wrong scale (a NaN poison would vanish in the GPU's max).
    poison_storage(0x7F)
    config, sms = _launch_fp8._quantize_config(x.device)
    bg = max(16, 1 << G.bit_length())
    sizes_arg = st if gs is None else gs  # an unread pointer for uniform groups, as the launcher passes
    rmax = _launch_fp8._group_amax(
        x, sizes_arg, gs is not None, st, sums, rows_per_group, G, bg, config, sms, 448.0, st=st
    ).cpu()
    _launch_fp8.clear_launch_cache()
    spans = [range(g * rows_per_group, (g + 1) * rows_per_group) for g in range(G)] if uniform else None
    spans = spans or list(oracle.rows(sizes or [M], M))
    xc = x.cpu()
    tiles = fp8.cdiv(K, 128)
    assert tuple(rmax.shape) == (tiles, M)
    for g, r in enumerate(spans):
        blocks = torch.nn.functional.pad(xc[r.start : r.stop].abs(), (0, tiles * 128 - K)).view(
            -1, tiles, 128
        )
        assert torch.equal(rmax[:, r.start : r.stop], blocks.amax(2).T), f"group {g}: row maxima"
        if colsum:
            want = xc[r.start : r.stop].double().sum(0)
            err = (sums[g].cpu().double() - want).norm() / max(want.norm(), 1e-30)
            assert err <= 1e-6, f"group {g}: column sums {err:.2e}"
    xt = xc.view(G, rows_per_group, K) if uniform else xc
    twin = _ops.quantize(
        xt, None if gs is None else gs.cpu(), "rowwise", torch.float8_e4m3fn, True, G, "reference"
    )
    assert torch.equal(as_bytes(st), as_bytes(twin[3].reshape(G, K))), "column scales differ from the twin's"


@pytest.mark.parametrize("backend", BACKENDS)
class TestQuantize(QuantizeTest):
    @pytest.fixture(autouse=True)
    def _backend(self, backend):
        self.BACKEND = backend


@pytest.mark.parametrize("write_q", [True, False], ids=["data", "data_t"])
@pytest.mark.parametrize("R, C, G", [(300, 40, 6), (32768, 7168, 32), (8192, 512, 256), (5, 4096, 1)])
def test_quantize_tiles_geometry_covers_every_tile(R, C, G, write_q):
    """The grid holds every row tile of any group sizes (each group's partial tile and the tail slot's),
    every column tile, and small problems get single-tile programs (at least 16 per SM where possible)."""
    from moegemm._src import configs
    from moegemm._src.kernels import quantize_fp8 as qk

    config, sms = configs.QuantizeConfig(), 132
    block_r, block_c, chunks, warps, grid = qk.tiles_geometry(R, C, G, qk.BLOCK_1X128, write_q, config, sms)
    expected = (config.q_rows, 128, config.num_warps) if write_q else (128, config.t_cols, config.t_warps)
    assert (block_r, block_c, warps) == expected
    rng = np.random.default_rng(R + G)
    for _ in range(50):
        sizes = rng.multinomial(int(rng.integers(0, R + 1)), rng.dirichlet(np.ones(G) * 0.3))
        row_tiles = sum(fp8.cdiv(int(s), block_r) for s in sizes) + fp8.cdiv(R - int(sizes.sum()), block_r)
        assert row_tiles <= grid[0]
    col_tiles = fp8.cdiv(C, block_c)
    assert grid[1] * chunks >= col_tiles > (grid[1] - 1) * chunks
    col_chunks = config.q_chunks if write_q else config.t_chunks
    assert chunks == col_chunks or grid[0] * grid[1] >= 16 * sms or chunks == 1
    if chunks < col_chunks:  # halved only while too few programs
        assert grid[0] * fp8.cdiv(col_tiles, 2 * chunks) < 16 * sms


@pytest.mark.parametrize(
    "R, C, G", [(16384, 2048, 128), (65536, 7168, 32), (255, 40, 1), (256, 40, 1), (0, 8, 4)]
)
def test_quantize_cols_geometry_picks_the_tile_by_mean_group_rows(R, C, G):
    """The rowwise transposed copy: the long-group tile from COL_LONG_MIN_ROWS rows a group on average, the short
    one below (qwen3-30b-fc1's 128 rows a group); a program per (group, column block) either way."""
    from moegemm._src import configs
    from moegemm._src.kernels import quantize_fp8 as qk

    config = configs.QuantizeConfig()
    block_r, block_c, warps, grid = qk.cols_geometry(R, C, G, config)
    long = R >= qk.COL_LONG_MIN_ROWS * G
    columns, rows, warps_short = config.col_short
    want = (config.col_rows, config.col_block, config.col_warps) if long else (rows, columns, warps_short)
    assert (block_r, block_c, warps) == want, (R, G)
    assert grid == (G * fp8.cdiv(C, block_c),)


@pytest.mark.parametrize(
    "R, C", [(32768, 7168), (16384, 2048), (5, 40), (0, 8), (3, 16384), (7, 16385), (2, 70000)]
)
def test_quantize_rows_geometry_holds_rows_whole_up_to_one_sweep_cols(R, C):
    """Rowwise data: a row up to one_sweep_cols wide is held whole (BLOCK_C covers it, one_sweep_elems elements a
    program, a warp per 2048 columns); wider rows take the two sweeps' tile. Every row has a program."""
    from moegemm._src import configs
    from moegemm._src.kernels import quantize_fp8 as qk

    config = configs.QuantizeConfig()
    block_r, block_c, one_sweep, warps, grid = qk.rows_geometry(R, C, config)
    assert one_sweep == (C <= config.one_sweep_cols)
    if one_sweep:
        assert C <= block_c < 2 * max(C, 1) and block_r * block_c == max(config.one_sweep_elems, block_c)
        assert warps == max(config.num_warps, block_c // 2048)
    else:
        assert (block_r, block_c, warps) == (config.sweep_rows, config.sweep_cols, config.num_warps)
    assert grid == (fp8.cdiv(R, block_r),) and grid[0] * block_r >= R


@pytest.mark.gpu
@pytest.mark.parametrize(
    "M, K, sizes",
    [(37, 200, [10, 0, 27]), (3, 16400, [2, 0, 1]), (20, 7168, None), (48, 16, [0, 48])],
    ids=["skew-empty", "wider-than-one-sweep", "dsv3-width", "k16"],
)
def test_quantize_rows_one_sweep_and_two_sweeps_write_the_twins_bytes(M, K, sizes, monkeypatch):
    """Rowwise data (the rows launch, no transposed copy) held whole and in two sweeps (forced by
    one_sweep_cols = 0): both write the twin's bytes and scales, rows past the last group 0 with scale 1."""
    import dataclasses

    from moegemm._src import configs, plan
    from moegemm._src.torch import launch_fp8

    x = outliers(M, K, seed=M + K).to(torch.bfloat16)
    gs = None if sizes is None else torch.tensor(sizes, dtype=torch.int32)
    want = quantize_fp8(x, "rowwise", group_sizes=gs, backend="reference")
    real = plan.quantize_config
    for one_sweep_cols in (configs.QuantizeConfig().one_sweep_cols, 0):
        monkeypatch.setattr(
            plan,
            "quantize_config",
            lambda t, c=one_sweep_cols: dataclasses.replace(real(t), one_sweep_cols=c),
        )
        launch_fp8.clear_launch_cache()
        got = quantize_fp8(
            x.to(DEVICE), "rowwise", group_sizes=None if gs is None else gs.to(DEVICE), backend="triton"
        )
        form = "one sweep" if one_sweep_cols else "two sweeps"
        assert torch.equal(as_bytes(got.data).cpu(), as_bytes(want.data)), (
            f"{form}: data differs from the twin"
        )
        assert torch.equal(got.scale.cpu(), want.scale), f"{form}: scales differ from the twin"
    monkeypatch.undo()
    launch_fp8.clear_launch_cache()


@pytest.mark.parametrize("write_q", [True, False], ids=["data", "data_t"])
@pytest.mark.parametrize("scaling", [0, 1, 2], ids=["tensor", "1x128", "128x128"])
def test_quantize_tile_shape_is_the_launch_tile(scaling, write_q):
    """tile_shape (the torch launcher's int64-offset decision uses it) is the tile tiles_geometry launches."""
    from moegemm._src import configs
    from moegemm._src.kernels import quantize_fp8 as qk

    for config in (configs.QuantizeConfig(), configs.QuantizeConfig(q_rows=256, t_cols=64)):
        shape = qk.tile_shape(scaling, write_q, config)
        assert shape == qk.tiles_geometry(300, 4096, 6, scaling, write_q, config, 132)[:2]
        if scaling == qk.BLOCK_128X128:
            assert shape == (128, 128)
        else:
            assert shape == ((config.q_rows, 128) if write_q else (128, config.t_cols))


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    "shape,sizes",
    [
        ((700, 208), [300, 0, 150, 21]),  # tail rows, an empty group, K not a multiple of 128
        ((1030, 7168), list(shapes.group_sizes(1000, 8, seed=3, empty=2))),
        ((640, 512), [0, 0, 640, 0]),  # one hot expert
        ((256, 48), [0, 0]),  # every group empty
        ((333, 1040), None),  # one group over all rows
        ((3, 200, 336), None),  # a weight [G, N, K]
        ((300, 200), [100, 0, 150]),  # K not a multiple of 16: the two launches
    ],
    ids=[
        "skew-empty-tail",
        "k7168-dirichlet",
        "one-hot",
        "all-empty",
        "ungrouped",
        "weight",
        "k200-unaligned",
    ],
)
def test_quantize_pair_writes_the_twins_bytes(shape, sizes, recipe, dtype, x_dtype, monkeypatch):
    """The one-read pair kernel (data and data_t from one read of x) writes the twin's bytes: data, scale, the
    transposed copy through each group's 16-aligned end and scale_t, into storage poisoned with 0x7f (NaN in
    e4m3). Runs where the plan takes it (a checked ptxas); a spy makes sure it ran where x's rows are 16-element
    aligned, and not elsewhere."""
    from moegemm._src import plan
    from moegemm._src.torch import launch_fp8 as _launch_fp8
    from moegemm._src.torch import ops as _ops

    if not _launch_fp8._quantize_pair(recipe, True, True, True, torch.device(DEVICE)):
        pytest.skip(f"the plan keeps two launches here (ptxas {_launch_fp8._ptxas_release()!r} not checked)")
    calls, launch = [], _launch_fp8.QUANTIZE_PAIR.launch
    monkeypatch.setattr(_launch_fp8.QUANTIZE_PAIR, "launch", lambda *a: (calls.append(a[0]), launch(*a)))
    monkeypatch.setattr(plan, "ROWWISE_PAIR_MIN_ROWS", 0)  # rowwise's short groups here take it too
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(shape, generator=gen) * 3
    x.view(-1)[:: max(1, x.numel() // 300)] *= 100  # outliers
    if x.dim() == 2:
        x[5] = 0.0  # a zero row: its scales are 1
        x[7] *= 1e-30  # a tiny amax
        x[9] *= 1e-38  # a subnormal scale: the reciprocal is capped, not inf
    x = x.to(x_dtype)
    G = len(sizes) if sizes is not None else (shape[0] if x.dim() == 3 else 1)
    gs = None if sizes is None else torch.tensor(sizes, dtype=torch.int32)
    want = _ops.quantize(x, gs, recipe, dtype, True, G, "reference")
    poison_storage(0x7F, mib=256)
    got = _ops.quantize(x.to(DEVICE), None if gs is None else gs.to(DEVICE), recipe, dtype, True, G, "triton")
    assert bool(calls) == (shape[-1] % 16 == 0), "the pair kernel runs where x's rows are aligned"
    with plan.constrained(plan.Constraints(quantize_pair=False)):
        two = _ops.quantize(
            x.to(DEVICE), None if gs is None else gs.to(DEVICE), recipe, dtype, True, G, "triton"
        )
    _launch_fp8.clear_launch_cache()
    if x.dim() == 3:
        Gw, N, K = shape
        cols = N
        data_cols, blocks = K, None
    else:
        M, K = shape
        cols = sum(fp8.cdiv(n, 16) * 16 for n in (sizes or [M]))
        data_cols = K
        blocks = sum(fp8.cdiv(n, 128) for n in (sizes or [M]))
    for name, a, b, c in zip(("data", "scale", "data_t", "scale_t"), got, want, two):
        if name == "data":
            a, b, c = (t[..., :data_cols] for t in (a, b, c))
        elif name == "data_t":
            a, b, c = (t[..., :cols] for t in (a, b, c))
        elif name == "scale_t" and blocks is not None and recipe == "blockwise":
            a, b, c = (t[:blocks] for t in (a, b, c))
        assert torch.equal(as_bytes(a), as_bytes(b)), f"{name} differs from the twin"
        assert torch.equal(as_bytes(a), as_bytes(c)), f"{name} differs from the two launches"


def test_quantize_pair_plan(monkeypatch):
    """The pair kernel runs only with both copies of 16-element aligned rows, on sm90 with Gluon, compiled by a
    checked ptxas, and for rowwise only on groups of ROWWISE_PAIR_MIN_ROWS rows on average; the constraint turns
    it off."""
    from moegemm._src import plan

    monkeypatch.setattr(plan, "PAIR_QUANTIZE_PTXAS", frozenset({"99.9"}))
    sm90, caps, release = plan.Target("sm90", "H100", 132), plan.Capabilities(gluon=True), "99.9"
    long, short = plan.ROWWISE_PAIR_MIN_ROWS, plan.ROWWISE_PAIR_MIN_ROWS - 1
    for recipe in RECIPES:
        assert plan.quantize_pair(recipe, True, True, True, long, sm90, caps, release)
        assert plan.quantize_pair(recipe, True, True, True, short, sm90, caps, release) == (
            recipe != "rowwise"
        )
        assert not plan.quantize_pair(recipe, False, True, True, long, sm90, caps, release), (
            "no transposed copy"
        )
        assert not plan.quantize_pair(recipe, True, False, True, long, sm90, caps, release), "data_t alone"
        assert not plan.quantize_pair(recipe, True, True, False, long, sm90, caps, release), (
            "rows not aligned"
        )
        assert not plan.quantize_pair(recipe, True, True, True, long, sm90, plan.JAX, release), "no Gluon"
        assert not plan.quantize_pair(recipe, True, True, True, long, plan.INTERPRET, caps, release)
        with plan.constrained(plan.Constraints(quantize_pair=False)):
            assert not plan.quantize_pair(recipe, True, True, True, long, sm90, caps, release)
        assert not plan.quantize_pair(recipe, True, True, True, long, sm90, caps, "12.0"), (
            "an unchecked ptxas"
        )


def test_quantize_pair_reads_the_ptxas_release(monkeypatch):
    """The release the plan checks is parsed from Triton's ptxas; a ptxas that cannot be asked gives "" (the
    two launches), not an error in the quantize."""
    import subprocess

    import triton.backends.nvidia.compiler as nvidia

    from moegemm._src.torch import launch_fp8 as _launch_fp8

    banner = "ptxas: NVIDIA (R) Ptx optimizing assembler\nCuda compilation tools, release 12.8, V12.8.93\n"
    for reply, want in ((banner, "12.8"), (subprocess.CalledProcessError(1, "ptxas"), ""), ("garbage", "")):

        def version(arch=80, reply=reply):
            if isinstance(reply, Exception):
                raise reply
            return reply

        monkeypatch.setattr(nvidia, "get_ptxas_version", version)
        _launch_fp8._ptxas_release.cache_clear()
        assert _launch_fp8._ptxas_release() == want
    _launch_fp8._ptxas_release.cache_clear()


@pytest.mark.parametrize("R, C, G", [(300, 40, 6), (32768, 7168, 32), (8192, 512, 256), (5, 4096, 1)])
def test_quantize_pair_geometry_covers_every_tile(R, C, G):
    """The pair grid holds every 128-row tile of any group sizes and every 128-column tile."""
    from moegemm._src import configs
    from moegemm._src.kernels import quantize_fp8 as qk

    config, sms = configs.QuantizeConfig(), 132
    chunks, grid = qk.pair_geometry(R, C, G, config, sms)
    rng = np.random.default_rng(R + G)
    for _ in range(50):
        sizes = rng.multinomial(int(rng.integers(0, R + 1)), rng.dirichlet(np.ones(G) * 0.3))
        row_tiles = sum(fp8.cdiv(int(s), 128) for s in sizes) + fp8.cdiv(R - int(sizes.sum()), 128)
        assert row_tiles <= grid[0]
    col_tiles = fp8.cdiv(C, 128)
    assert grid[1] * chunks >= col_tiles > (grid[1] - 1) * chunks
    assert chunks == config.pair_chunks or chunks == 1 or grid[0] * grid[1] >= 4 * sms


@pytest.mark.parametrize("backend", BACKENDS)
class TestGemm(GemmTest):
    @pytest.fixture(autouse=True)
    def _backend(self, backend):
        self.BACKEND = backend


def ws_spy(monkeypatch, launch_name: str, config=None) -> list:
    """Skips without Gluon on an sm90 GPU. Else returns the list that records the meta-parameters of every
    launch through ``_launch_fp8.<launch_name>`` (a warp-specialized kernel), with ``config`` forced for both
    warp-specialized kernels if given (launch caches cleared; callers clear them again after)."""
    from moegemm._src.torch import launch as _launch
    from moegemm._src.torch import launch_fp8 as _launch_fp8

    if not _launch._ws_device(torch.device(DEVICE)):
        pytest.skip("the warp-specialized kernel needs Gluon and an sm90 GPU")
    if config is not None:
        from moegemm._src import plan

        plan.constrain(
            config=lambda op, problem, target, picked: config if op.endswith("_fp8_ws") else picked
        )
        _launch_fp8.clear_launch_cache()
    direct = getattr(_launch_fp8, launch_name)
    calls, launch = [], direct.launch
    monkeypatch.setattr(direct, "launch", lambda *a: (calls.append(a[3]().launch.meta), launch(*a)))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    "M,K,N,sizes",
    [
        (300, 256, 384, [100, 0, 150, 20]),
        (257, 2880, 200, list(shapes.group_sizes(250, 6, seed=5, empty=2))),
        (640, 512, 264, [0, 0, 640, 0]),
        (64, 128, 128, [0, 0, 0]),
        (129, 48, 33, [64, 1, 64]),
    ],
    ids=["skew-empty-tail", "k2880-dirichlet", "one-hot", "all-empty", "odd-dims"],
)
def test_m_grouped_fp8_warp_specialized(recipe, block_n, M, K, N, sizes, monkeypatch):
    """The warp-specialized Gluon kernel (promoted mode on sm90, TMA loader), each tile width: fprop with bias
    (fp32 out: register stores; bf16 out: staging tiles, TMA stores where a consumer's 64 rows are in the
    group, masked row stores where they cross its end, or for every part with blockwise) and dgrad (bf16 out)
    against the fp64 oracle, into NaN-poisoned storage, rows past the groups exactly 0 (a tile's rows past its
    group load the next group's: the store drops them); a spy makes sure it is that kernel that ran, with the
    store the plan gives each out."""
    from moegemm._src import configs
    from moegemm._src.kernels import m_grouped_fp8_ws as ws
    from moegemm._src.torch import launch_fp8 as _launch_fp8

    calls = ws_spy(
        monkeypatch, "M_GROUPED_FP8_WS", configs.candidates("m_grouped_fp8_ws", "sm90")[block_n == 128]
    )
    try:
        gs, x_q, w_q, dy_q = GemmTest().operands(recipe, M, K, N, sizes, seed=block_n)
        b = (torch.randn(len(sizes), N) + 3).to(DEVICE)
        xd, wd, dyd = (t.dequantize(torch.float64).cpu() for t in (x_q, w_q, dy_q))
        want = torch.from_numpy(oracle.m_grouped_mm(xd, wd.mT, sizes, b.double().cpu()))
        owned = sum(sizes)
        for out_dtype, tol in ((torch.float32, GEMM_TOL), (torch.bfloat16, 4e-3)):  # 4e-3: bf16 rounding
            poison_storage()
            out = m_grouped_mm(x_q, w_q, gs, bias=b, out_dtype=out_dtype)
            assert relerr(out.float().cpu(), want) <= tol, f"fprop {recipe} {sizes} {out_dtype}"
            assert not torch.isnan(out).any(), "an element left unwritten"
            assert (out[owned:] == 0).all(), "rows past the last group must be 0"
        poison_storage()
        dx = m_grouped_mm(dy_q, w_q.t(), gs, out_dtype=torch.bfloat16)
        want = oracle.m_grouped_mm(dyd, w_q.t().dequantize(torch.float64).cpu().mT, sizes)
        assert relerr(dx.float().cpu(), torch.from_numpy(want)) <= 4e-3, f"dgrad {recipe} {sizes}"  # bf16 out
        assert not torch.isnan(dx).any() and (dx[owned:] == 0).all()
    finally:
        _launch_fp8.clear_launch_cache()
    # It takes contractions in 16-byte chunks: fprop's K, dgrad's N (the Triton kernel runs the rest).
    assert len(calls) == 2 * (K % 16 == 0) + (N % 16 == 0), "the warp-specialized kernel ran where it applies"
    # fp32 out: register stores; bf16 out: staging tiles, by TMA where out [M, n] has 16-byte rows (not
    # blockwise: rows).
    staged = lambda n: ws.STORE_TMA if recipe != "blockwise" and n % 8 == 0 else ws.STORE_ROWS  # noqa: E731
    want = [ws.STORE_REGISTERS, staged(N)] * (K % 16 == 0) + [staged(K)] * (N % 16 == 0)
    assert [meta["STORE"] for meta in calls] == want


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name,M,sizes", shapes.INVALID_SIZES, ids=[c[0] for c in shapes.INVALID_SIZES])
def test_m_grouped_fp8_warp_specialized_clamps_bad_sizes(name, M, sizes, recipe, monkeypatch):
    """Device-side sizes that break the contract: the warp-specialized kernel clamps as the twin does."""
    calls = ws_spy(monkeypatch, "M_GROUPED_FP8_WS")
    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    x = outliers(M, 128, 0).to(DEVICE)
    w = torch.randn(len(sizes), 128, 128, device=DEVICE)
    results = []
    for backend in ("triton", "reference"):
        x_q = quantize_fp8(x, recipe, group_sizes=gs, backend=backend)
        w_q = quantize_fp8(w, recipe, backend=backend)
        for out_dtype in (torch.float32, torch.bfloat16):  # register stores; staging tiles and TMA
            poison_storage()
            results.append(m_grouped_mm(x_q, w_q, gs, out_dtype=out_dtype, backend=backend).float().cpu())
    out, out_bf16, want, want_bf16 = results
    from moegemm._src.kernels import m_grouped_fp8_ws as ws

    staged = ws.STORE_ROWS if recipe == "blockwise" else ws.STORE_TMA
    assert [meta["STORE"] for meta in calls] == [ws.STORE_REGISTERS, staged], "the kernel, both stores"
    for got, ref, tol in ((out, want, GEMM_TOL), (out_bf16, want_bf16, 4e-3)):
        assert torch.isfinite(got).all(), f"{name}: unwritten or garbage elements"
        assert relerr(got, ref) <= tol, name


@pytest.mark.parametrize("case", shapes.SUITE, ids=[c.name for c in shapes.SUITE])
def test_m_grouped_fp8_warp_specialized_takes_the_suite(case):
    """Every suite shape's fprop and dgrad qualify for the warp-specialized kernel (a stride bound once
    counted the weight's group stride and silently sent every large problem to the Triton kernel), and
    blockwise always gets a config."""
    from moegemm._src import configs
    from moegemm._src.kernels import m_grouped_fp8_ws as ws

    if not ws.supported():
        pytest.skip("this Triton has no Gluon Hopper API")
    for K, N in ((case.K, case.N), (case.N, case.K)):  # fprop, dgrad
        assert ws.supported_problem(K, False, fp8.padded(max(K, N))), (case.name, K)
        config = configs.pick_fp8_ws_config(recipe="blockwise", G=case.G, N=N, K=K, M=case.M)
        assert config is not None and config.block_n in (128, 256)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode,out_dtype",
    [("store", torch.float32), ("accumulate", torch.float32), ("store", torch.bfloat16)],
    ids=["store", "accumulate", "store-bf16"],
)
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    "M,K,N,sizes",
    [
        (300, 256, 384, [100, 0, 150, 20]),
        (700, 200, 136, list(shapes.group_sizes(650, 6, seed=5, empty=2))),
        (640, 264, 512, [0, 0, 640, 0]),
        (64, 128, 128, [0, 0, 0]),
        (129, 48, 33, [64, 1, 64]),
        (2000, 320, 192, [900, 0, 1100]),
    ],
    ids=["skew-empty-tail", "dirichlet-odd-n", "one-hot", "all-empty", "odd-dims", "long-groups"],
)
def test_k_grouped_fp8_warp_specialized(recipe, block_n, mode, out_dtype, M, K, N, sizes, monkeypatch):
    """The warp-specialized Gluon wgrad (promoted mode on sm90; TMA loader, TMA store or reduce-add):
    dW [G, N, K] against the fp64 oracle of the dequantized transposed copies, into a NaN-poisoned
    buffer (every element written; fp32 or bf16) or accumulated into main_grad (an empty group's left
    bit-identical), each tile width. Odd N and the dirichlet case end out[g] inside a half tile (the
    register-store path); a spy makes sure it is that kernel that ran."""
    _check_k_grouped_fp8_ws(recipe, block_n, mode, out_dtype, M, K, N, sizes, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned-steps", "group-start-steps"])
@pytest.mark.parametrize("mode,out_dtype", [("store", torch.bfloat16), ("accumulate", torch.float32)])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize(
    "M,K,N,sizes",
    [(300, 256, 384, [100, 0, 150, 20]), (129, 48, 33, [64, 1, 64]), (2000, 320, 192, [900, 0, 1100])],
    ids=["skew-empty-tail", "odd-dims", "long-groups"],
)
def test_k_grouped_fp8_warp_specialized_step_alignment(
    aligned, mode, out_dtype, recipe, M, K, N, sizes, monkeypatch
):
    """Both step placements of the warp-specialized wgrad (``ALIGN_MIN_ROWS`` picks by the mean group size):
    steps from 128-byte aligned token columns, zeros before each group's first token (a box at a negative
    column), and steps from each group's first token."""
    from moegemm._src.kernels import k_grouped_fp8_ws
    from moegemm._src.torch import launch_fp8 as _launch_fp8

    monkeypatch.setattr(k_grouped_fp8_ws, "ALIGN_MIN_ROWS", 0 if aligned else 2**30)
    _launch_fp8.clear_launch_cache()  # launch descriptions are memoized on static facts
    _check_k_grouped_fp8_ws(recipe, 256, mode, out_dtype, M, K, N, sizes, monkeypatch)


def _check_k_grouped_fp8_ws(recipe, block_n, mode, out_dtype, M, K, N, sizes, monkeypatch):
    from moegemm._src import configs
    from moegemm._src.torch import launch_fp8 as _launch_fp8

    accumulate = mode == "accumulate"
    calls = ws_spy(
        monkeypatch, "K_GROUPED_FP8_WS", configs.candidates("k_grouped_fp8_ws", "sm90")[block_n == 256]
    )
    try:
        gs, x_q, w_q, dy_q = GemmTest().operands(recipe, M, K, N, sizes, seed=M)
        if accumulate:
            main = torch.randn(len(sizes), N, K, device=DEVICE)
        else:
            main = torch.full((len(sizes), N, K), float("nan"), device=DEVICE, dtype=out_dtype)
        before = main.clone()
        k_grouped_mm(dy_q, x_q, gs, out=main, accumulate=accumulate)
    finally:
        _launch_fp8.clear_launch_cache()
    want = oracle.k_grouped_mm(
        dy_q.dequantize_t(torch.float64).cpu(),
        x_q.dequantize_t(torch.float64).cpu(),
        sizes,
        c=before.double().cpu() if accumulate else None,
    )
    assert not torch.isnan(main).any(), "unwritten elements"
    tol = GEMM_TOL if out_dtype == torch.float32 else 4e-3  # bf16 rounding of dW: 2**-9 relative at most
    assert relerr(main.cpu().float(), torch.from_numpy(want)) <= tol, f"wgrad {recipe} {sizes}"
    for g, rows in enumerate(oracle.rows(sizes, M)):
        if not len(rows):
            if accumulate:
                assert torch.equal(as_bytes(main[g]), as_bytes(before[g])), f"empty group {g} was touched"
            else:
                assert (main[g] == 0).all(), f"empty group {g}: dW must be exact zeros"
    assert len(calls) == 1, "the warp-specialized wgrad ran"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name,M,sizes", shapes.INVALID_SIZES, ids=[c[0] for c in shapes.INVALID_SIZES])
def test_k_grouped_fp8_warp_specialized_clamps_bad_sizes(name, M, sizes, recipe, monkeypatch):
    """Device-side sizes that break the contract: the warp-specialized wgrad clamps as the twin does."""
    from moegemm._src import configs
    from moegemm._src.torch import launch_fp8 as _launch_fp8

    # These short groups would route tensorwise/rowwise stores to the Triton kernel.
    calls = ws_spy(monkeypatch, "K_GROUPED_FP8_WS", configs.candidates("k_grouped_fp8_ws", "sm90")[0])
    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    x = outliers(M, 136, 0).to(DEVICE)
    results = []
    for backend in ("triton", "reference"):
        x_q = quantize_fp8(x, recipe, group_sizes=gs, transpose=True, backend=backend)
        results.append(k_grouped_mm(x_q, x_q, gs, backend=backend).cpu())
    _launch_fp8.clear_launch_cache()
    out, want = results
    assert calls, "the warp-specialized wgrad did not run"
    assert torch.isfinite(out).all(), f"{name}: unwritten or garbage elements"
    assert relerr(out, want) <= GEMM_TOL, name


@pytest.mark.parametrize("case", shapes.SUITE, ids=[c.name for c in shapes.SUITE])
def test_k_grouped_fp8_warp_specialized_takes_the_suite(case):
    """Every suite shape's wgrad (dW [G, N, K] = dy_t @ x_t^T) qualifies for the warp-specialized
    kernel, many short groups included, with a config of either width."""
    from moegemm._src import configs
    from moegemm._src.kernels import k_grouped_fp8_ws as k_ws

    if not k_ws.supported():
        pytest.skip("this Triton has no Gluon Hopper API")
    row_stride = fp8.transposed_columns(case.M, case.G)
    assert k_ws.supported_problem(False, row_stride, case.N * case.K), case.name
    assert not k_ws.supported_problem(True, row_stride, case.N * case.K), (
        "an EP group offset takes the Triton kernel"
    )
    pick = functools.partial(
        configs.pick_fp8_ws_config, "k_grouped_fp8_ws", G=case.G, N=case.K, K=case.N, M=case.M
    )
    for recipe in fp8.RECIPES:
        for accumulate in (False, True):
            config = pick(recipe=recipe, accumulate=accumulate)
            # fp32 dW takes it; blockwise and every accumulating launch 128 wide (one part a tile: out's tile
            # read ahead into the staging tile).
            assert config is not None, (case.name, recipe, accumulate)
            narrow = recipe == "blockwise" or accumulate
            assert config.block_n == (128 if narrow else 256), (case.name, recipe, accumulate)
            # bf16 dW too, but never accumulated into (the Triton kernel sums in fp32 and rounds once).
            bf16 = pick(recipe=recipe, accumulate=accumulate, out_itemsize=2)
            assert (bf16 is not None) == (not accumulate), (case.name, recipe, accumulate)


def test_k_grouped_fp8_warp_specialized_takes_many_short_groups():
    """Many groups of few tokens take the warp-specialized wgrad (every recipe, bf16 and fp32 dW), now that its
    loader drains the copies through a descriptor before rewriting it (docs/design.md, 'Gluon ring protocol'). The
    plan for an sm90 launcher with Gluon, scratch and host descriptors."""
    from moegemm._src import plan
    from moegemm._src.kernels import k_grouped_fp8_ws as k_ws

    if not k_ws.supported():
        pytest.skip("this Triton has no Gluon Hopper API")
    target = plan.Target("sm90", "NVIDIA H100 80GB HBM3", 132)
    caps = plan.Capabilities(host_descriptors=True, global_scratch=True, gluon=True, workspace=True)
    K, N = 2048, 1536
    for M, G in [(16384, 128), (8192, 64), (65536, 128), (4096, 32), (300, 4)]:
        for recipe in fp8.RECIPES:
            for out_itemsize in (2, 4):
                M_t = fp8.transposed_columns(M, G)
                problem = plan.Problem(
                    plan.K_GROUPED, M, N, K, G, "float8_e4m3fn", max_stride=max(M_t, K * N), recipe=recipe,
                    ws_layout=True, tma_store_layout=True, row_strides=(M_t, M_t), out_span=K * N,
                    out_itemsize=out_itemsize,
                )  # fmt: skip
                chosen = plan.plan(problem, target, caps).kernel
                assert chosen == "k_grouped_fp8_ws", (M, G, recipe, out_itemsize, chosen)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_k_grouped_fp8_warp_specialized_takes_mixed_formats(recipe, monkeypatch):
    """dy in e5m2 beside an e4m3 x (TE's hybrid) through the warp-specialized wgrad: each operand's ring keeps its
    own format (one ring typed by the other operand gave NaN dW); against the fp64 oracle, a spy making sure it is
    that kernel that ran."""
    from moegemm._src import configs
    from moegemm._src.torch import launch_fp8 as _launch_fp8

    calls = ws_spy(monkeypatch, "K_GROUPED_FP8_WS", configs.candidates("k_grouped_fp8_ws", "sm90")[0])
    M, K, N = 300, 256, 384
    sizes = [100, 0, 150, 20]
    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    x_q = quantize_fp8(outliers(M, K, 3).to(DEVICE), recipe, group_sizes=gs, transpose=True)
    dy_q = quantize_fp8(
        outliers(M, N, 4).to(DEVICE), recipe, group_sizes=gs, transpose=True, dtype=torch.float8_e5m2
    )
    want = torch.from_numpy(
        oracle.k_grouped_mm(
            dy_q.dequantize_t(torch.float64).cpu(), x_q.dequantize_t(torch.float64).cpu(), sizes
        )
    )
    try:
        for out_dtype, tol in ((torch.float32, GEMM_TOL), (torch.bfloat16, 4e-3)):
            got = k_grouped_mm(dy_q, x_q, gs, out_dtype=out_dtype).cpu().float()
            assert torch.isfinite(got).all() and relerr(got, want) <= tol, (
                recipe,
                out_dtype,
                relerr(got, want),
            )
    finally:
        _launch_fp8.clear_launch_cache()
    assert len(calls) == 2, "the warp-specialized wgrad ran"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [16, 32, 64, 128])
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_k_grouped_fp8_default_route_matches_the_triton_kernel_with_short_groups(recipe, G, out_dtype):
    """The wgrad's default launch with 128 tokens a group on average (balanced and skewed) equals the Triton
    kernel's: the row- and blockwise warp-specialized launch computed 5-29% off at 64 and 128 such groups before
    its loader drained the copies through a descriptor it rewrites (H100, 2026-11-27)."""
    from moegemm._src import plan

    M, K, N = 128 * G, 1024, 1536
    for sizes in ([M // G] * G, shapes.group_sizes(M, G, seed=0)):
        gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
        gen = torch.Generator(device=DEVICE).manual_seed(G)
        x = torch.randn(M, K, device=DEVICE, generator=gen).to(torch.bfloat16)
        dy = torch.randn(M, N, device=DEVICE, generator=gen).to(torch.bfloat16)
        x_q = quantize_fp8(x, recipe, group_sizes=gs, transpose=True)
        dy_q = quantize_fp8(dy, recipe, group_sizes=gs, transpose=True)
        got = k_grouped_mm(dy_q, x_q, gs, out_dtype=out_dtype)
        with plan.constrain(fp8_ws=False):
            want = k_grouped_mm(dy_q, x_q, gs, out_dtype=out_dtype)
        assert relerr(got, want) <= 1e-2, (recipe, G, out_dtype, relerr(got, want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_operands_through_the_one_op(backend):
    """The public ops take Fp8Tensors: m_grouped_mm(quantize_fp8(x, ...), quantize_fp8(w, ...), gs) runs
    the FP8 kernel (the same bytes as the launch by hand) and k_grouped_mm the FP8 wgrad, into an fp32
    main_grad as well; the twins dequantize and agree."""
    from moegemm._src.torch import ops as _ops

    sizes = [30, 0, 26]
    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    x, w = outliers(64, 48, 1).to(DEVICE), torch.randn(3, 40, 48, device=DEVICE)
    x_q = quantize_fp8(x, "rowwise", group_sizes=gs, transpose=True, backend=backend)
    w_q = quantize_fp8(w, "rowwise", backend=backend)
    out = m_grouped_mm(x_q, w_q, gs, backend=backend)
    by_hand = _ops.m_grouped_fp8(
        x_q.data, x_q.scale, w_q.data, w_q.scale, gs, None, "rowwise", torch.bfloat16, False, backend
    )
    assert out.dtype == torch.bfloat16 and torch.equal(as_bytes(out), as_bytes(by_hand))
    twin = m_grouped_mm_reference(x_q, w_q, gs, out_dtype=torch.float32)
    assert relerr(out.float().cpu(), twin.cpu()) <= 4e-3  # bf16 out
    main = torch.randn(3, 48, 48, device=DEVICE)
    main[1] = -0.0
    before = main.clone()
    with torch.no_grad():
        k_grouped_mm(x_q, x_q, gs, out=main, accumulate=True, backend=backend)
    want = k_grouped_mm_reference(x_q, x_q, gs, out=before.clone(), accumulate=True)
    assert relerr(main.cpu(), want.cpu()) <= TWIN_TOL
    assert torch.equal(as_bytes(main[1]), as_bytes(before[1])), "an empty group's main_grad was touched"


def test_quantized_ops_compile_fullgraph():
    """quantize_fp8, m_grouped_mm and k_grouped_mm on quantized operands trace as custom ops."""
    sizes = [20, 0, 24]
    x, w, dy = (
        outliers(48, 32, 1).to(DEVICE),
        torch.randn(3, 16, 32, device=DEVICE),
        outliers(48, 16, 2).to(DEVICE),
    )
    b = torch.randn(3, 16, device=DEVICE, requires_grad=True)

    def step(x, w, dy, gs):
        x_q = quantize_fp8(x, "blockwise", group_sizes=gs, transpose=True)
        w_q = quantize_fp8(w, "blockwise", transpose=True)
        dy_q = quantize_fp8(dy, "blockwise", group_sizes=gs, transpose=True)
        y = m_grouped_mm(x_q, w_q, gs, bias=b, out_dtype=torch.float32)
        return y, m_grouped_mm(dy_q, w_q.t(), gs), k_grouped_mm(dy_q, x_q, gs)

    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    eager = step(x, w, dy, gs)
    eager[0].sum().backward()
    grad, b.grad = b.grad, None
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, w, dy, gs)
    compiled[0].sum().backward()
    for name, got, want in zip(("y", "dx", "dw", "dbias"), (*compiled, b.grad), (*eager, grad)):
        assert torch.equal(got, want), name


# ---------------------------------------------------------------- GroupedLinear(fp8_recipe=...)

SIZES = [20, 0, 25]


def fp8_pair(recipe, backend, **kw):
    """An FP8 GroupedLinear and a high-precision one with the same parameters."""
    torch.manual_seed(0)
    ref = GroupedLinear(3, 40, 24, dtype=torch.float32, device=DEVICE, backend="reference")
    module = GroupedLinear(
        3, 40, 24, dtype=torch.float32, device=DEVICE, backend=backend, fp8_recipe=recipe, **kw
    )
    module.load_state_dict(ref.state_dict())
    return module, ref


def run_step(module, x, dy, **kw):
    x = x.detach().clone().requires_grad_()
    y = module(x, torch.tensor(SIZES, device=DEVICE), **kw)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_fp8_matches_its_quantized_math(recipe, backend):
    """Every gradient equals the FP8 ops run by hand (and the high-precision module within FP8 error)."""
    module, ref = fp8_pair(recipe, backend)
    x, dy = outliers(50, 40, 1).to(DEVICE), outliers(50, 24, 2).to(DEVICE)
    y, dx = run_step(module, x, dy)
    y_hp, dx_hp = run_step(ref, x, dy)
    gs = torch.tensor(SIZES, device=DEVICE)
    x_q = quantize_fp8(x, recipe, group_sizes=gs, transpose=True, backend=backend)
    w_q = quantize_fp8(module.weight.detach(), recipe, transpose=True, backend=backend)
    dy_q = quantize_fp8(dy, recipe, group_sizes=gs, transpose=True, backend=backend)
    want_y = m_grouped_mm(
        x_q, w_q, gs, bias=module.bias.detach(), out_dtype=torch.float32, fast_accum=True, backend=backend
    )
    want_dx = m_grouped_mm(dy_q, w_q.t(), gs, out_dtype=torch.float32, backend=backend)
    want_dw = k_grouped_mm(dy_q, x_q, gs, backend=backend)
    for name, got, want in (("y", y, want_y), ("dx", dx, want_dx), ("dw", module.weight.grad, want_dw)):
        assert relerr(got.cpu(), want.cpu()) <= 1e-5, f"{recipe} {name}"
    assert relerr(module.bias.grad.cpu(), ref.bias.grad.cpu()) <= 1e-6, "dbias is high precision"
    for name, got, want in (("y", y, y_hp), ("dx", dx, dx_hp), ("dw", module.weight.grad, ref.weight.grad)):
        err = relerr(got.cpu(), want.cpu())
        assert 1e-4 < err < 0.08, (
            f"{recipe} {name}: quantization error {err:.2e} vs the high-precision module"
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_linear_fp8_weight_cache(backend):
    module, _ = fp8_pair("blockwise", backend)
    x, dy = outliers(50, 40, 1).to(DEVICE), outliers(50, 24, 2).to(DEVICE)
    y1, _ = run_step(module, x, dy)
    cached = module._fp8_weight.storage
    run_step(module, x, dy)
    assert module._fp8_weight.storage is cached, "an unchanged weight must reuse its quantized copy"
    with torch.no_grad():
        module.weight.mul_(2)  # an optimizer step: in place, bumps the version counter
    y2, _ = run_step(module, x, dy)
    assert module._fp8_weight.storage is not cached, "a stale FP8 weight was reused"
    # Blockwise scales of 2w are exactly twice those of w, with the same data: y - bias doubles.
    bias_rows = torch.cat(
        [module.bias.detach()[g].expand(n, -1) for g, n in enumerate(SIZES)]
        + [torch.zeros(5, 24, device=DEVICE)]
    )
    assert relerr((y2 - bias_rows).cpu(), 2 * (y1 - bias_rows).cpu()) < 1e-5
    stale = module._fp8_weight.storage
    with torch.no_grad():
        module.weight.mul_(0.5)
    run_step(module, x, dy, is_first_microbatch=False)
    assert module._fp8_weight.storage is stale, "is_first_microbatch=False reuses the copy unchecked"
    run_step(module, x, dy, is_first_microbatch=True)
    assert module._fp8_weight.storage is not stale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_grouped_linear_fp8_delay_and_main_grad(backend, fuse):
    module, _ = fp8_pair("rowwise", backend, fuse_wgrad_accumulation=fuse)
    plain, _ = fp8_pair("rowwise", backend)
    x, dy = outliers(50, 40, 1).to(DEVICE), outliers(50, 24, 2).to(DEVICE)
    if fuse:
        module.weight.main_grad = torch.zeros(3, 24, 40, device=DEVICE)
    run_step(plain, x, dy)
    module.delay_wgrad_compute = True
    run_step(module, x, dy)
    module.backward_dw()
    got = module.weight.main_grad if fuse else module.weight.grad
    assert relerr(got.cpu(), plain.weight.grad.cpu()) <= 1e-6
    assert relerr(module.bias.grad.cpu(), plain.bias.grad.cpu()) <= 1e-6


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_fp8_step_order_keeps_one_copy_alive(recipe, monkeypatch):
    """The order that bounds the step's memory: the forward quantizes x's data, runs the
    GEMM, and only then (rowwise, blockwise) x's transposed copy; the backward runs the wgrad before the
    dgrad, with dy's transposed copy released in between (its storage freed before dx is allocated)."""
    import gc
    import weakref

    from moegemm._src.torch import ops as _ops

    events = []
    quantize, m_grouped, k_out = _ops.quantize, _ops.m_grouped_fp8, _ops.k_grouped_fp8_out

    def spy_quantize(x, gs, recipe_, dtype, transpose, G, backend, data=True, colsum_dtype=None):
        parts = quantize(x, gs, recipe_, dtype, transpose, G, backend, data, colsum_dtype)
        events.append(("quantize", transpose, data))
        if x.dim() == 2 and x.shape[1] == 24 and transpose:  # dy: watch its transposed copy's storage
            events.append(("dy_t", weakref.ref(parts[2])))
        return parts

    def spy_m_grouped(*args):
        alive = [e[1]() is not None for e in events if e[0] == "dy_t"]
        events.append(("m_grouped", alive))
        return m_grouped(*args)

    def spy_k_out(*args):
        events.append(("k_grouped",))
        return k_out(*args)

    monkeypatch.setattr(_ops, "quantize", spy_quantize)
    monkeypatch.setattr(_ops, "m_grouped_fp8", spy_m_grouped)
    monkeypatch.setattr(_ops, "k_grouped_fp8_out", spy_k_out)
    module, _ = fp8_pair(recipe, "reference", fuse_wgrad_accumulation=True)
    module.weight.main_grad = torch.zeros(3, 24, 40, device=DEVICE)
    module(outliers(50, 40, 1).to(DEVICE).requires_grad_(), torch.tensor(SIZES, device=DEVICE))
    gc.collect()
    steps = [e[:3] if e[0] == "quantize" else e[:1] for e in events if e[0] != "dy_t"]
    split = recipe != "tensorwise"
    forward = [("quantize", True, True)] if not split else [("quantize", False, True)]
    forward += [("m_grouped",)] + ([("quantize", True, False)] if split else [])
    assert steps[-len(forward) :] == forward, steps
    events.clear()
    x = outliers(50, 40, 1).to(DEVICE).requires_grad_()
    module(x, torch.tensor(SIZES, device=DEVICE)).backward(outliers(50, 24, 2).to(DEVICE))
    names = [e[0] for e in events]
    assert names.index("k_grouped") < len(names) - 1 - names[::-1].index("m_grouped"), names
    dgrad_alive = [e[1] for e in events if e[0] == "m_grouped"][-1]
    assert dgrad_alive == [False], "dy's transposed copy was still alive when dgrad ran"


@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_grouped_linear_fp8_eager_skips_custom_op_dispatch(fuse, monkeypatch):
    """Eager FP8 fwd+bwd launches directly, as the BF16 path does: the custom ops are for tracing."""
    from moegemm._src.torch import ops as _ops

    def traced_only(*args, **kwargs):
        raise AssertionError("an eager GroupedLinear call went through a torch.library custom op")

    for name in ("m_grouped_mm_op", "k_grouped_mm_op", "k_grouped_mm_out_op", "quantize_fp8_op"):
        monkeypatch.setattr(_ops, name, traced_only)
    module, _ = fp8_pair("rowwise", "reference", fuse_wgrad_accumulation=fuse)
    if fuse:
        module.weight.main_grad = torch.zeros(3, 24, 40, device=DEVICE)
    _, dx = run_step(module, outliers(50, 40, 1).to(DEVICE), outliers(50, 24, 2).to(DEVICE))
    assert dx is not None and module.bias.grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_linear_fp8_out_view_and_e5m2(backend):
    """out= a view of a differentiable buffer, dy in e5m2 (TE's hybrid): x, weight, bias and the
    buffer's other rows all get their gradients."""
    module, _ = fp8_pair("tensorwise", backend, fp8_grad_dtype=torch.float8_e5m2)
    plain, _ = fp8_pair("tensorwise", backend, fp8_grad_dtype=torch.float8_e5m2)
    x, dy = outliers(50, 40, 1).to(DEVICE), outliers(50, 24, 2).to(DEVICE)
    y_want, dx_want = run_step(plain, x, dy)
    base = torch.randn(60, 24, device=DEVICE, requires_grad=True)
    buf = base * 1.0
    xin = x.clone().requires_grad_()
    y = module(xin, torch.tensor(SIZES, device=DEVICE), out=buf[5:55])
    (
        buf * torch.cat([torch.ones(5, 24, device=DEVICE), dy, torch.ones(5, 24, device=DEVICE)])
    ).sum().backward()
    assert torch.equal(y.detach(), y_want)
    assert relerr(xin.grad.cpu(), dx_want.cpu()) <= 1e-6
    assert relerr(module.weight.grad.cpu(), plain.weight.grad.cpu()) <= 1e-6
    assert (base.grad[5:55] == 0).all() and (base.grad[:5] == 1).all() and (base.grad[55:] == 1).all()


def test_grouped_linear_fp8_compile_fullgraph():
    module, _ = fp8_pair("blockwise", "auto")
    x, dy = outliers(50, 40, 1).to(DEVICE), outliers(50, 24, 2).to(DEVICE)
    y_eager, dx_eager = run_step(module, x, dy)
    dw_eager = module.weight.grad.clone()
    module.weight.grad = None
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    y, dx = run_step(compiled, x, dy)
    assert relerr(y.cpu(), y_eager.cpu()) <= 1e-6 and relerr(dx.cpu(), dx_eager.cpu()) <= 1e-6
    assert relerr(module.weight.grad.cpu(), dw_eager.cpu()) <= 1e-6


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_fp8_cuda_graph_replay(recipe):
    """Capture once, replay with new device-side sizes and inputs: the same as eager each time."""
    module, _ = fp8_pair(recipe, "auto")
    module = module.to(torch.bfloat16)
    gs = torch.tensor(SIZES, device="cuda", dtype=torch.int32)
    x = torch.randn(50, 40, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            module(x, gs).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    module.weight.grad = x.grad = None
    with torch.cuda.graph(graph):
        y = module(x, gs)
        y.sum().backward()
    for sizes in ([50, 0, 0], [10, 30, 5], [0, 0, 49]):
        gs.copy_(torch.tensor(sizes))
        x.data.copy_(torch.randn(50, 40, device="cuda"))
        graph.replay()
        got_y, got_dx = y.clone(), x.grad.clone()
        x2 = x.detach().clone().requires_grad_()
        want = module(x2, gs, is_first_microbatch=False)
        want.sum().backward()
        assert torch.equal(got_y, want.detach()) and torch.equal(got_dx, x2.grad), f"replay {sizes}"


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: torch.optim.AdamW([p], lr=0.5, fused=True),
        lambda p: torch.optim.SGD([p], lr=0.5, momentum=0.9),
        lambda p: torch.optim.AdamW([p], lr=0.5, foreach=True),
    ],
    ids=["adamw-fused", "sgd-momentum", "adamw-foreach"],
)
def test_weight_cache_requantizes_after_every_optimizer_step(make_optimizer):
    """A fused optimizer writes the weight without bumping its _version (torch._fused_adamw_): the cache still
    makes a new FP8 copy after each step, equal to a fresh quantize of the updated weight, and keeps it across the
    step's micro-batches. Before the optimizer-step count was in its key, the fused cases served the first copy
    for the rest of training."""
    from moegemm.torch import Fp8WeightCache

    w = torch.nn.Parameter(torch.randn(2, 32, 64, dtype=torch.bfloat16))
    opt, cache = make_optimizer(w), Fp8WeightCache()
    for _ in range(3):
        first = cache.get(w, "tensorwise", "reference")
        assert cache.get(w, "tensorwise", "reference") is first  # micro-batches of one step share it
        fresh = Fp8WeightCache().get(w, "tensorwise", "reference")
        assert torch.equal(first[0].view(torch.uint8), fresh[0].view(torch.uint8))
        assert torch.equal(first[1], fresh[1])
        w.grad = torch.randn_like(w)
        opt.step()
    assert not torch.equal(
        cache.get(w, "tensorwise", "reference")[0].view(torch.uint8), first[0].view(torch.uint8)
    )
