"""The jax.numpy twins' FP8 part (``moegemm.jax.reference``'s private quantize, dequantize and GEMM twins) on CPU.

Oracles:
- quantize: bit for bit the torch twin (``moegemm._src.torch.reference``), data bytes and scales, eager
  and under ``jax.jit`` with group_sizes traced; the JAX layouts differ from torch's in one place,
  the activations' blockwise scale ([kb, M] here, [M, kb] there);
- dequantize: an independent fp64 numpy dequantization written from the layout description
  (loops over host-side group sizes), and a round trip back to x within the format's rounding;
- GEMMs: ``moegemm.testing.oracle``'s fp64 products of the numpy-dequantized operands, relerr <= 1e-5
  with an fp32 output, expert-parallel ``group_offset`` cases against the slice of the groups.
Inputs carry outliers (a few entries 100x larger), groups include an empty one, a sum < M, sizes
that need clamping and K not a multiple of 16 or 128.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moegemm._src import fp8
from moegemm._src.torch import reference as T
from moegemm.jax import reference as J
from moegemm.testing import oracle

RECIPES = list(fp8.RECIPES)
FP8 = {"e4m3": (jnp.float8_e4m3fn, torch.float8_e4m3fn), "e5m2": (jnp.float8_e5m2, torch.float8_e5m2)}
GEMM_TOL = 1e-5
# Relerr of dequantize(quantize(x)) vs x: a normal fp8 value is within half a step, 2^-4 (e4m3, 3
# mantissa bits) or 2^-3 (e5m2, 2 bits), of x relative, which bounds the Frobenius relerr too (the
# few subnormals are tiny); a wrong scale anywhere is off by O(1).
ROUND_TRIP_TOL = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}

# (M, K, group_sizes): group_sizes None is one group of all M rows.
ACT_CASES = [
    pytest.param(150, 200, [40, 0, 70, 25], id="empty-group-tail"),  # sum < M, K % 128 != 0
    pytest.param(70, 72, [70, 0, 0], id="one-hot"),
    pytest.param(64, 16, [0, 0], id="all-empty"),  # data 0, scales 1
    pytest.param(45, 130, None, id="ungrouped"),
    pytest.param(300, 72, [130, 0, 129], id="multi-block"),  # groups span 128-row blocks, sum < M
    pytest.param(150, 33, [80, -3, 90], id="clamped"),  # sizes [80, 0, 70]: cut at M
    pytest.param(96, 48, [10, 33, 0, 0, 31, 22], id="many-groups"),
]


def outliers(shape, seed) -> np.ndarray:
    """fp32 randn with a few entries (1 in 200) 100x larger, in different rows and columns."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[rng.integers(0, max(flat.size, 1), max(1, flat.size // 200))] *= 100
    return x


def inputs(x: np.ndarray, dtype: str) -> tuple[torch.Tensor, jax.Array]:
    """The same values as a torch tensor and a jax array (bf16: rounded once, by torch, then bit-copied)."""
    xt = torch.from_numpy(x)
    if dtype == "float32":
        return xt, jnp.asarray(x)
    xt = xt.to(getattr(torch, dtype))
    bits = xt.view(torch.int16).numpy()
    return xt, jnp.asarray(bits.view(jnp.dtype(dtype)))


def u8(a) -> np.ndarray:
    """fp8 bytes of a torch or jax array."""
    if isinstance(a, torch.Tensor):
        return a.contiguous().view(torch.uint8).numpy()
    return np.asarray(a).view(np.uint8)


