"""JAX front end: values and grads against the fp64 numpy oracle (moegemm.testing.oracle), in high
precision and in FP8 (quantized operands through the same ops; ragged_dot(fp8_recipe=...)).

One backend-agnostic base class, subclassed per backend: "triton" runs the compiled kernels through
moegemm's JAX GPU executor (``_src/jax/gpu.py``; marked ``gpu``: ``pytest -m gpu`` where JAX has a
GPU), "interpret" runs the same kernels with the GPU path's launch arguments through
the Triton interpreter (CPU, TRITON_INTERPRET=1; a launch counter proves it), "reference" the
jax.numpy twin. A backend that cannot run here is skipped with the reason the library gives.
Shapes are tiny so the interpreter keeps the file fast on two CPU cores; TestTriton adds
real-sized ones.

FP8 (``JaxFp8Test``, the same three backends): GEMMs are checked against an fp64 numpy product of the
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moegemm.jax as mj
from moegemm import shapes
from moegemm._src import fp8, layout
from moegemm._src.jax import gpu as _gpu
from moegemm._src.jax import interpret as _interpret
from moegemm._src.layout import group_bounds
from moegemm.jax import api, reference
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

    @pytest.mark.parametrize(
        "sizes, offset",
        [([2**32 + 2, 5, 1], 2**32), ([-(2**32) + 2, 5, 1], -(2**32) + 2), ([3, 2**40, -(2**33)], 2**33)],
        ids=["past 2**32", "below -2**32", "2**40"],
    )
    def test_int64_sizes_and_offset_clamp_before_the_int32_cast(self, sizes, offset):
        """Under jax_enable_x64, int64 group sizes and group_offset clamp in int64 (sizes to [0, M], the
        offset as dynamic_slice takes a start), as the PyTorch ops and the oracle do, then narrow to int32: a
        bare cast wrapped 2**32 + 2 to 2 and 2**32 to offset 0 (issue 63)."""
        M, K, N, G_local = 8, 16, 12, 2
        with jax.enable_x64(True):
            x, w, b = randn(0, (M, K), F32), randn(1, (3, K, N), F32), randn(2, (M, N), F32)
            gs = jnp.asarray(sizes, jnp.int64)
            assert gs.dtype == jnp.int64
            out = jax.jit(self.ragged_dot)(x, w, gs)
            assert_close(out, oracle.m_grouped_mm(x, w, sizes), F32, "ragged_dot")
            out = api.m_grouped_mm(x, jnp.swapaxes(w, 1, 2), gs, transpose_w=True, backend=self.BACKEND)
            assert_close(out, oracle.m_grouped_mm(x, w, sizes), F32, "m_grouped_mm")
            dw = api.k_grouped_mm(x, b, gs, backend=self.BACKEND)
            assert_close(dw, oracle.k_grouped_mm(x, b, sizes), F32, "k_grouped_mm")
            out = self.ragged_dot(x, w[:G_local], gs, group_offset=jnp.int64(offset))
        effective = 3 - G_local if offset > 0 else 0
        w_full = np.zeros((3, K, N))
        w_full[effective : effective + G_local] = f64(w[:G_local])
        assert_close(out, oracle.m_grouped_mm(x, w_full, sizes), F32, f"group_offset={offset}")

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
    pytestmark = [pytest.mark.gpu, skip_unless_runs("triton", _gpu.available())]

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


def test_public_api_is_declared():
    """__all__ lists exactly the public names of each public module: no aliases, no helpers."""
    import types

    from moegemm.jax import sharding

    modules = [mj, api, reference, sharding]
    try:
        from moegemm.jax import flax as mflax

        modules.append(mflax)
    except ImportError:  # flax is optional
        pass
    for module in modules:
        # Names defined here (or, for a package, in its modules) that are not private must be declared.
        defined = {
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and not isinstance(value, types.ModuleType)
            and getattr(value, "__module__", "").startswith(module.__name__.removesuffix(".api"))
        }
        assert defined <= set(module.__all__) <= set(vars(module)), (
            f"{module.__name__}: undeclared {sorted(defined - set(module.__all__))}, "
            f"missing {sorted(set(module.__all__) - set(vars(module)))}"
        )
    assert not hasattr(sharding, "plan_gmm") and not hasattr(sharding, "ragged_dot_fp8")


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
    """The KernelCall contract, checked without a GPU: the input arrays in parameter order, then the
    output pointer (the executors append it), then every other parameter (sizes, strides, constexprs)
    in meta as a Python value."""
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


# ---------------------------------------------------------------- FP8 through the same ops

RECIPES = fp8.RECIPES
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
EXACT = 1e-5  # fp32 output of exact FP8 products: accumulation order only

# (name, M, K, N, group sizes): empty groups, a hot expert, sums below M, K off 128 and off 16.
FP8_CASES = [
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
    """FP8 through the same ops: quantize_fp8, then m_grouped_mm / k_grouped_mm / ragged_dot on Fp8Arrays,
    and ragged_dot(fp8_recipe=...) for training."""

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
        return mj.quantize_fp8(x, recipe, backend=self.BACKEND, **kw)

    @pytest.mark.parametrize("recipe", RECIPES)
    @pytest.mark.parametrize("dtype", [E4M3, E5M2])
    def test_quantize_matches_twin(self, recipe, dtype):
        M, K, N, sizes = 70, 200, 40, [20, 0, 33, 10]
        x, w, _ = _inputs(0, M, K, N, len(sizes), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        got = self.q(x, recipe, group_sizes=gs, dtype=dtype, transpose=True)
        want = mj.Fp8Array(*twin(reference._quantize_activation, x, gs, recipe, dtype, True), gs, recipe)
        self.assert_same_quantization(got, want)
        # The transposed copy: only each group's columns are specified, so compare it dequantized.
        self.assert_same_values(got.dequantize_t(), want.dequantize_t())
        wn = jnp.swapaxes(w, 1, 2)  # a weight [G, N, K]
        got_w = self.q(wn, recipe, dtype=dtype, transpose=True)
        want_w = mj.Fp8Array(*twin(reference._quantize_weight, wn, recipe, dtype, True), None, recipe)
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
    @pytest.mark.parametrize("case", FP8_CASES, ids=[c[0] for c in FP8_CASES])
    def test_gemms_match_fp64_of_dequantized(self, recipe, case):
        name, M, K, N, sizes = case
        G = len(sizes)
        x, w, dy = _inputs(1, M, K, N, G, jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        x_q = self.q(x, recipe, group_sizes=gs, transpose=True)
        dy_q = self.q(dy, recipe, group_sizes=gs, transpose=True)
        w_q = self.q(jnp.swapaxes(w, 1, 2), recipe, transpose=True)  # [G, N, K]
        run = functools.partial(mj.m_grouped_mm, out_dtype=jnp.float32, backend=self.BACKEND)
        out = run(x_q, w_q, gs)
        assert relerr(out, grouped(x_q.dequantize(), w_q.dequantize(), sizes, M)) <= self.exact, name
        dx = run(dy_q, w_q.t(), gs)
        w_t = np.swapaxes(np.asarray(w_q.dequantize_t()), 1, 2)  # [G, K, N]
        assert relerr(dx, grouped(dy_q.dequantize(), w_t, sizes, M)) <= self.exact, name
        dw = mj.k_grouped_mm(dy_q, x_q, backend=self.BACKEND)
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
        full = mj.m_grouped_mm(x_q, w_q, gs, out_dtype=jnp.float32, backend=self.BACKEND)
        dw_full = mj.k_grouped_mm(dy_q, x_q, backend=self.BACKEND)
        for offset, G_local in [(1, 2), (2, 3), (0, 1), (-2, 2), (7, 2)]:
            first = min(max(offset + len(sizes) if offset < 0 else offset, 0), len(sizes) - G_local)
            local = mj.Fp8Array(
                w_q.data[first : first + G_local],
                w_q.scale[first : first + G_local],
                None,
                None,
                None,
                recipe,
            )
            out = mj.m_grouped_mm(
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
            dw = mj.k_grouped_mm(dy_q, x_q, group_offset=offset, num_groups=G_local, backend=self.BACKEND)
            assert relerr(dw, np.asarray(dw_full)[first : first + G_local]) <= self.exact

    def test_k_grouped_accumulate(self):
        M, K, N, sizes = 40, 48, 24, [15, 0, 25]
        x, _, dy = _inputs(3, M, K, N, 3, jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        x_q, dy_q = (self.q(a, "blockwise", group_sizes=gs, transpose=True) for a in (x, dy))
        c = jnp.asarray(np.random.default_rng(0).standard_normal((3, N, K)), jnp.float32)
        out = mj.k_grouped_mm(dy_q, x_q, accumulate=c, backend=self.BACKEND)
        want = np.asarray(c, np.float64) + wgrad(dy_q.dequantize_t(), x_q.dequantize_t(), sizes, M)
        assert relerr(out, want) <= self.exact
        np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(c[1]))  # the empty group: untouched

    def test_bad_sizes_are_clamped(self):
        M, K, N = 30, 40, 16
        x, w, _ = _inputs(4, M, K, N, 3, jnp.bfloat16)
        for bad, clamped in [([-5, 40, 3], [0, 30, 0]), ([12, -1, 2**31 - 1], [12, 0, 18])]:
            x_q = self.q(x, "rowwise", group_sizes=jnp.asarray(bad, jnp.int32))
            w_q = self.q(jnp.swapaxes(w, 1, 2), "rowwise")
            out = mj.m_grouped_mm(
                x_q, w_q, jnp.asarray(bad, jnp.int32), out_dtype=jnp.float32, backend=self.BACKEND
            )
            assert relerr(out, grouped(x_q.dequantize(), w_q.dequantize(), clamped, M)) <= self.exact
        with jax.enable_x64(
            True
        ):  # int64 sizes clamp before the int32 cast (2**32 + 2 wrapped to 2; issue 63)
            gs = jnp.asarray([2**32 + 2, -(2**32) + 1, 3], jnp.int64)
            x_q = self.q(x, "rowwise", group_sizes=gs)
            np.testing.assert_array_equal(x_q.group_sizes, [M, 0, 3])
            w_q = self.q(jnp.swapaxes(w, 1, 2), "rowwise")
            out = mj.m_grouped_mm(x_q, w_q, gs, out_dtype=jnp.float32, backend=self.BACKEND)
        assert relerr(out, grouped(x_q.dequantize(), w_q.dequantize(), [M, 0, 0], M)) <= self.exact

    @pytest.mark.parametrize("recipe", RECIPES)
    def test_ragged_dot_fp8_values_and_grads_under_jit(self, recipe):
        """Forward and both gradients are the FP8 products of the quantized operands (checked to fp32
        accuracy), and their quantization error against BF16-free fp64 math is reported by bound."""
        M, K, N, sizes = 64, 72, 40, [20, 0, 34, 6]
        x, w, dy = _inputs(5, M, K, N, len(sizes), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)

        def f(x, w, gs, dy):
            out, vjp = jax.vjp(
                lambda a, b: mj.ragged_dot(
                    a,
                    b,
                    gs,
                    fp8_recipe=recipe,
                    preferred_element_type=jnp.float32,
                    fp8_fprop_fast_accum=False,  # every product promoted: the tight check below
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
        xq = mj.Fp8Array(*twin(reference._quantize_activation, x, gs, recipe, E4M3, True), gs, recipe)
        dyq = mj.Fp8Array(
            *twin(reference._quantize_activation, dy.astype(jnp.float32), gs, recipe, E4M3, True),
            gs,
            recipe,
        )
        wq = mj.Fp8Array(*twin(reference._quantize_weight, w, recipe, E4M3, True), None, recipe)
        w_kn = np.asarray(wq.dequantize())  # [G, K, N] from its plain copy (dgrad operand)
        w_fwd = np.asarray(wq.dequantize_t())  # the transposed copy, back in [G, K, N] (fprop operand)
        assert relerr(out, grouped(xq.dequantize(), np.swapaxes(w_fwd, 1, 2), sizes, M)) <= self.exact
        assert relerr(dx, grouped(dyq.dequantize(), w_kn, sizes, M)) <= 8e-3  # bf16 output
        assert relerr(dw, wgrad(xq.dequantize_t(), dyq.dequantize_t(), sizes, M)) <= 8e-3
        # Against the unquantized fp64 math: FP8's error, bounded (a regression to garbage fails).
        exact_out = grouped(x, np.swapaxes(np.asarray(w, np.float64), 1, 2), sizes, M)
        assert relerr(out, exact_out) < 0.1

    @pytest.mark.parametrize("recipe", RECIPES)
    def test_ragged_dot_fp8_with_rhs_quantized_once(self, recipe):
        """rhs_fp8 (rhs quantized once, kept across steps) runs the same FP8 products as quantizing inside: out,
        dx and dw bit for bit, under jit; dw still comes back in rhs's dtype. Wrong copies raise, naming them."""
        M, K, N, sizes = 64, 72, 40, [20, 0, 34, 6]
        x, w, dy = _inputs(11, M, K, N, len(sizes), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        w_q = mj.quantize_fp8(w, recipe, transpose=True, backend=self.BACKEND)

        def step(x, w, w_q):
            f = lambda a, b: mj.ragged_dot(a, b, gs, fp8_recipe=recipe, rhs_fp8=w_q, backend=self.BACKEND)  # noqa: E731
            out, vjp = jax.vjp(f, x, w)
            return out, *vjp(dy)

        got = jax.jit(step)(x, w, w_q)
        want = jax.jit(step)(x, w, None)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert got[2].dtype == w.dtype and np.abs(np.asarray(got[2], np.float32)).max() > 0
        # The copy is what the step reads: a different one gives a different product.
        other = mj.quantize_fp8(w * 2, recipe, transpose=True, backend=self.BACKEND)
        assert not np.array_equal(np.asarray(jax.jit(step)(x, w, other)[0]), np.asarray(got[0]))
        with pytest.raises(TypeError, match="transpose=True"):
            mj.ragged_dot(
                x, w, gs, fp8_recipe=recipe, rhs_fp8=mj.quantize_fp8(w, recipe, backend=self.BACKEND)
            )
        wrong = "rowwise" if recipe != "rowwise" else "tensorwise"
        with pytest.raises(ValueError, match="needs the same"):
            mj.ragged_dot(x, w, gs, fp8_recipe=wrong, rhs_fp8=w_q, backend=self.BACKEND)
        with pytest.raises(ValueError, match="pass fp8_recipe"):
            mj.ragged_dot(x, w, gs, rhs_fp8=w_q, backend=self.BACKEND)
        x_q = mj.quantize_fp8(x, recipe, group_sizes=gs, backend=self.BACKEND)
        with pytest.raises(ValueError, match="quantized already"):
            mj.ragged_dot(x_q, w_q, gs, rhs_fp8=w_q, backend=self.BACKEND)

    @pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
    def test_fast_accumulation(self, recipe):
        """fast_accum lets the tensor cores accumulate all of K (torch's use_fast_accum): within the
        tensor cores' reduced-precision accumulation of the promoted result (exact on CPU)."""
        M, K, N, sizes = 48, 256, 40, [20, 0, 28]
        x, w, dy = _inputs(6, M, K, N, len(sizes), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        x_q = self.q(x, recipe, group_sizes=gs, transpose=True)
        w_q = self.q(jnp.swapaxes(w, 1, 2), recipe)
        out = mj.m_grouped_mm(x_q, w_q, gs, out_dtype=jnp.float32, fast_accum=True, backend=self.BACKEND)
        tol = 1e-2 if self.BACKEND == "triton" else EXACT
        assert relerr(out, grouped(x_q.dequantize(), w_q.dequantize(), sizes, M)) <= tol
        dy_q = self.q(dy, recipe, group_sizes=gs, transpose=True)
        dw = mj.k_grouped_mm(dy_q, x_q, fast_accum=True, backend=self.BACKEND)
        assert relerr(dw, wgrad(dy_q.dequantize_t(), x_q.dequantize_t(), sizes, M)) <= tol
        # the default training op: fast forward, promoted backward
        y = mj.ragged_dot(
            x, w, gs, fp8_recipe=recipe, preferred_element_type=jnp.float32, backend=self.BACKEND
        )
        xq = mj.Fp8Array(*twin(reference._quantize_activation, x, gs, recipe, E4M3, False), gs, recipe)
        wq = mj.Fp8Array(*twin(reference._quantize_weight, w, recipe, E4M3, True), None, recipe)
        assert (
            relerr(y, grouped(xq.dequantize(), np.swapaxes(np.asarray(wq.dequantize_t()), 1, 2), sizes, M))
            <= tol
        )

    def test_quantized_weight_layouts(self):
        """An Fp8Array weight [G, N, K] is read as w[g]^T from its data (transpose_w None or True), or as
        w[g] from its transposed copy (transpose_w=False, the same bytes as w_q.t()); ragged_dot takes a
        quantized [G, K, N] rhs through its transposed copy. Each equals its twin."""
        M, K, N, sizes = 40, 72, 24, [15, 0, 20]
        x, w, dy = _inputs(7, M, K, N, len(sizes), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        dy_q = self.q(dy, "rowwise", group_sizes=gs)
        w_q = self.q(jnp.swapaxes(w, 1, 2), "rowwise", transpose=True)  # [G, N, K]
        run = functools.partial(mj.m_grouped_mm, out_dtype=jnp.float32, backend=self.BACKEND)
        via_t = run(dy_q, w_q.t(), gs)
        self.assert_same_values(run(dy_q, w_q, gs, transpose_w=False), via_t)
        want = twin(
            lambda *a: mj.m_grouped_mm_reference(*a, transpose_w=False, out_dtype=jnp.float32), dy_q, w_q, gs
        )
        assert relerr(via_t, want) <= self.exact
        x_q = self.q(x, "rowwise", group_sizes=gs)
        rhs_q = self.q(w, "rowwise", transpose=True)  # ragged_dot's rhs [G, K, N]
        out = mj.ragged_dot(x_q, rhs_q, gs, preferred_element_type=jnp.float32, backend=self.BACKEND)
        want = twin(lambda *a: mj.ragged_dot_reference(*a, out_dtype=jnp.float32), x_q, rhs_q, gs)
        assert relerr(out, want) <= self.exact
        assert relerr(out, grouped(x, np.swapaxes(np.asarray(w, np.float64), 1, 2), sizes, M)) < 0.1
        assert mj.ragged_dot(x_q, rhs_q, gs, backend=self.BACKEND).dtype == jnp.bfloat16
        with pytest.raises(ValueError, match="transpose=True"):
            run(dy_q, self.q(jnp.swapaxes(w, 1, 2), "rowwise"), gs, transpose_w=False)

    def test_mixed_precision_operands_raise_naming_both(self):
        M, K, N, sizes = 16, 32, 16, [8, 8]
        x, w, _ = _inputs(8, M, K, N, 2, jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        x_q = self.q(x, "rowwise", group_sizes=gs, transpose=True)
        w_q = self.q(jnp.swapaxes(w, 1, 2), "rowwise", transpose=True)
        with pytest.raises(TypeError, match="x is an Fp8Array but w is a high-precision"):
            mj.m_grouped_mm(x_q, jnp.swapaxes(w, 1, 2), gs, transpose_w=True, backend=self.BACKEND)
        with pytest.raises(TypeError, match="lhs is a high-precision .* but rhs is an Fp8Array"):
            mj.ragged_dot(x, w_q, gs, backend=self.BACKEND)
        with pytest.raises(TypeError, match="a is an Fp8Array but b is a high-precision"):
            mj.k_grouped_mm(x_q, x, gs, backend=self.BACKEND)
        with pytest.raises(ValueError, match="already quantized"):
            mj.ragged_dot(x_q, w_q, gs, fp8_recipe="rowwise", backend=self.BACKEND)
        with pytest.raises(ValueError, match="fast_accum is an FP8 option"):
            mj.m_grouped_mm(x, w, gs, fast_accum=True, backend=self.BACKEND)

    def test_argument_errors_name_the_problem(self):
        x = jnp.ones((8, 16), jnp.bfloat16)
        gs = jnp.asarray([4, 4], jnp.int32)
        with pytest.raises(ValueError, match="recipe"):
            mj.quantize_fp8(x, "per-channel", backend=self.BACKEND)
        with pytest.raises(TypeError, match="float8"):
            mj.quantize_fp8(x, "rowwise", dtype=jnp.int8, backend=self.BACKEND)
        a = mj.quantize_fp8(x, "rowwise", group_sizes=gs, backend=self.BACKEND)
        b = mj.quantize_fp8(x, "blockwise", group_sizes=gs, backend=self.BACKEND)
        with pytest.raises(ValueError, match="one recipe"):
            mj.k_grouped_mm(a, b, backend=self.BACKEND)
        with pytest.raises(ValueError, match="transpose=True"):
            mj.k_grouped_mm(a, a, backend=self.BACKEND)
        w = mj.quantize_fp8(jnp.ones((2, 8, 24), jnp.bfloat16), "rowwise", backend=self.BACKEND)
        with pytest.raises(ValueError, match="differ in K"):
            mj.m_grouped_mm(a, w, gs, backend=self.BACKEND)
        with pytest.raises(ValueError, match=r"lhs \[M, K\] and rhs \[G, K, N\]"):
            mj.ragged_dot(x, jnp.ones((2, 8, 4)), gs, fp8_recipe="rowwise", backend=self.BACKEND)


@pytest.mark.gpu
@skip_unless_runs("triton", _gpu.available())
class TestFp8Triton(JaxFp8Test):
    BACKEND = "triton"


@skip_unless_runs("interpret", _interpret.available())
class TestFp8Interpret(JaxFp8Test):
    BACKEND = "interpret"


class TestFp8Reference(JaxFp8Test):
    BACKEND = "reference"
