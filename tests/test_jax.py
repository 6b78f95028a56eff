"""JAX front end: values and grads against the fp64 numpy oracle (moegemm.testing.oracle).

One backend-agnostic base class, subclassed per backend: "triton" runs the compiled kernels through
jax-triton (marked ``gpu``; it runs where JAX has a GPU and jax-triton imports, i.e. ``pytest -m gpu``
on the GPU machine), "interpret" runs the same kernels with the GPU path's launch arguments through
the Triton interpreter (CPU, TRITON_INTERPRET=1; a launch counter proves it), "reference" the
jax.numpy twin. A backend that cannot run here is skipped with the reason the library gives.
Shapes are tiny so the interpreter keeps the file fast on two CPU cores; TestTriton adds
real-sized ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moegemm import shapes
from moegemm._src import layout
from moegemm._src.jax import interpret as _interpret
from moegemm._src.jax import jax_triton as _jax_triton
from moegemm._src.layout import group_bounds
from moegemm.jax import api
from moegemm.testing import oracle

# The Triton interpreter itself trips this numpy deprecation on every scalar index.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
# Relative Frobenius error vs fp64, by output dtype: output rounding dominates (bf16 keeps 8
# mantissa bits, ~2e-3 per element; fp16 11 bits, ~2.4e-4); fp32 sees accumulation order, ~1e-7.
REL_TOL = {BF16: 8e-3, F16: 1.5e-3, F32: 2e-5}
DTYPES = (BF16, F16, F32)


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def relerr(out, ref) -> float:
    out, ref = f64(out), f64(ref)
    if np.isnan(out).any():
        return float("inf")
    denom = np.linalg.norm(ref)
    diff = np.linalg.norm(out - ref)
    return diff / denom if denom > 0 else diff


def assert_close(out, ref, dtype, what=""):
    out64, ref = f64(out), f64(ref)
    assert out64.shape == ref.shape, f"{what}: shape {out64.shape} != {ref.shape}"
    err, tol = relerr(out64, ref), REL_TOL[jnp.dtype(dtype)]
    if not err <= tol:
        diff = np.nan_to_num(np.abs(out64 - ref), nan=np.inf)
        idx = np.unravel_index(np.argmax(diff), diff.shape)
        raise AssertionError(
            f"{what}: relerr {err:.3e} > tol {tol:.1e}; worst at {idx}: got {out64[idx]}, want {ref[idx]}; "
            f"{int(np.isnan(out64).sum())} NaN elements (interpreter outputs start as NaN)"
        )


def ragged_grads(x, w, sizes, dy):
    """The oracle's (dx, dw) of sum(ragged_dot(x, w) * dy): dx = dy @ w[g]^T, dw[g] = x_g^T dy_g."""
    return oracle.m_grouped_mm(dy, np.swapaxes(f64(w), 1, 2), sizes), oracle.k_grouped_mm(x, dy, sizes)


def owned_rows(sizes, M) -> int:
    return oracle.rows(sizes, M)[-1].stop if len(sizes) else 0


def randn(seed, shape, dtype):
    # numpy (with ml_dtypes for bf16) rather than jax.random: no XLA compile per shape and dtype.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(jnp.dtype(dtype)))


def skip_unless_runs(backend: str, reason: str | None):
    return pytest.mark.skipif(reason is not None, reason=f"backend={backend!r} cannot run here: {reason}")


def every_op(backend):
    """ragged_dot with its grads, k_grouped_mm accumulating into a buffer, ragged_dot with group_offset."""

    def run(x, w, gs, dy, c, w_local, offset):
        out, vjp = jax.vjp(lambda x, w: api.ragged_dot(x, w, gs, backend=backend), x, w)
        dx, dw = vjp(dy)
        acc = api.k_grouped_mm(x, dy, gs, accumulate=c, backend=backend)
        off = api.ragged_dot(x, w_local, gs, group_offset=offset, backend=backend)
        return dict(out=out, dx=dx, dw=dw, acc=acc, off=off)

    return run


# ---------------------------------------------------------------- the backend-agnostic suite


