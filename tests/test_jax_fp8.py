"""FP8 in JAX (moegemm.jax.fp8): quantize, scaled GEMMs and the differentiable ragged_dot_fp8.

One base class per backend as in test_jax.py: "triton" (compiled, ``pytest -m gpu``), "interpret"
(the same launch descriptions through the Triton interpreter; outputs start as NaN, so an unwritten
element fails), "reference" (the jnp twin). GEMMs are checked against an fp64 numpy product of the
dequantized operands (relerr <= 1e-5 in fp32 output: the FP8 products are exact, only the fp32
accumulation order differs), quantize against the jnp twin bit for bit. Inputs carry outliers (a
few values 100x larger, in one row and in one group), where per-tensor scaling loses precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moegemm._src import fp8
from moegemm._src.jax import interpret as _interpret
from moegemm._src.jax import jax_triton as _jax_triton
from moegemm._src.layout import group_bounds
from moegemm.jax import fp8 as jfp8
from moegemm.jax import reference_fp8

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

RECIPES = fp8.RECIPES
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
EXACT = 1e-5  # fp32 output of exact FP8 products: accumulation order only

# (name, M, K, N, group sizes): empty groups, a hot expert, sums below M, K off 128 and off 16.
CASES = [
    ("mixed", 70, 72, 40, [20, 0, 33, 10]),
    ("one_hot_expert", 48, 136, 24, [0, 48, 0]),
    ("sum_below_m", 50, 40, 17, [5, 0, 12]),
    ("all_empty", 9, 32, 16, [0, 0]),
    ("k_over_128", 33, 200, 24, [17, 16]),
]


def _inputs(seed, M, K, N, G, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((G, K, N)).astype(np.float32) / np.sqrt(K)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    if M > 3:
        x[3, : K // 3] *= 100.0  # an outlier row
        dy[M // 2 :, 1] *= 100.0  # an outlier column in the later groups
    w[0, :, : N // 2] *= 100.0  # an outlier expert block
    return (jnp.asarray(a, dtype) for a in (x, w, dy))


def twin(fn, *args):
    """The jnp twin on the CPU, also on a GPU machine: XLA's fp32 division on a GPU is not correctly
    rounded (the kernels' div_rn is, and so is XLA's on the CPU), which would move scales by an ulp
    and some elements by one FP8 code."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return fn(*(jax.device_put(np.asarray(a), cpu) if isinstance(a, jax.Array) else a for a in args))


def relerr(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if np.isnan(out).any():
        return float("inf")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / denom) if denom else float(np.linalg.norm(out))


def grouped(a, b_rows, sizes, M):
    """fp64: out[rows(g)] = a[rows(g)] @ b_rows[g]^T, unowned rows 0."""
    a, b_rows = np.asarray(a, np.float64), np.asarray(b_rows, np.float64)
    out = np.zeros((M, b_rows.shape[1]))
    for g, rows in enumerate(group_bounds(sizes, M)):
        out[rows[0] : rows[1]] = a[rows[0] : rows[1]] @ b_rows[g].T
    return out


def wgrad(a, b, sizes, M):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.stack([a[s:e].T @ b[s:e] for s, e in group_bounds(sizes, M)])