def f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def relerr(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp64 (the diff's norm when ref is 0; inf on NaN)."""
    out, ref = f64(out), f64(ref)
    if np.isnan(out).any():
        return float("inf")
    denom, diff = np.linalg.norm(ref), np.linalg.norm(out - ref)
    return diff / denom if denom > 0 else diff


def group_rows(sizes, M) -> list[range]:
    return [range(0, M)] if sizes is None else oracle.rows(sizes, M)


def gs_arrays(sizes):
    return (None, None) if sizes is None else (torch.tensor(sizes), jnp.asarray(sizes, jnp.int32))


# jit with group_sizes traced (None passes through as an empty pytree); the rest static.
jit_quantize_activation = jax.jit(J._quantize_activation, static_argnames=("recipe", "dtype", "transpose"))
jit_quantize_weight = jax.jit(J._quantize_weight, static_argnames=("recipe", "dtype", "transpose"))


# ---------------------------------------------------------------- numpy dequantization (fp64, loops)


def np_dequant_activation(data, scale, recipe, sizes, M) -> np.ndarray:
    d, s = f64(data), f64(scale)
    K = d.shape[1]
    out = np.zeros((M, K))
    for g, r in enumerate(group_rows(sizes, M)):
        rs = slice(r.start, r.stop)
        if recipe == "tensorwise":
            out[rs] = d[rs] * s.reshape(-1)[g if s.size > 1 else 0]
        elif recipe == "rowwise":
            out[rs] = d[rs] * s[rs, None]
        else:  # s [kb, M]
            for b in range(fp8.cdiv(K, 128)):
                cols = slice(128 * b, min(K, 128 * (b + 1)))
                out[rs, cols] = d[rs, cols] * s[b, rs, None]
    return out


def np_dequant_activation_t(data_t, scale_t, recipe, sizes, M) -> np.ndarray:
    d, s = f64(data_t), f64(scale_t)
    K = d.shape[0]
    out = np.zeros((M, K))
    col = block = 0
    for g, r in enumerate(group_rows(sizes, M)):
        n = len(r)
        rows = d[:, col : col + n].T
        if recipe == "tensorwise":
            out[r.start : r.stop] = rows * s[g]
        elif recipe == "rowwise":
            out[r.start : r.stop] = rows * s[g][None]
        else:
            for j in range(0, n, 128):
                stop = min(n, j + 128)
                out[r.start + j : r.start + stop] = rows[j:stop] * s[block][None]
                block += 1
        col += 16 * fp8.cdiv(n, 16)
    return out


def np_dequant_weight(data, scale, recipe) -> np.ndarray:
    d, s = f64(data), f64(scale)
    G, N, K = d.shape
    if recipe == "tensorwise":
        return d * s[:, None, None]
    if recipe == "rowwise":
        return d * s[:, :, None]
    return d * np.repeat(np.repeat(s, 128, 1), 128, 2)[:, :N, :K]


def owned_columns(sizes, M, G) -> np.ndarray:
    """bool [M_t]: the data_t columns that hold a row."""
    cols = np.zeros(fp8.transposed_columns(M, G), bool)
    col = 0
    for r in group_rows(sizes, M):
        cols[col : col + len(r)] = True
        col += 16 * fp8.cdiv(len(r), 16)
    return cols


# ---------------------------------------------------------------- quantize: bit for bit the torch twin


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("M,K,sizes", ACT_CASES)
@pytest.mark.parametrize("xdtype", ["float32", "bfloat16"])
def test_quantize_activation_matches_torch(xdtype, M, K, sizes, recipe, fmt):
    jd, td = FP8[fmt]
    xt, xj = inputs(outliers((M, K), seed=M * K), xdtype)
    gt, gj = gs_arrays(sizes)
    G = 1 if sizes is None else len(sizes)
    t_data, t_scale, t_data_t, t_scale_t = T.quantize_activation(xt, gt, recipe, td, True)
    if recipe == "blockwise":
        t_scale = t_scale.T  # torch stores [M, kb], JAX [kb, M]
    s_shape, st_shape = fp8.activation_scale_shapes(recipe, M, K, G)
    runs = [("jit", jit_quantize_activation(xj, gj, recipe=recipe, dtype=jd, transpose=True))]
    if xdtype == "float32":  # eager too (op by op: slow to compile), once per case
        runs.append(("eager", J._quantize_activation(xj, gj, recipe, jd, True)))
    for mode, q in runs:
        data, scale, data_t, scale_t = q
        assert data.dtype == jd and data.shape == (M, K), mode
        assert data_t.dtype == jd and data_t.shape == (K, fp8.transposed_columns(M, G)), mode
        assert scale.dtype == jnp.float32 and scale_t.dtype == jnp.float32, mode
        assert scale.shape == (s_shape[::-1] if recipe == "blockwise" else s_shape), mode
        assert scale_t.shape == st_shape, mode
        np.testing.assert_array_equal(u8(data), u8(t_data), err_msg=f"{mode}: data")
        np.testing.assert_array_equal(np.asarray(scale), t_scale.numpy(), err_msg=f"{mode}: scale")
        np.testing.assert_array_equal(u8(data_t), u8(t_data_t), err_msg=f"{mode}: data_t")
        np.testing.assert_array_equal(np.asarray(scale_t), t_scale_t.numpy(), err_msg=f"{mode}: scale_t")
    # The layout, spelled out: unowned rows are 0 with scale 1, data_t's other columns 0.
    end = max([r.stop for r in group_rows(sizes, M)], default=0)
    assert not u8(data)[end:].any()
    if recipe == "rowwise":
        assert (np.asarray(scale)[end:] == 1).all()
    if recipe == "blockwise":
        assert (np.asarray(scale)[:, end:] == 1).all()
    assert not u8(data_t)[:, ~owned_columns(sizes, M, G)].any()
    if end:  # not vacuous: outliers make the scales differ from 1
        assert (np.asarray(scale) != 1).any()


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_activation_no_transpose(recipe, fmt):
    jd, td = FP8[fmt]
    sizes = [40, 0, 70, 25]
    xt, xj = inputs(outliers((150, 72), seed=5), "float16")
    t_data, t_scale, _, _ = T.quantize_activation(xt, torch.tensor(sizes), recipe, td, False)
    data, scale, data_t, scale_t = jit_quantize_activation(
        xj, jnp.asarray(sizes), recipe=recipe, dtype=jd, transpose=False
    )
    assert data_t is None and scale_t is None
    np.testing.assert_array_equal(u8(data), u8(t_data))
    np.testing.assert_array_equal(
        np.asarray(scale), (t_scale.T if recipe == "blockwise" else t_scale).numpy()
    )


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("G,N,K", [(3, 200, 72), (2, 72, 200), (4, 130, 16), (1, 256, 129)])
def test_quantize_weight_matches_torch(G, N, K, recipe, fmt):
    jd, td = FP8[fmt]
    w = outliers((G, N, K), seed=G * N * K)
    if G > 1:
        w[1] = 0  # an all-zero expert: scale 1
    wt, wj = inputs(w, "bfloat16")
    expect = T.quantize_weight(wt, recipe, td, True)
    s_shape, st_shape = fp8.weight_scale_shapes(recipe, G, N, K)
    for mode, q in [
        ("eager", J._quantize_weight(wj, recipe, jd, True)),
        ("jit", jit_quantize_weight(wj, recipe=recipe, dtype=jd, transpose=True)),
    ]:
        data, scale, data_t, scale_t = q
        assert data.shape == (G, N, K) and data_t.shape == (G, K, N), mode
        assert scale.shape == s_shape and scale_t.shape == st_shape, mode
        np.testing.assert_array_equal(u8(data), u8(expect[0]), err_msg=f"{mode}: data")
        np.testing.assert_array_equal(np.asarray(scale), expect[1].numpy(), err_msg=f"{mode}: scale")
        np.testing.assert_array_equal(u8(data_t), u8(expect[2]), err_msg=f"{mode}: data_t")
        np.testing.assert_array_equal(np.asarray(scale_t), expect[3].numpy(), err_msg=f"{mode}: scale_t")
    no_t = jit_quantize_weight(wj, recipe=recipe, dtype=jd, transpose=False)
    assert no_t[2] is None and no_t[3] is None
    np.testing.assert_array_equal(u8(no_t[0]), u8(expect[0]))


def test_division_is_exact_under_jit():
    """XLA turns a / broadcast(b) into a * (1 / b) (1 ulp off); the twin's scales must not be."""
    amax = jnp.asarray(np.abs(outliers((1 << 14,), seed=3)) * np.float32(2.0**-20))
    for fmt, (jd, td) in FP8.items():
        want = T.scale_of(torch.from_numpy(np.array(amax)), td).numpy()
        got = jax.jit(partial(J._scale_of, dtype=jd))(amax)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=fmt)


# ---------------------------------------------------------------- amax_reduce


@pytest.mark.parametrize("recipe", RECIPES)
def test_amax_reduce_sees_every_amax(recipe):
    """Every amax goes through amax_reduce (here: x4, exact) before its scale: the scales are 4x."""
    jd = jnp.float8_e4m3fn
    sizes = jnp.asarray([40, 0, 70, 25], jnp.int32)
    x = jnp.asarray(outliers((150, 200), seed=11))
    w = jnp.asarray(outliers((3, 200, 72), seed=12))
    seen = []

    def times4(a):
        seen.append(a.shape)
        return a * 4

    act = partial(J._quantize_activation, recipe=recipe, dtype=jd, transpose=True)
    weight = partial(J._quantize_weight, recipe=recipe, dtype=jd, transpose=True)
    for plain, reduced in [
        (jax.jit(act)(x, sizes), jax.jit(partial(act, amax_reduce=times4))(x, sizes)),
        (jax.jit(weight)(w), jax.jit(partial(weight, amax_reduce=times4))(w)),
    ]:
        for name, p, r in [("scale", plain[1], reduced[1]), ("scale_t", plain[3], reduced[3])]:
            p, r = np.asarray(p), np.asarray(r)
            assert r.shape == p.shape
            np.testing.assert_array_equal(r, np.where(p == 1, 1, 4 * p), err_msg=name)
    assert (
        seen
        == {
            "tensorwise": [(4,), (3,)],
            "rowwise": [(150,), (4, 200), (3, 200), (3, 72)],
            "blockwise": [
                (2, 150),
                (6, 200),
                (3, 2, 1),
            ],  # amax shaped as its scale: [kb, M], [cdiv(M,128)+G, K]
        }[recipe]
    )


def test_amax_reduce_pmax_over_k_shards():
    """The sharding use: tensorwise activations split along K (and a weight along N) over a named
    axis, amax_reduce=pmax: each shard's scales and data equal the unsharded ones."""
    jd = jnp.float8_e4m3fn
    sizes = jnp.asarray([40, 0, 70, 25], jnp.int32)
    x = jnp.asarray(outliers((150, 192), seed=13))
    pmax = lambda a: jax.lax.pmax(a, "k")
    full = jit_quantize_activation(x, sizes, recipe="tensorwise", dtype=jd, transpose=False)
    shards = x.reshape(150, 2, 96).transpose(1, 0, 2)
    shard_fn = lambda xs, gs: J._quantize_activation(xs, gs, "tensorwise", jd, False, amax_reduce=pmax)
    data, scale, _, _ = jax.jit(jax.vmap(shard_fn, in_axes=(0, None), axis_name="k"))(shards, sizes)
    np.testing.assert_array_equal(np.asarray(scale[0]), np.asarray(full[1]))
    np.testing.assert_array_equal(np.asarray(scale[1]), np.asarray(full[1]))
    np.testing.assert_array_equal(u8(data.transpose(1, 0, 2).reshape(150, 192)), u8(full[0]))
    w = jnp.asarray(outliers((3, 64, 72), seed=14))
    wfull = jit_quantize_weight(w, recipe="tensorwise", dtype=jd, transpose=False)
    wshard_fn = lambda ws: J._quantize_weight(ws, "tensorwise", jd, False, amax_reduce=pmax)
    wdata, wscale, _, _ = jax.jit(jax.vmap(wshard_fn, in_axes=1, axis_name="k"))(w.reshape(3, 2, 32, 72))
    np.testing.assert_array_equal(np.asarray(wscale[1]), np.asarray(wfull[1]))
    np.testing.assert_array_equal(u8(wdata.transpose(1, 0, 2, 3).reshape(3, 64, 72)), u8(wfull[0]))


# ---------------------------------------------------------------- dequantize


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("M,K,sizes", ACT_CASES)
def test_dequantize_activation(M, K, sizes, recipe, fmt):
    jd, _ = FP8[fmt]
    x = outliers((M, K), seed=M + K)
    _, gj = gs_arrays(sizes)
    data, scale, data_t, scale_t = jit_quantize_activation(
        jnp.asarray(x), gj, recipe=recipe, dtype=jd, transpose=True
    )
    owned = np.zeros(M, bool)
    for r in group_rows(sizes, M):
        owned[r.start : r.stop] = True
    x_owned = np.where(owned[:, None], x, 0)
    if sizes is None:
        dq = jax.jit(lambda d, s: J._dequantize_activation(d, s, recipe, None))(data, scale)
        dq_t = jax.jit(lambda d, s: J._dequantize_activation_t(d, s, recipe, None, M))(data_t, scale_t)
    else:
        dq = jax.jit(partial(J._dequantize_activation, recipe=recipe))(data, scale, group_sizes=gj)
        dq_t = jax.jit(partial(J._dequantize_activation_t, recipe=recipe, M=M))(
            data_t, scale_t, group_sizes=gj
        )
    assert dq.shape == dq_t.shape == (M, K) and dq.dtype == dq_t.dtype == jnp.float32
    want = np_dequant_activation(data, scale, recipe, sizes, M)
    want_t = np_dequant_activation_t(data_t, scale_t, recipe, sizes, M)
    np.testing.assert_allclose(f64(dq), want, rtol=2e-7, atol=0)
    np.testing.assert_allclose(f64(dq_t), want_t, rtol=2e-7, atol=0)
    assert not f64(dq)[~owned].any() and not f64(dq_t)[~owned].any()
    if owned.any() and K:
        assert relerr(dq, x_owned) <= ROUND_TRIP_TOL[fmt]
        assert relerr(dq_t, x_owned) <= ROUND_TRIP_TOL[fmt]
    bf = J._dequantize_activation(data, scale, recipe, gj, dtype=jnp.bfloat16)
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf), np.asarray(dq.astype(jnp.bfloat16)))


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("recipe", RECIPES)
def test_dequantize_weight(recipe, fmt):
    jd, _ = FP8[fmt]
    w = outliers((3, 200, 136), seed=21)
    data, scale, data_t, scale_t = jit_quantize_weight(
        jnp.asarray(w), recipe=recipe, dtype=jd, transpose=True
    )
    dq = jax.jit(partial(J._dequantize_weight, recipe=recipe))(data, scale)
    np.testing.assert_allclose(f64(dq), np_dequant_weight(data, scale, recipe), rtol=2e-7, atol=0)
    assert relerr(dq, w) <= ROUND_TRIP_TOL[fmt]
    # data_t [G, K, N] with scale_t: the weight transposed
    dq_t = J._dequantize_weight(data_t, scale_t, recipe)
    assert relerr(jnp.swapaxes(dq_t, 1, 2), w) <= ROUND_TRIP_TOL[fmt]