class JaxOpsTest:
    BACKEND: str
    expect_launch = True  # a test whose inputs are too degenerate to launch a kernel sets it False

    @pytest.fixture(autouse=True)
    def _count_launches(self):
        before = _interpret.CALLS.total()
        yield
        if self.BACKEND == "interpret" and self.expect_launch:
            assert _interpret.CALLS.total() > before, "the interpreter backend launched no kernel"

    def ragged_dot(self, *args, **kwargs):
        return api.ragged_dot(*args, backend=self.BACKEND, **kwargs)

    def check_every_op(self, M, K, N, sizes, dtype, what, seed=0):
        """Every op under one jit against the oracle, with the inputs placed on the device first and
        then every host<->device transfer disallowed: group sizes never sync to the host."""
        G, offset = len(sizes), len(sizes) // 2
        x, w, dy = (
            randn(seed, (M, K), dtype),
            randn(seed + 1, (G, K, N), dtype),
            randn(seed + 2, (M, N), dtype),
        )
        c = randn(seed + 3, (G, K, N), F32)
        gs, offset_arg = jnp.asarray(sizes, jnp.int32), jnp.int32(offset)
        run = jax.jit(every_op(self.BACKEND))
        args = jax.device_put((x, w, gs, dy, c, w[offset:], offset_arg))
        with jax.transfer_guard("disallow"):  # trace, compile and run
            got = jax.block_until_ready(run(*args))
        self.expect_launch = M > 0
        w_off = np.zeros((G, K, N))
        w_off[offset:] = f64(w[offset:])
        dx, dw = ragged_grads(x, w, sizes, dy)
        want = dict(
            out=oracle.m_grouped_mm(x, w, sizes),
            dx=dx,
            dw=dw,
            acc=oracle.k_grouped_mm(x, dy, sizes, c=c),
            off=oracle.m_grouped_mm(x, w_off, sizes),
        )
        for name, value in want.items():
            assert got[name].dtype == (F32 if name == "acc" else dtype), name
            assert_close(got[name], value, F32 if name == "acc" else dtype, f"{what} {dtype} {name}")
        owned = owned_rows(sizes, M)
        for name in ("out", "dx", "off"):
            assert not np.asarray(got[name][owned:]).any(), f"{what}: unowned rows of {name} not zero"
        for g, rows in enumerate(oracle.rows(sizes, M)):
            if not len(rows):
                assert not np.asarray(got["dw"][g]).any(), f"{what}: empty group {g}: nonzero weight gradient"
                np.testing.assert_array_equal(
                    got["acc"][g], c[g], err_msg=f"{what}: empty group {g} changed c"
                )

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("case", shapes.EDGE, ids=lambda c: c.name)
    def test_edge_case(self, case, dtype):
        self.check_every_op(case.M, case.K, case.N, list(case.sizes), dtype, case.name)

    def test_grad_matches_lax_ragged_dot_under_jit(self):
        M, K, N, sizes = 33, 16, 20, jnp.asarray([0, 12, 21], jnp.int32)
        x, w = randn(0, (M, K), F32), randn(1, (3, K, N), F32)
        weights = randn(2, (M, N), F32)

        def loss(fn):
            return lambda x, w, gs: jnp.sum(jnp.tanh(fn(x, w, gs)) * weights)

        ours = jax.jit(jax.value_and_grad(loss(self.ragged_dot), argnums=(0, 1)))(x, w, sizes)
        lax = lax_ragged_dot_highest()
        theirs = jax.value_and_grad(loss(lax), argnums=(0, 1))(x, w, sizes)
        np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
        for got, want, what in zip(ours[1], theirs[1], ("dx", "dw")):
            assert_close(got, want, F32, what)

    def test_preferred_element_type(self):
        M, K, N, sizes = 30, 16, 24, [11, 19]
        x, w = randn(0, (M, K), BF16), randn(1, (2, K, N), BF16)
        out = self.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), preferred_element_type=jnp.float32)
        assert out.dtype == F32
        assert_close(out, oracle.m_grouped_mm(x, w, sizes), F32, "bf16 in, fp32 out")

    def check_fwd_and_grads(self, M, K, N, sizes, what):
        """fp32 ragged_dot and its vjp, eagerly, against the oracle; returns dw."""
        x, w, dy = randn(0, (M, K), F32), randn(1, (len(sizes), K, N), F32), randn(2, (M, N), F32)
        out, vjp = jax.vjp(lambda x, w: self.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32)), x, w)
        dx, dw = vjp(dy)
        dx_ref, dw_ref = ragged_grads(x, w, sizes, dy)
        assert_close(out, oracle.m_grouped_mm(x, w, sizes), F32, f"{what} fwd")
        assert_close(dx, dx_ref, F32, f"{what} dx")
        assert_close(dw, dw_ref, F32, f"{what} dw")
        return dw

    @pytest.mark.parametrize(
        "pattern, sizes", shapes.empty_patterns(), ids=[p for p, _ in shapes.empty_patterns()]
    )
    def test_every_empty_pattern(self, pattern, sizes):
        dw = self.check_fwd_and_grads(40, 16, 16, sizes, pattern)  # rows past sum(sizes) stay unowned
        for g, c in enumerate(pattern):
            if c == "0":
                assert not np.asarray(dw[g]).any(), f"empty group {g}: nonzero weight gradient"

    @pytest.mark.parametrize("name, M, sizes", shapes.INVALID_SIZES, ids=[c[0] for c in shapes.INVALID_SIZES])
    def test_invalid_sizes_are_clamped(self, name, M, sizes):
        x, w = randn(0, (M, 16), F32), randn(1, (len(sizes), 16, 16), F32)
        out = self.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32))
        assert_close(out, oracle.m_grouped_mm(x, w, sizes), F32, name)

    @pytest.mark.parametrize("offset, G_local", [(0, 2), (2, 3), (3, 2), (4, 1)])
    def test_group_offset(self, offset, G_local):
        global_sizes = [5, 0, 9, 6, 4]  # G_total = 5, M = 30: 6 unowned tail rows
        M, K, N = 30, 16, 20
        x, w, dy = randn(0, (M, K), F32), randn(1, (G_local, K, N), F32), randn(2, (M, N), F32)
        gs = jnp.asarray(global_sizes, jnp.int32)

        @jax.jit
        def fwd(x, w, offset):
            return self.ragged_dot(x, w, gs, group_offset=offset)

        out, vjp = jax.vjp(fwd, x, w, jnp.int32(offset))
        dx, dw, _ = vjp(dy)
        # Oracle: a G_total weight with zeros outside the local slice.
        w_full = np.zeros((len(global_sizes), K, N))
        w_full[offset : offset + G_local] = f64(w)
        dx_ref, dw_ref = ragged_grads(x, w_full, global_sizes, dy)
        assert_close(out, oracle.m_grouped_mm(x, w_full, global_sizes), F32, "fwd")
        assert_close(dx, dx_ref, F32, "dx")
        assert_close(dw, dw_ref[offset : offset + G_local], F32, "dw")

    @pytest.mark.parametrize(
        "name, offset, effective",
        [("negative counts from the end", -2, 3), ("past the end is clamped", 99, 3), ("below -G", -99, 0)],
    )
    def test_group_offset_out_of_range(self, name, offset, effective):
        """A device-side offset outside [0, G_total - G_local] is taken as dynamic_slice takes a start."""
        global_sizes, M, K, N = [5, 0, 9, 6, 4], 30, 16, 20
        x, w = randn(0, (M, K), F32), randn(1, (2, K, N), F32)
        out = jax.jit(
            lambda x, w, o: self.ragged_dot(x, w, jnp.asarray(global_sizes, jnp.int32), group_offset=o)
        )(x, w, jnp.int32(offset))
        w_full = np.zeros((5, K, N))
        w_full[effective : effective + 2] = f64(w)
        assert_close(out, oracle.m_grouped_mm(x, w_full, global_sizes), F32, name)

    def test_group_offset_moves_no_rows(self):
        """The expert-parallel path (forward, dx, dW) is kernel launches only: no roll, slice or
        concatenation of the [M, K] / [M, N] rows around them (each would be a pass over HBM)."""
        if self.BACKEND == "reference":
            pytest.skip("the reference computes densely; the property is the kernels'")
        self.expect_launch = False  # lowered, not run
        gs, x, w = jnp.asarray([5, 0, 9, 6], jnp.int32), randn(0, (24, 16), BF16), randn(1, (2, 16, 8), BF16)
        loss = lambda x, w, o: self.ragged_dot(x, w, gs, group_offset=o).astype(F32).sum()
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w, jnp.int32(1)).as_text()
        for op in ("concatenate", "dynamic_slice", "dynamic_update_slice", "gather", "scatter"):
            assert f"stablehlo.{op}" not in text, f"{op} in the expert-parallel path"
        calls = text.count("stablehlo.custom_call")
        assert calls == 3, f"expected the fwd, dx and dW launches, found {calls} custom calls"

    @pytest.mark.parametrize(
        "name, sizes, offset",
        [
            ("local groups empty", [40, 0, 0, 50, 30, 10], 1),
            ("no rows before", [20, 33, 40, 10, 7, 0], 0),
            ("last groups, unowned tail", [20, 33, 40, 10, 7, 9], 4),
            ("few GEMM tiles, many zero tiles", [70, 3, 2, 40, 20, 15], 1),
            ("many GEMM tiles, few zero tiles", [1, 60, 70, 2, 0, 17], 1),
        ],
    )
    def test_group_offset_zero_fill(self, name, sizes, offset):
        """Every row outside the local groups is written 0 by the launch (interpreter outputs start
        as NaN), whatever the mix of GEMM and zero tiles; local rows are right."""
        M, K, N, G_local = 150, 24, 70, 2
        x, w = randn(0, (M, K), F32), randn(1, (G_local, K, N), F32)
        out = self.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), group_offset=jnp.int32(offset))
        w_full = np.zeros((len(sizes), K, N))
        w_full[offset : offset + G_local] = f64(w)
        assert_close(out, oracle.m_grouped_mm(x, w_full, sizes), F32, name)
        (start, _), (_, end) = group_bounds(sizes, M)[offset], group_bounds(sizes, M)[offset + G_local - 1]
        out = np.asarray(out)
        assert not np.isnan(out).any() and not out[:start].any() and not out[end:].any(), name

    @pytest.mark.parametrize("transpose_w", [False, True], ids=["w[G,K,N]", "w[G,N,K]"])
    def test_m_grouped_group_offset_grads(self, transpose_w):
        """m_grouped_mm with a group offset, both weight layouts, bf16, and every input's gradient."""
        global_sizes, M, K, N, offset = [7, 11, 0, 13, 2], 40, 24, 18, 1  # 7 unowned tail rows
        G_local = 3
        x, dy = randn(0, (M, K), BF16), randn(2, (M, N), BF16)
        w = randn(1, (G_local, N, K) if transpose_w else (G_local, K, N), BF16)
        gs = jnp.asarray(global_sizes, jnp.int32)
        fn = lambda x, w: api.m_grouped_mm(
            x, w, gs, transpose_w=transpose_w, group_offset=jnp.int32(offset), backend=self.BACKEND
        )
        out, vjp = jax.vjp(jax.jit(fn), x, w)
        dx, dw = vjp(dy)
        w_kn = np.swapaxes(f64(w), 1, 2) if transpose_w else f64(w)
        w_full = np.zeros((len(global_sizes), K, N))
        w_full[offset : offset + G_local] = w_kn
        dx_ref, dw_ref = ragged_grads(x, w_full, global_sizes, dy)
        dw_ref = dw_ref[offset : offset + G_local]
        assert_close(out, oracle.m_grouped_mm(x, w_full, global_sizes), BF16, "fwd")
        assert_close(dx, dx_ref, BF16, "dx")
        assert_close(dw, np.swapaxes(dw_ref, 1, 2) if transpose_w else dw_ref, BF16, "dw")
        # Rows outside the local groups (0..6 before them, 33..39 after them) are exact zeros.
        for name, value in (("out", out), ("dx", dx)):
            assert not np.asarray(value[:7]).any() and not np.asarray(value[33:]).any(), name

    def test_k_grouped_group_offset_accumulate_and_grads(self):
        """k_grouped_mm over groups [offset, offset + 2) of 4, read in place, into a buffer, with grads."""
        global_sizes, M, K, N, offset = [9, 0, 14, 8], 36, 18, 26, 1  # local groups: empty and 14 rows
        a, b = randn(0, (M, K), F32), randn(1, (M, N), F32)
        c, dout = randn(2, (2, K, N), F32), randn(3, (2, K, N), F32)
        gs = jnp.asarray(global_sizes, jnp.int32)
        fn = lambda a, b, c: api.k_grouped_mm(
            a, b, gs, accumulate=c, group_offset=jnp.int32(offset), num_groups=2, backend=self.BACKEND
        )
        out, vjp = jax.vjp(jax.jit(fn), a, b, c)
        da, db, dc = vjp(dout)
        sizes_local = [9, 0, 14]  # the rows before group 1 as a leading group, dropped
        assert_close(
            out, oracle.k_grouped_mm(a, b, sizes_local, c=np.concatenate([c[:1], c]))[1:], F32, "out"
        )
        np.testing.assert_array_equal(
            out[0], c[0], err_msg="an empty local group leaves the buffer unchanged"
        )
        dout_full = np.concatenate([np.zeros((1, K, N)), f64(dout)])
        da_ref = oracle.m_grouped_mm(b, np.swapaxes(dout_full, 1, 2), sizes_local)
        db_ref = oracle.m_grouped_mm(a, dout_full, sizes_local)
        assert_close(da, da_ref, F32, "da")
        assert_close(db, db_ref, F32, "db")
        np.testing.assert_array_equal(dc, dout)

    def test_m_grouped_transposed_weight(self):
        M, K, N, sizes = 29, 24, 18, [13, 0, 16]
        x, w_nk, dy = randn(0, (M, K), BF16), randn(1, (3, N, K), BF16), randn(2, (M, N), BF16)
        gs = jnp.asarray(sizes, jnp.int32)
        fn = lambda x, w: api.m_grouped_mm(x, w, gs, transpose_w=True, backend=self.BACKEND)
        out, vjp = jax.vjp(fn, x, w_nk)
        dx, dw = vjp(dy)
        w_kn = np.swapaxes(f64(w_nk), 1, 2)
        dx_ref, dw_ref = ragged_grads(x, w_kn, sizes, dy)
        assert_close(out, oracle.m_grouped_mm(x, w_kn, sizes), BF16, "fwd")
        assert_close(dx, dx_ref, BF16, "dx")
        assert dw.shape == w_nk.shape
        assert_close(dw, np.swapaxes(dw_ref, 1, 2), BF16, "dw (stored [G, N, K])")

    @pytest.mark.parametrize("out_dtype", [F32, BF16], ids=str)
    def test_k_grouped(self, out_dtype):
        M, K, N, sizes = 45, 20, 36, [0, 17, 3, 20]  # an empty group and 5 unowned rows
        a, b = randn(0, (M, K), BF16), randn(1, (M, N), BF16)
        out = jax.jit(lambda a, b, gs: api.k_grouped_mm(a, b, gs, out_dtype=out_dtype, backend=self.BACKEND))(
            a, b, jnp.asarray(sizes, jnp.int32)
        )
        assert out.dtype == out_dtype
        assert_close(out, oracle.k_grouped_mm(a, b, sizes), out_dtype, "k_grouped")
        assert not np.asarray(out[0]).any(), "empty group must give exact zeros"

    def test_k_grouped_accumulate_and_grads(self):
        M, K, N, sizes = 40, 18, 26, [15, 0, 21]
        a, b = randn(0, (M, K), F32), randn(1, (M, N), F32)
        c, dout = randn(2, (3, K, N), F32), randn(3, (3, K, N), F32)
        gs = jnp.asarray(sizes, jnp.int32)
        fn = lambda a, b, c: api.k_grouped_mm(a, b, gs, accumulate=c, backend=self.BACKEND)
        out, vjp = jax.vjp(jax.jit(fn), a, b, c)
        da, db, dc = vjp(dout)
        assert_close(out, oracle.k_grouped_mm(a, b, sizes, c=c), F32, "c + a^T b")
        np.testing.assert_array_equal(out[1], c[1], err_msg="empty group must leave the buffer unchanged")
        # out[g] = a_g^T b_g: da_g = b_g dout[g]^T, db_g = a_g dout[g].
        da_ref = oracle.m_grouped_mm(b, np.swapaxes(f64(dout), 1, 2), sizes)
        assert_close(da, da_ref, F32, "da")
        assert_close(db, oracle.m_grouped_mm(a, dout, sizes), F32, "db")
        np.testing.assert_array_equal(dc, dout)

    def test_second_order_grad(self):
        M, K, N, sizes = 20, 16, 16, [8, 12]
        x, w = randn(0, (M, K), F32), randn(1, (2, K, N), F32)
        gs = jnp.asarray(sizes, jnp.int32)

        def gnorm(w):
            inner = lambda w: jnp.sum(self.ragged_dot(x, w, gs) ** 2)
            return jnp.sum(jax.grad(inner)(w) ** 2)

        # inner's gradient is 2 A_g w_g with A_g = x_g^T x_g, so d/dw |2 A_g w_g|^2 = 8 A_g^2 w_g.
        A = oracle.k_grouped_mm(x, x, sizes)
        assert_close(jax.grad(gnorm)(w), 8 * A @ A @ f64(w), F32, "d/dw |d/dw loss|^2")

    @settings(
        max_examples=8,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors],
    )
    @given(sizes=st.lists(st.integers(-2, 14), min_size=1, max_size=5))
    def test_hypothesis_group_sizes(self, sizes):
        """Generated sizes, negative ones and sums past M included: fwd and grads vs the fp64 oracle."""
        self.check_fwd_and_grads(36, 16, 20, sizes, str(sizes))

    @pytest.mark.parametrize("M, K, N, G", [(0, 16, 16, 2), (12, 0, 16, 2), (12, 16, 0, 2), (12, 16, 16, 0)])
    def test_zero_dims(self, M, K, N, G):
        self.expect_launch = False
        x, w = randn(0, (M, K), F32), randn(1, (G, K, N), F32)
        sizes = jnp.full((G,), M // max(G, 1), jnp.int32)
        out, vjp = jax.vjp(lambda x, w: self.ragged_dot(x, w, sizes), x, w)
        dx, dw = vjp(jnp.ones_like(out))
        assert out.shape == (M, N) and dx.shape == x.shape and dw.shape == w.shape
        assert not np.asarray(out).any() and not np.asarray(dx).any() and not np.asarray(dw).any()


def lax_ragged_dot_highest():
    return lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, precision=jax.lax.Precision.HIGHEST)