class JaxFp8Test:
    BACKEND: str

    @pytest.fixture(autouse=True)
    def _count_launches(self):
        before = _interpret.CALLS.total()
        yield
        if self.BACKEND == "interpret":
            assert _interpret.CALLS.total() > before, "the interpreter backend launched no kernel"

    @property
    def exact(self) -> float:
        """GEMM tolerance vs fp64 of the dequantized operands: on CPU the products are exact and only
        the fp32 summation order differs; Hopper's FP8 tensor cores accumulate each BLOCK_K step at
        reduced precision before the fp32 promotion (the issue's relerr <= 1e-3)."""
        return 1e-3 if self.BACKEND == "triton" else EXACT

    def assert_same_quantization(self, got, want):
        np.testing.assert_array_equal(
            np.asarray(got.data).view(np.uint8), np.asarray(want.data).view(np.uint8)
        )
        np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))

    def assert_same_values(self, got, want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def q(self, x, recipe, **kw):
        return jfp8.quantize_fp8(x, recipe, backend=self.BACKEND, **kw)

    @pytest.mark.parametrize("recipe", RECIPES)
    @pytest.mark.parametrize("dtype", [E4M3, E5M2])
    def test_quantize_matches_twin(self, recipe, dtype):
        M, K, N, sizes = 70, 200, 40, [20, 0, 33, 10]
        x, w, _ = _inputs(0, M, K, N, len(sizes), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        got = self.q(x, recipe, group_sizes=gs, dtype=dtype, transpose=True)
        want = jfp8.Fp8Array(*twin(reference_fp8.quantize_activation, x, gs, recipe, dtype, True), gs, recipe)
        self.assert_same_quantization(got, want)
        # The transposed copy: only each group's columns are specified, so compare it dequantized.
        self.assert_same_values(got.dequantize_t(), want.dequantize_t())
        wn = jnp.swapaxes(w, 1, 2)  # a weight [G, N, K]
        got_w = self.q(wn, recipe, dtype=dtype, transpose=True)
        want_w = jfp8.Fp8Array(*twin(reference_fp8.quantize_weight, wn, recipe, dtype, True), None, recipe)
        self.assert_same_quantization(got_w, want_w)
        self.assert_same_values(got_w.dequantize_t(), want_w.dequantize_t())
        # The round trip keeps E4M3's ~2^-4 relative precision per element (outliers included).
        tol = 0.04 if dtype == E4M3 else 0.08
        assert (
            relerr(
                got.dequantize(), np.where(np.arange(M)[:, None] < sum(sizes), np.asarray(x, np.float32), 0)
            )
            < tol
        )

    def test_zero_amax_gives_scale_one(self):
        x = jnp.zeros((20, 48), jnp.bfloat16)
        for recipe in RECIPES:
            q = self.q(x, recipe, group_sizes=jnp.asarray([10, 0, 10], jnp.int32), transpose=True)
            assert np.isfinite(np.asarray(q.scale)).all() and (np.asarray(q.scale) == 1).all(), recipe
            assert (np.asarray(q.dequantize()) == 0).all()

    @pytest.mark.parametrize("recipe", RECIPES)
    @pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
    def test_gemms_match_fp64_of_dequantized(self, recipe, case):
        name, M, K, N, sizes = case
        G = len(sizes)
        x, w, dy = _inputs(1, M, K, N, G, jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        x_q = self.q(x, recipe, group_sizes=gs, transpose=True)
        dy_q = self.q(dy, recipe, group_sizes=gs, transpose=True)
        w_q = self.q(jnp.swapaxes(w, 1, 2), recipe, transpose=True)  # [G, N, K]
        run = functools.partial(jfp8.m_grouped_mm_fp8, out_dtype=jnp.float32, backend=self.BACKEND)
        out = run(x_q, w_q, gs)
        assert relerr(out, grouped(x_q.dequantize(), w_q.dequantize(), sizes, M)) <= self.exact, name
        dx = run(dy_q, w_q.t(), gs)
        w_t = np.swapaxes(np.asarray(w_q.dequantize_t()), 1, 2)  # [G, K, N]
        assert relerr(dx, grouped(dy_q.dequantize(), w_t, sizes, M)) <= self.exact, name
        dw = jfp8.k_grouped_mm_fp8(dy_q, x_q, backend=self.BACKEND)
        assert relerr(dw, wgrad(dy_q.dequantize_t(), x_q.dequantize_t(), sizes, M)) <= self.exact, name
        owned = sum(max(s, 0) for s in sizes)
        assert (np.asarray(out)[owned:] == 0).all() and (np.asarray(dx)[owned:] == 0).all()
        for g, (s, e) in enumerate(group_bounds(sizes, M)):
            if s == e:
                assert (np.asarray(dw[g]) == 0).all(), "an empty group's gradient is exact zeros"

    @pytest.mark.parametrize("recipe", RECIPES)
    def test_group_offset(self, recipe):
        M, K, N, sizes = 60, 72, 24, [10, 0, 25, 5, 12]
        x, w, dy = _inputs(2, M, K, N, len(sizes), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        x_q = self.q(x, recipe, group_sizes=gs, transpose=True)
        dy_q = self.q(dy, recipe, group_sizes=gs, transpose=True)
        w_q = self.q(jnp.swapaxes(w, 1, 2), recipe)
        full = jfp8.m_grouped_mm_fp8(x_q, w_q, gs, out_dtype=jnp.float32, backend=self.BACKEND)
        dw_full = jfp8.k_grouped_mm_fp8(dy_q, x_q, backend=self.BACKEND)
        for offset, G_local in [(1, 2), (2, 3), (0, 1), (-2, 2), (7, 2)]:
            first = min(max(offset + len(sizes) if offset < 0 else offset, 0), len(sizes) - G_local)
            local = jfp8.Fp8Array(
                w_q.data[first : first + G_local],
                w_q.scale[first : first + G_local],
                None,
                None,
                None,
                recipe,
            )
            out = jfp8.m_grouped_mm_fp8(
                x_q, local, gs, group_offset=offset, out_dtype=jnp.float32, backend=self.BACKEND
            )
            bounds = group_bounds(sizes, M)
            lo, hi = bounds[first][0], bounds[first + G_local - 1][1]
            want = np.zeros((M, N))
            want[lo:hi] = np.asarray(full)[lo:hi]
            assert (
                relerr(out, want) <= self.exact
                and (np.asarray(out)[:lo] == 0).all()
                and (np.asarray(out)[hi:] == 0).all()
            )
            dw = jfp8.k_grouped_mm_fp8(
                dy_q, x_q, group_offset=offset, num_groups=G_local, backend=self.BACKEND
            )
            assert relerr(dw, np.asarray(dw_full)[first : first + G_local]) <= self.exact

    def test_k_grouped_accumulate(self):
        M, K, N, sizes = 40, 48, 24, [15, 0, 25]
        x, _, dy = _inputs(3, M, K, N, 3, jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        x_q, dy_q = (self.q(a, "blockwise", group_sizes=gs, transpose=True) for a in (x, dy))
        c = jnp.asarray(np.random.default_rng(0).standard_normal((3, N, K)), jnp.float32)
        out = jfp8.k_grouped_mm_fp8(dy_q, x_q, accumulate=c, backend=self.BACKEND)
        want = np.asarray(c, np.float64) + wgrad(dy_q.dequantize_t(), x_q.dequantize_t(), sizes, M)
        assert relerr(out, want) <= self.exact
        np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(c[1]))  # the empty group: untouched

    def test_bad_sizes_are_clamped(self):
        M, K, N = 30, 40, 16
        x, w, _ = _inputs(4, M, K, N, 3, jnp.bfloat16)
        for bad, clamped in [([-5, 40, 3], [0, 30, 0]), ([12, -1, 2**31 - 1], [12, 0, 18])]:
            x_q = self.q(x, "rowwise", group_sizes=jnp.asarray(bad, jnp.int32))
            w_q = self.q(jnp.swapaxes(w, 1, 2), "rowwise")
            out = jfp8.m_grouped_mm_fp8(
                x_q, w_q, jnp.asarray(bad, jnp.int32), out_dtype=jnp.float32, backend=self.BACKEND
            )
            assert relerr(out, grouped(x_q.dequantize(), w_q.dequantize(), clamped, M)) <= self.exact

    @pytest.mark.parametrize("recipe", RECIPES)
    def test_ragged_dot_fp8_values_and_grads_under_jit(self, recipe):
        """Forward and both gradients are the FP8 products of the quantized operands (checked to fp32
        accuracy), and their quantization error against BF16-free fp64 math is reported by bound."""
        M, K, N, sizes = 64, 72, 40, [20, 0, 34, 6]
        x, w, dy = _inputs(5, M, K, N, len(sizes), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)

        def f(x, w, gs, dy):
            out, vjp = jax.vjp(
                lambda a, b: jfp8.ragged_dot_fp8(
                    a,
                    b,
                    gs,
                    recipe=recipe,
                    preferred_element_type=jnp.float32,
                    fprop_fast_accum=False,  # every product promoted: the tight check below
                    backend=self.BACKEND,
                ),
                x,
                w,
            )
            return out, *vjp(dy.astype(jnp.float32))

        args = jax.device_put((x, w, gs, dy))
        with jax.transfer_guard("disallow"):
            out, dx, dw = jax.block_until_ready(jax.jit(f)(*args))
        assert dx.dtype == x.dtype and dw.dtype == w.dtype
        # What the op quantized: x and dy in groups (with transposed copies), w as [G, K, N].
        xq = jfp8.Fp8Array(*twin(reference_fp8.quantize_activation, x, gs, recipe, E4M3, True), gs, recipe)
        dyq = jfp8.Fp8Array(
            *twin(reference_fp8.quantize_activation, dy.astype(jnp.float32), gs, recipe, E4M3, True),
            gs,
            recipe,
        )
        wq = jfp8.Fp8Array(*twin(reference_fp8.quantize_weight, w, recipe, E4M3, True), None, recipe)
        w_kn = np.asarray(wq.dequantize())  # [G, K, N] from its plain copy (dgrad operand)
        w_fwd = np.asarray(wq.dequantize_t())  # the transposed copy, back in [G, K, N] (fprop operand)
        assert relerr(out, grouped(xq.dequantize(), np.swapaxes(w_fwd, 1, 2), sizes, M)) <= self.exact
        assert relerr(dx, grouped(dyq.dequantize(), w_kn, sizes, M)) <= 8e-3  # bf16 output
        assert relerr(dw, wgrad(xq.dequantize_t(), dyq.dequantize_t(), sizes, M)) <= 8e-3
        # Against the unquantized fp64 math: FP8's error, bounded (a regression to garbage fails).
        exact_out = grouped(x, np.swapaxes(np.asarray(w, np.float64), 1, 2), sizes, M)
        assert relerr(out, exact_out) < 0.1

    @pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
    def test_fast_accumulation(self, recipe):
        """fast_accum lets the tensor cores accumulate all of K (torch's use_fast_accum): within the
        tensor cores' reduced-precision accumulation of the promoted result (exact on CPU)."""
        M, K, N, sizes = 48, 256, 40, [20, 0, 28]
        x, w, dy = _inputs(6, M, K, N, len(sizes), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        x_q = self.q(x, recipe, group_sizes=gs, transpose=True)
        w_q = self.q(jnp.swapaxes(w, 1, 2), recipe)
        out = jfp8.m_grouped_mm_fp8(
            x_q, w_q, gs, out_dtype=jnp.float32, fast_accum=True, backend=self.BACKEND
        )
        tol = 1e-2 if self.BACKEND == "triton" else EXACT
        assert relerr(out, grouped(x_q.dequantize(), w_q.dequantize(), sizes, M)) <= tol
        dy_q = self.q(dy, recipe, group_sizes=gs, transpose=True)
        dw = jfp8.k_grouped_mm_fp8(dy_q, x_q, fast_accum=True, backend=self.BACKEND)
        assert relerr(dw, wgrad(dy_q.dequantize_t(), x_q.dequantize_t(), sizes, M)) <= tol
        # the default training op: fast forward, promoted backward
        y = jfp8.ragged_dot_fp8(
            x, w, gs, recipe=recipe, preferred_element_type=jnp.float32, backend=self.BACKEND
        )
        xq = jfp8.Fp8Array(*twin(reference_fp8.quantize_activation, x, gs, recipe, E4M3, False), gs, recipe)
        wq = jfp8.Fp8Array(*twin(reference_fp8.quantize_weight, w, recipe, E4M3, True), None, recipe)
        assert (
            relerr(y, grouped(xq.dequantize(), np.swapaxes(np.asarray(wq.dequantize_t()), 1, 2), sizes, M))
            <= tol
        )

    def test_argument_errors_name_the_problem(self):
        x = jnp.ones((8, 16), jnp.bfloat16)
        gs = jnp.asarray([4, 4], jnp.int32)
        with pytest.raises(ValueError, match="recipe"):
            jfp8.quantize_fp8(x, "per-channel", backend=self.BACKEND)
        with pytest.raises(TypeError, match="float8"):
            jfp8.quantize_fp8(x, "rowwise", dtype=jnp.int8, backend=self.BACKEND)
        a = jfp8.quantize_fp8(x, "rowwise", group_sizes=gs, backend=self.BACKEND)
        b = jfp8.quantize_fp8(x, "blockwise", group_sizes=gs, backend=self.BACKEND)
        with pytest.raises(ValueError, match="one recipe"):
            jfp8.k_grouped_mm_fp8(a, b, backend=self.BACKEND)
        with pytest.raises(ValueError, match="transpose=True"):
            jfp8.k_grouped_mm_fp8(a, a, backend=self.BACKEND)
        w = jfp8.quantize_fp8(jnp.ones((2, 8, 24), jnp.bfloat16), "rowwise", backend=self.BACKEND)
        with pytest.raises(ValueError, match="matching K"):
            jfp8.m_grouped_mm_fp8(a, w, gs, backend=self.BACKEND)
        with pytest.raises(ValueError, match=r"lhs \[M, K\] and rhs \[G, K, N\]"):
            jfp8.ragged_dot_fp8(x, jnp.ones((2, 8, 4)), gs, backend=self.BACKEND)


def _skip(backend, reason):
    return pytest.mark.skipif(reason is not None, reason=f"backend={backend!r} cannot run here: {reason}")


@pytest.mark.gpu
@_skip("triton", _jax_triton.available())
class TestTriton(JaxFp8Test):
    BACKEND = "triton"


@_skip("interpret", _interpret.available())
class TestInterpret(JaxFp8Test):
    BACKEND = "interpret"


class TestReference(JaxFp8Test):
    BACKEND = "reference"