# ---------------------------------------------------------------- m-grouped GEMM


M_CASES = [
    pytest.param(150, 200, 72, [40, 0, 70, 25], id="empty-group-tail"),
    pytest.param(300, 72, 136, [130, 0, 129], id="multi-block"),
    pytest.param(64, 40, 24, [0, 0], id="all-empty"),
    pytest.param(150, 33, 40, [80, -3, 90], id="clamped"),
]


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("M,K,N,sizes", M_CASES)
def test_m_grouped_matches_oracle(M, K, N, sizes, recipe, fmt):
    jd, _ = FP8[fmt]
    G = len(sizes)
    gj = jnp.asarray(sizes, jnp.int32)
    x, sx, _, _ = jit_quantize_activation(
        jnp.asarray(outliers((M, K), seed=1)), gj, recipe=recipe, dtype=jd, transpose=False
    )
    w, sw, _, _ = jit_quantize_weight(
        jnp.asarray(outliers((G, N, K), seed=2)), recipe=recipe, dtype=jd, transpose=False
    )
    f = jax.jit(partial(J._m_grouped_mm_fp8, recipe=recipe, out_dtype=jnp.float32))
    out = f(x, sx, w, sw, gj)
    assert out.shape == (M, N) and out.dtype == jnp.float32
    xd = np_dequant_activation(x, sx, recipe, sizes, M)
    ref = oracle.m_grouped_mm(xd, np_dequant_weight(w, sw, recipe).swapaxes(1, 2), sizes)
    assert relerr(out, ref) <= GEMM_TOL
    end = max(r.stop for r in oracle.rows(sizes, M))
    assert not f64(out)[end:].any()
    out_bf16 = J._m_grouped_mm_fp8(x, sx, w, sw, gj, recipe, jnp.bfloat16)
    assert out_bf16.dtype == jnp.bfloat16 and relerr(out_bf16, ref) <= 8e-3