# Real-sized cases for the compiled kernels (several tiles per group, unaligned K and N): the CI
# miniatures with skewed sizes, MoE edge cases, and two model-sized shapes.
GPU_SIZED = [(c.name, c.M, c.K, c.N, shapes.group_sizes(c.M, c.G, seed=1, empty=1)) for c in shapes.TINY] + [
    ("sum-below-M", 300, 96, 136, [100, 0, 90, 50]),
    ("clamped-invalid-sizes", 200, 64, 72, [120, -7, 150, 3]),
    ("one-hot-expert", 512, 128, 256, shapes.group_sizes(512, 8, split="one-hot")),
    ("unaligned-odd", 1031, 577, 859, shapes.group_sizes(1031, 5, seed=2, empty=1)),
    ("qwen3-ish-fc2", 4096, 768, 2048, shapes.group_sizes(4096, 32, seed=3)),
    ("dsv3-ish-fc1", 8192, 2048, 1024, shapes.group_sizes(8192, 8, seed=4)),
]


class TestTriton(JaxOpsTest):
    BACKEND = "triton"
    pytestmark = [pytest.mark.gpu, skip_unless_runs("triton", _jax_triton.available())]

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("name, M, K, N, sizes", GPU_SIZED, ids=[c[0] for c in GPU_SIZED])
    def test_gpu_sized_case(self, name, M, K, N, sizes, dtype):
        self.check_every_op(M, K, N, sizes, dtype, name)

    def test_auto_resolves_to_triton(self):
        assert api.resolve_backend("auto") == "triton"