SIZES_TOTAL = [30, 0, 45, 20, 25]  # M = 150: rows 120.. unowned


@pytest.mark.parametrize("x_groups", ["full", "ungrouped"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_m_grouped_group_offset(recipe, x_groups):
    """w holds groups [offset, offset + 2) of 5; x quantized with all 5 groups (tensorwise: 5 scales)
    or as one group (tensorwise: a single scale); rows of other groups are 0."""
    jd = jnp.float8_e4m3fn
    M, K, N, G_local = 150, 200, 72, 2
    gj = jnp.asarray(SIZES_TOTAL, jnp.int32)
    xq_groups = gj if x_groups == "full" else None
    x, sx, _, _ = jit_quantize_activation(
        jnp.asarray(outliers((M, K), seed=3)), xq_groups, recipe=recipe, dtype=jd, transpose=False
    )
    w_all, sw_all, _, _ = jit_quantize_weight(
        jnp.asarray(outliers((5, N, K), seed=4)), recipe=recipe, dtype=jd, transpose=False
    )
    if recipe == "tensorwise":
        assert sx.shape == ((5,) if x_groups == "full" else (1,))

    @jax.jit
    def f(x, sx, w, sw, gs, offset):
        return J._m_grouped_mm_fp8(
            x, sx, w, sw, gs, recipe, jnp.float32, x_group_sizes=xq_groups, group_offset=offset
        )

    full = J._m_grouped_mm_fp8(x, sx, w_all, sw_all, gj, recipe, jnp.float32, x_group_sizes=xq_groups)
    xd = np_dequant_activation(x, sx, recipe, None if xq_groups is None else SIZES_TOTAL, M)
    wd = np_dequant_weight(w_all, sw_all, recipe)
    rows = oracle.rows(SIZES_TOTAL, M)
    for offset in range(5 - G_local + 1):
        local = slice(offset, offset + G_local)
        out = f(x, sx, w_all[local], sw_all[local], gj, jnp.int32(offset))
        ref = np.zeros((M, N))
        mine = np.zeros(M, bool)
        for g in range(offset, offset + G_local):
            r = slice(rows[g].start, rows[g].stop)
            ref[r] = xd[r] @ wd[g].T
            mine[r] = True
        assert relerr(out, ref) <= GEMM_TOL, offset
        assert not f64(out)[~mine].any(), offset
        # the slice of the all-groups product
        assert relerr(out, np.where(mine[:, None], f64(full), 0)) <= 1e-6, offset


# ---------------------------------------------------------------- k-grouped GEMM


K_CASES = [
    pytest.param(150, 200, 72, [40, 0, 70, 25], id="empty-group-tail"),
    pytest.param(300, 72, 136, [130, 0, 129], id="multi-block"),
    pytest.param(64, 16, 24, [0, 0], id="all-empty"),
    pytest.param(150, 33, 40, [80, -3, 90], id="clamped"),
]


def quantized_t(M, Ka, Nb, gj, recipe, jd, seed):
    q = partial(jit_quantize_activation, group_sizes=gj, recipe=recipe, dtype=jd, transpose=True)
    a, b = q(jnp.asarray(outliers((M, Ka), seed=seed))), q(jnp.asarray(outliers((M, Nb), seed=seed + 1)))
    return a[2], a[3], b[2], b[3]


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("M,Ka,Nb,sizes", K_CASES)
def test_k_grouped_matches_oracle(M, Ka, Nb, sizes, recipe, fmt):
    jd, _ = FP8[fmt]
    G = len(sizes)
    gj = jnp.asarray(sizes, jnp.int32)
    a_t, sa, b_t, sb = quantized_t(M, Ka, Nb, gj, recipe, jd, seed=7)
    ad = np_dequant_activation_t(a_t, sa, recipe, sizes, M)
    bd = np_dequant_activation_t(b_t, sb, recipe, sizes, M)
    live = np.array([len(r) > 0 for r in oracle.rows(sizes, M)])

    f = jax.jit(partial(J._k_grouped_mm_fp8, M, recipe=recipe, out_dtype=jnp.float32))
    out = f(a_t=a_t, sa=sa, b_t=b_t, sb=sb, group_sizes=gj)
    assert out.shape == (G, Ka, Nb) and out.dtype == jnp.float32
    ref = oracle.k_grouped_mm(ad, bd, sizes)
    assert relerr(out, ref) <= GEMM_TOL
    assert not f64(out)[~live].any()

    # with c: live groups add, empty groups return c bit for bit (c holds -0.0s)
    c = outliers((G, Ka, Nb), seed=9)
    c[:, 0, :] = -0.0
    g = jax.jit(partial(J._k_grouped_mm_fp8, M, recipe=recipe, out_dtype=jnp.float32))
    out_c = g(a_t=a_t, sa=sa, b_t=b_t, sb=sb, group_sizes=gj, c=jnp.asarray(c))
    assert out_c.dtype == jnp.float32
    ref_c = oracle.k_grouped_mm(ad, bd, sizes, c=c)
    assert relerr(out_c, ref_c) <= GEMM_TOL
    np.testing.assert_array_equal(np.asarray(out_c)[~live].view(np.uint32), c[~live].view(np.uint32))
    assert live.any() == (relerr(out_c, c) > 1e-3)  # live groups did change


@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("recipe", RECIPES)
def test_k_grouped_group_offset(recipe, with_c):
    """out holds groups [offset, offset + 2) of 5; the transposed copies hold all 5."""
    jd = jnp.float8_e4m3fn
    M, Ka, Nb, n = 150, 200, 72, 2
    gj = jnp.asarray(SIZES_TOTAL, jnp.int32)
    a_t, sa, b_t, sb = quantized_t(M, Ka, Nb, gj, recipe, jd, seed=17)
    full = J._k_grouped_mm_fp8(M, a_t, sa, b_t, sb, gj, recipe, jnp.float32)
    ad = np_dequant_activation_t(a_t, sa, recipe, SIZES_TOTAL, M)
    bd = np_dequant_activation_t(b_t, sb, recipe, SIZES_TOTAL, M)
    ref_all = oracle.k_grouped_mm(ad, bd, SIZES_TOTAL)
    c = outliers((n, Ka, Nb), seed=19) if with_c else None

    @jax.jit
    def f(a_t, sa, b_t, sb, gs, offset, c):
        return J._k_grouped_mm_fp8(
            M, a_t, sa, b_t, sb, gs, recipe, jnp.float32, c=c, group_offset=offset, num_groups=n
        )

    for offset in range(5 - n + 1):
        out = f(a_t, sa, b_t, sb, gj, jnp.int32(offset), None if c is None else jnp.asarray(c))
        assert out.shape == (n, Ka, Nb)
        ref = ref_all[offset : offset + n] + (0 if c is None else c)
        assert relerr(out, ref) <= GEMM_TOL, offset
        sliced = f64(full)[offset : offset + n] + (0 if c is None else c)
        assert relerr(out, sliced) <= 1e-6, offset
        for j in range(n):
            if SIZES_TOTAL[offset + j] == 0:  # the empty group 1: 0, or c untouched
                want = np.zeros((Ka, Nb), np.float32) if c is None else c[j]
                np.testing.assert_array_equal(np.asarray(out[j]).view(np.uint32), want.view(np.uint32))


# ---------------------------------------------------------------- degenerate shapes, one group


@pytest.mark.parametrize("recipe", RECIPES)
def test_degenerate_shapes(recipe):
    """M = 0 / K = 0 activations, empty weights and zero local groups: the layouts' shapes, scales 1,
    zero products (the front end routes these to the twin)."""
    jd = jnp.float8_e4m3fn
    for M, K, sizes in [(0, 72, [0, 0]), (20, 0, [5, 0, 3]), (0, 0, [1])]:
        gj = jnp.asarray(sizes, jnp.int32)
        data, scale, data_t, scale_t = jit_quantize_activation(
            jnp.zeros((M, K), jnp.bfloat16), gj, recipe=recipe, dtype=jd, transpose=True
        )
        s_shape, st_shape = fp8.activation_scale_shapes(recipe, M, K, len(sizes))
        assert data.shape == (M, K) and data_t.shape == (K, fp8.transposed_columns(M, len(sizes)))
        assert scale.shape == (s_shape[::-1] if recipe == "blockwise" else s_shape)
        assert scale_t.shape == st_shape
        assert (np.asarray(scale) == 1).all() and (np.asarray(scale_t) == 1).all()
        out = J._k_grouped_mm_fp8(M, data_t, scale_t, data_t, scale_t, gj, recipe, jnp.float32)
        assert out.shape == (len(sizes), K, K) and not f64(out).any()
    for G, N, K in [(0, 8, 8), (2, 0, 8), (2, 8, 0)]:
        q = jit_quantize_weight(jnp.ones((G, N, K)), recipe=recipe, dtype=jd, transpose=True)
        s_shape, st_shape = fp8.weight_scale_shapes(recipe, G, N, K)
        assert q[0].shape == (G, N, K) and q[2].shape == (G, K, N)
        assert q[1].shape == s_shape and q[3].shape == st_shape
    gj = jnp.asarray([3, 4], jnp.int32)
    x, sx, x_t, sx_t = J._quantize_activation(jnp.ones((10, 8)), gj, recipe, jd, True)
    w, sw, _, _ = J._quantize_weight(jnp.ones((0, 5, 8)), recipe, jd, False)
    out = J._m_grouped_mm_fp8(x, sx, w, sw, gj, recipe, jnp.float32, group_offset=jnp.int32(0))
    assert out.shape == (10, 5) and not f64(out).any()
    out = J._k_grouped_mm_fp8(
        10, x_t, sx_t, x_t, sx_t, gj, recipe, jnp.float32, group_offset=jnp.int32(1), num_groups=0
    )
    assert out.shape == (0, 8, 8)


@pytest.mark.parametrize("recipe", RECIPES)
def test_m_grouped_one_group(recipe):
    """group_sizes=None: one group of all M rows (x quantized ungrouped, w [1, N, K])."""
    jd = jnp.float8_e4m3fn
    M, K, N = 45, 130, 40
    x, sx, _, _ = jit_quantize_activation(
        jnp.asarray(outliers((M, K), seed=31)), None, recipe=recipe, dtype=jd, transpose=False
    )
    w, sw, _, _ = jit_quantize_weight(
        jnp.asarray(outliers((1, N, K), seed=32)), recipe=recipe, dtype=jd, transpose=False
    )
    out = jax.jit(lambda *a: J._m_grouped_mm_fp8(*a, None, recipe, jnp.float32))(x, sx, w, sw)
    ref = np_dequant_activation(x, sx, recipe, None, M) @ np_dequant_weight(w, sw, recipe)[0].T
    assert relerr(out, ref) <= GEMM_TOL