class TestInterpret(JaxOpsTest):
    BACKEND = "interpret"
    pytestmark = skip_unless_runs("interpret", _interpret.available())


class TestReference(JaxOpsTest):
    BACKEND = "reference"


# ---------------------------------------------------------------- dispatch and reference


def test_backend_resolution_is_explicit():
    assert api.resolve_backend("auto") == ("triton" if jax.default_backend() == "gpu" else "reference")
    with pytest.raises(ValueError, match="backend must be one of"):
        api.resolve_backend("cuda")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="JAX has no GPU|TRITON_INTERPRET"):
            api.resolve_backend("triton")


def test_argument_errors_name_the_problem():
    x, w, gs = jnp.ones((4, 8)), jnp.ones((2, 8, 3)), jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="matching K"):
        api.ragged_dot(x, jnp.ones((2, 7, 3)), gs)
    with pytest.raises(ValueError, match="G=2"):
        api.ragged_dot(x, w, jnp.asarray([4], jnp.int32))
    with pytest.raises(TypeError, match="integer"):
        api.ragged_dot(x, w, jnp.asarray([2.0, 2.0]))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        api.ragged_dot(x.astype(jnp.int32), w.astype(jnp.int32), gs)
    with pytest.raises(ValueError, match="float32"):
        api.k_grouped_mm(x, x, gs, accumulate=jnp.ones((2, 8, 8), jnp.bfloat16))
    with pytest.raises(TypeError, match="group_offset must be an integer scalar"):
        api.ragged_dot(x, w, gs, group_offset=jnp.float32(0))
    with pytest.raises(ValueError, match="fewer than the 2 local groups"):
        api.ragged_dot(x, w, jnp.asarray([4], jnp.int32), group_offset=0)
    with pytest.raises(ValueError, match="group_offset needs num_groups"):
        api.k_grouped_mm(x, x, gs, group_offset=0)
    with pytest.raises(ValueError, match="num_groups=1 differs"):
        api.k_grouped_mm(x, x, gs, num_groups=1)


def test_auto_reference_matches_lax_ragged_dot_exactly_shaped():
    """The CPU fallback is a drop-in: same dtype promotion and output dtype as jax.lax.ragged_dot."""
    x, w, gs = randn(0, (10, 8), F32), randn(1, (2, 8, 4), BF16), jnp.asarray([4, 5], jnp.int32)
    ours = api.ragged_dot(x, w, gs, backend="reference")
    theirs = jax.lax.ragged_dot(x, w, gs, precision=jax.lax.Precision.HIGHEST)
    assert ours.dtype == theirs.dtype
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax.numpy"])
def test_group_layout_doc_examples(xp):
    starts, ends = layout.group_layout(xp.asarray([3, 0, 4]), 10, xp)
    assert starts.tolist() == [0, 3, 3] and ends.tolist() == [3, 3, 7]
    grouped = layout.group_layout(xp.asarray([8, -2, 5]), 10, xp)
    assert grouped.starts.tolist() == [0, 8, 8] and grouped.sizes.tolist() == [8, 0, 2]
    first, local = layout.local_groups(xp.asarray([3, 2, 4, 1]), 1, 2, 10, xp)
    assert int(first) == 3 and local.tolist() == [2, 4]
    # Saturating prefix sums stay exact at the int32 limit (a plain cumsum would wrap negative).
    big = 2**31 - 1
    starts, ends = layout.group_layout(xp.asarray([big, 5, big], xp.int32), big, xp)
    assert starts.tolist() == [0, big, big] and ends.tolist() == [big, big, big]


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    sizes=st.lists(st.integers(-3, 12), min_size=0, max_size=9),
    M=st.integers(0, 40),
    offset=st.integers(-12, 12),
    G_local=st.integers(0, 9),
)
def test_group_layout_matches_host_bounds(sizes, M, offset, G_local):
    """The array version under jit (on device), numpy and the plain-Python host version agree."""
    want = group_bounds(sizes, M)
    device = jax.jit(lambda s: layout.group_layout(s, M, jnp))(jnp.asarray(sizes, jnp.int32))
    host = layout.group_layout(np.asarray(sizes, np.int32), M, np)
    for starts, ends in (device, host):
        assert list(zip(np.asarray(starts).tolist(), np.asarray(ends).tolist())) == want
    G_local = min(G_local, len(sizes))
    local = lambda s, o: layout.local_groups(s, o, G_local, M, jnp)
    first, local_sizes = jax.jit(local)(jnp.asarray(sizes, jnp.int32), jnp.int32(offset))
    # as jax.lax.dynamic_slice takes a start: negative counts from the end, then clamped
    start = min(max(offset + len(sizes) if offset < 0 else offset, 0), len(sizes) - G_local)
    chosen = want[start : start + G_local]
    assert int(first) == (chosen[0][0] if chosen else 0)
    assert local_sizes.tolist() == [e - s for s, e in chosen]


@pytest.mark.parametrize(
    "which",
    [
        "m_grouped",
        "m_grouped_transposed",
        "m_grouped_offset",
        "k_grouped",
        "k_grouped_accumulate",
        "k_grouped_offset",
    ],
)
def test_launch_matches_kernel_signature(which):
    """The GPU glue's contract with jax-triton, checked without a GPU: the input arrays in parameter
    order, then the output pointer (jax-triton appends it), then every other parameter (sizes,
    strides, constexprs) in meta as a Python value, because jax-triton makes meta constexprs."""
    import inspect

    from moegemm._src.jax import launch as _launch

    x, gs = jnp.ones((10, 6), BF16), jnp.asarray([4, 6], jnp.int32)
    offset = jnp.int32(1) if which.endswith("offset") else None
    G = 1 if offset is not None else 2
    if which.startswith("m_grouped"):
        transposed = which.endswith("transposed")
        w = jnp.ones((G, 5, 6) if transposed else (G, 6, 5), BF16)
        call = _launch.m_grouped_mm_call(
            x, w, gs, transpose_w=transposed, out_dtype=F32, target=_launch.INTERPRET, group_offset=offset
        )
        strides = (
            dict(stride_wg=30, stride_wk=1, stride_wn=6)
            if transposed
            else dict(stride_wg=30, stride_wk=5, stride_wn=1)
        )
    else:
        c = jnp.zeros((2, 6, 5), F32) if which.endswith("accumulate") else None
        call = _launch.k_grouped_mm_call(
            x,
            jnp.ones((10, 5), BF16),
            gs,
            c,
            out_dtype=F32,
            target=_launch.INTERPRET,
            group_offset=offset,
            num_groups=G,
        )
        strides = dict(
            stride_og=30, stride_ok=5, stride_on=1, stride_am=6, stride_ak=1, stride_bm=5, stride_bn=1
        )
        assert call.input_output_aliases == ({} if c is None else {4: 0})
    # The group offset: int32 [1] in group_offset_ptr's slot (argument 3), or group_sizes filling it.
    assert call.meta["HAS_GROUP_OFFSET"] == (offset is not None)
    assert (call.meta["G"], call.meta["G_TOTAL"]) == (G, 2)
    assert call.args[3].shape == ((1,) if offset is not None else (2,))
    params = list(inspect.signature(call.kernel.fn).parameters)
    assert params[len(call.args)] == "out_ptr", params
    assert all(isinstance(a, jax.Array) for a in call.args)
    assert all(p.endswith("_ptr") for p in params[: len(call.args)])
    assert call.meta["TMA_STORE"] is False
    after_out = params[len(call.args) + 1 :]
    assert set(call.meta) - {"num_warps", "num_stages"} == set(after_out)
    for name in after_out:
        assert type(call.meta[name]) in (int, bool, str), f"{name}={call.meta[name]!r}"
    assert {k: call.meta[k] for k in strides} == strides
    if which == "m_grouped_transposed":  # the weight is read K-contiguous, as stored
        assert call.meta["W_K_CONTIGUOUS"]
