"""FP8 kernel launches from PyTorch tensors (quantize, scaled m- and k-grouped GEMMs).

Inputs are validated by ``moegemm.torch.fp8``; outputs are allocated there. Launch descriptions are
memoized on static facts, and launches go through ``DirectLaunch`` like the BF16 kernels'.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess

import torch
import triton

from moegemm._src import configs, fp8, plan
from moegemm._src.kernels import k_grouped_fp8_ws as k_ws
from moegemm._src.kernels import m_grouped_fp8_ws as ws
from moegemm._src.kernels import quantize_fp8 as qk
from moegemm._src.kernels import swiglu as swiglu_kernels
from moegemm._src.kernels.k_grouped_fp8 import k_grouped_mm_fp8_kernel
from moegemm._src.kernels.m_grouped_fp8 import m_grouped_mm_fp8_kernel
from moegemm._src.torch.launch import (
    _GL_DTYPES,
    CAPABILITIES,
    INTERPRET,
    DirectLaunch,
    _dtype_name,
    _ensure_allocator,
    _nvmma_layout,
    _target,
)

M_GROUPED_FP8 = DirectLaunch(m_grouped_mm_fp8_kernel)
M_GROUPED_FP8_WS = DirectLaunch(ws.m_grouped_mm_fp8_ws_kernel)
K_GROUPED_FP8 = DirectLaunch(k_grouped_mm_fp8_kernel)
K_GROUPED_FP8_WS = DirectLaunch(k_ws.k_grouped_mm_fp8_ws_kernel, descriptors=True)
GROUP_AMAX = DirectLaunch(qk.fp8_group_amax_kernel)
GROUPED_COLUMNS = DirectLaunch(qk.grouped_columns_kernel)
QUANTIZE_TILES = DirectLaunch(qk.fp8_quantize_tiles_kernel)
QUANTIZE_PAIR = DirectLaunch(qk.fp8_quantize_pair_kernel)
QUANTIZE_ROWS = DirectLaunch(qk.fp8_quantize_rows_kernel)
QUANTIZE_COLS = DirectLaunch(qk.fp8_quantize_cols_kernel)
SWIGLU = DirectLaunch(swiglu_kernels.swiglu_kernel)
SWIGLU_BWD = DirectLaunch(swiglu_kernels.swiglu_bwd_kernel)
LAUNCHES = (
    M_GROUPED_FP8,
    M_GROUPED_FP8_WS,
    K_GROUPED_FP8,
    K_GROUPED_FP8_WS,
    GROUP_AMAX,
    GROUPED_COLUMNS,
    QUANTIZE_TILES,
    QUANTIZE_PAIR,
    QUANTIZE_ROWS,
    QUANTIZE_COLS,
    SWIGLU,
    SWIGLU_BWD,
)


def clear_launch_cache() -> None:
    _m_launch.cache_clear()
    _m_ws_launch.cache_clear()
    _k_launch.cache_clear()
    _k_ws_launch.cache_clear()
    _quantize_config.cache_clear()
    _quantize_pair.cache_clear()
    _epilogue_split.cache_clear()
    for launch in LAUNCHES:
        launch.clear()


plan.on_change(clear_launch_cache)  # plan.constrain(fp8_ws=False) runs every FP8 GEMM on the Triton kernels


@functools.lru_cache(maxsize=4096)
def _m_launch(
    M, N, K, G, recipe, dtype, device, max_stride, has_bias, fast_accum, gather=False, epilogue=""
) -> plan.Plan:
    """The Triton FP8 kernel's plan (no warp-specialized layout facts: the plan keeps the Triton kernel)."""
    problem = _m_problem(
        M, N, K, G, recipe, dtype, max_stride, fast_accum, has_bias=has_bias, gather=("x",) if gather else (),
        epilogue=epilogue,
    )  # fmt: skip
    return plan.plan(problem, _target(device), CAPABILITIES)


def _m_problem(M, N, K, G, recipe, dtype, max_stride, fast_accum, **facts) -> plan.Problem:
    """The FP8 m-grouped ``plan.Problem`` with the layout facts and options ``facts``."""
    return plan.Problem(
        plan.M_GROUPED,
        M,
        N,
        K,
        G,
        _dtype_name(dtype),
        max_stride=max_stride,
        recipe=recipe,
        fast_accum=fast_accum,
        **facts,
    )


def _tma_store_layout(out: torch.Tensor) -> bool:
    """Whether out [M, N] takes a TMA descriptor: N contiguous, the row stride and the base 16-byte aligned."""
    return out.stride(1) == 1 and (out.stride(0) * out.element_size()) % 16 == 0 and out.data_ptr() % 16 == 0


@functools.lru_cache(maxsize=4096)
def _m_ws_launch(
    M, N, K, G, recipe, dtype, device, max_stride, has_bias, fast_accum, x_strides, w_strides, out_facts
) -> plan.Plan | None:
    """The warp-specialized plan, or None where the plan keeps the Triton kernel. The layout facts it needs:
    K-contiguous operands with 16-byte aligned row strides (TMA; fp8 storage pads rows to 16, a foreign view
    may not), w's groups back to back (its loader views w as [G * N, K]). out_facts (out's element size,
    whether it takes a TMA descriptor) choose its epilogue's store. Decided once per shape and facts."""
    ws_layout = (
        x_strides[1] == 1
        and w_strides[2] == 1
        and x_strides[0] % 16 == 0
        and w_strides[1] % 16 == 0
        and w_strides[0] == N * w_strides[1]
    )
    if not ws_layout:
        return None
    out_itemsize, tma_store_layout = out_facts
    problem = _m_problem(
        M, N, K, G, recipe, dtype, max_stride, fast_accum, has_bias=has_bias, ws_layout=True,
        row_strides=(x_strides[0], w_strides[1]), out_itemsize=out_itemsize, tma_store_layout=tma_store_layout,
    )  # fmt: skip
    chosen = plan.plan(problem, _target(device), CAPABILITIES)
    return chosen if chosen.kernel == "m_grouped_fp8_ws" else None


@functools.lru_cache(maxsize=4096)
def _k_launch(M, N, K, G, recipe, dtype, device, max_stride, accumulate, fast_accum) -> plan.Plan:
    """The Triton FP8 wgrad's plan."""
    problem = plan.Problem(
        plan.K_GROUPED,
        M,
        N,
        K,
        G,
        _dtype_name(dtype),
        max_stride=max_stride,
        accumulate=accumulate,
        recipe=recipe,
        fast_accum=fast_accum,
    )
    return plan.plan(problem, _target(device), CAPABILITIES)


@functools.lru_cache(maxsize=4096)
def _k_ws_launch(
    M, N, K, G, recipe, dtype, device, max_stride, accumulate, fast_accum, a_strides, b_strides, out_strides,
    out_dtype,
) -> plan.Plan | None:  # fmt: skip
    """The warp-specialized wgrad's plan, or None where the plan keeps the Triton kernel. The layout facts it
    needs: token-contiguous transposed copies (``moegemm._src.fp8`` storage has them, a foreign view may not)
    and a contiguous out with 16-byte rows (its TMA descriptor). Static facts only, so it is decided once per
    shape."""
    if not (a_strides[1] == 1 and b_strides[1] == 1):
        return None
    out_tma = out_strides == (K * N, N, 1) and (N * out_dtype.itemsize) % 16 == 0
    problem = plan.Problem(
        plan.K_GROUPED,
        M,
        N,
        K,
        G,
        _dtype_name(dtype),
        out_itemsize=out_dtype.itemsize,
        max_stride=max_stride,
        accumulate=accumulate,
        ws_layout=True,
        tma_store_layout=out_tma,
        row_strides=(a_strides[0], b_strides[0]),
        out_span=(K - 1) * abs(out_strides[1]) + (N - 1) * abs(out_strides[2]) + 1,
        recipe=recipe,
        fast_accum=fast_accum,
    )
    chosen = plan.plan(problem, _target(device), CAPABILITIES)
    return chosen if chosen.kernel == "k_grouped_fp8_ws" else None


@functools.lru_cache(maxsize=64)
def _quantize_config(device: torch.device) -> tuple[configs.QuantizeConfig, int]:
    target = _target(device)
    return plan.quantize_config(target), target.programs


def _rows_grid(R, C, bg, has_sizes, config, fp8_max) -> _Grid:
    block_r, block_c, one_sweep, warps, grid = qk.rows_geometry(R, C, config)
    meta = dict(
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        BLOCK_G=bg,
        HAS_SIZES=has_sizes,
        NUM_STAGES=config.sweep_stages,
        FP8_MAX=fp8_max,
        EMULATE_CAST=INTERPRET,
        ONE_SWEEP=one_sweep,
        num_warps=warps,
    )
    return _Grid(grid, meta)


@functools.lru_cache(maxsize=64)
def _quantize_pair(
    recipe: str, transpose: bool, rows_aligned: bool, long_groups: bool, device: torch.device
) -> bool:
    """plan.quantize_pair for a launch that writes data (and data_t when ``transpose``) on ``device``;
    ``long_groups``: its groups average plan.ROWWISE_PAIR_MIN_ROWS rows or more."""
    target = _target(device)
    ptxas = _ptxas_release() if target.name == "sm90" and CAPABILITIES.gluon else ""
    group_rows = plan.ROWWISE_PAIR_MIN_ROWS if long_groups else 0
    return plan.quantize_pair(recipe, transpose, True, rows_aligned, group_rows, target, CAPABILITIES, ptxas)


@functools.cache
def _ptxas_release() -> str:
    """'X.Y' of the ptxas Triton compiles sm_90 kernels with (TRITON_PTXAS_PATH or the wheel's); "" where it
    cannot be asked (no such binary: the plan then keeps the two launches)."""
    from triton.backends.nvidia.compiler import get_ptxas_version

    try:
        version = get_ptxas_version(90)
    except (OSError, RuntimeError, subprocess.CalledProcessError):
        return ""
    found = re.search(r"release (\d+\.\d+)", version)
    return found.group(1) if found else ""


def launch_m_grouped_fp8(
    x,
    sx,
    w,
    sw,
    group_sizes,
    out,
    bias,
    recipe: str,
    fast_accum: bool,
    *,
    gather=None,
    epilogue: str = "",
    act=None,
    row_scale=None,
    act_out=None,
) -> torch.Tensor | None:
    """out [M, N] = for g: (x * sx)[rows(g)] @ ((w * sw)[g])^T (+ bias[g]); x [Mx, K], w [G, N, K] fp8, M = out's
    rows. The expert block's options (as ``launch.launch_m_grouped_fused``'s; docs/design.md, 'FP8 expert
    block'): ``gather`` int32 [M] reads row r from x[gather[r]] (and its row scales); epilogue "swiglu" (N = 2n:
    act [M, 2n] = z, out [M, n] = h) or "swiglu_bwd" (the product is dh [M, n]; from act = z and row_scale it
    writes out [M, 2n] = dz, act_out [M, n] = s * h, and returns ds [cdiv(n, BLOCK_N), M] fp32). act, act_out
    and out are contiguous with an epilogue."""
    M, K = out.shape[0], x.shape[1]
    G, N, _ = w.shape
    fused = gather is not None or bool(epilogue)
    if epilogue:
        for name, t in (("out", out), ("act", act), ("act_out", act_out)):
            if t is not None and not t.is_contiguous():
                raise ValueError(
                    f"launch_m_grouped_fp8: {name} must be contiguous with epilogue {epilogue!r}"
                )
    sb = (0, 0) if bias is None else bias.stride()
    strides = (*x.stride(), *w.stride(), *out.stride(), *sb)
    spec = (M, N, K, G, recipe, x.dtype, x.device, max(map(abs, strides)), bias is not None, fast_accum)
    if fused:
        spec = (*spec, gather is not None, epilogue)
    ds = None
    if epilogue == "swiglu_bwd":
        block_n = _m_launch(*spec).meta["BLOCK_N"]
        ds = torch.empty(triton.cdiv(N, block_n), M, dtype=torch.float32, device=out.device)
    if M == 0 or N == 0:
        return ds
    # TMA also needs 16-byte aligned base pointers (the one dynamic fact).
    ws_launch = (
        _m_ws_launch(*spec, x.stride(), w.stride(), (out.element_size(), _tma_store_layout(out)))
        if not fused and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
        else None
    )
    if ws_launch is not None:
        _ensure_allocator()  # the loader's descriptors live in Triton's global scratch
        M_GROUPED_FP8_WS.launch(
            spec,
            (x, w, sx, sw, group_sizes, sx if bias is None else bias, out),
            (M, N, K, G, x.stride(0), w.stride(1), *out.stride(), *sb, *_m_scale_strides(recipe, sx, sw)),
            lambda: ws_launch,
        )
        return ds
    unused = group_sizes  # a pointer slot the launch's options never read
    M_GROUPED_FP8.launch(
        spec,
        # No group offset: group_sizes fills its slot, never read.
        (
            x,
            w,
            sx,
            sw,
            group_sizes,
            unused,
            sx if bias is None else bias,
            unused if gather is None else gather,
            out if act is None else act,
            sx if row_scale is None else row_scale,
            out if act_out is None else act_out,
            sx if ds is None else ds,
            out,
        ),
        (M, N, K, G, G, *strides, *_m_scale_strides(recipe, sx, sw)),
        lambda: _m_launch(*spec),
    )
    return ds


def launch_k_grouped_fp8(
    M: int, a_t, sa, b_t, sb, group_sizes, out, accumulate: bool, recipe: str, fast_accum: bool
) -> None:
    """out [G, Ka, Nb] (+)= for g: (a * sa)[rows(g)]^T @ (b * sb)[rows(g)], from the transposed copies
    a_t [Ka, M_t], b_t [Nb, M_t] (``moegemm._src.fp8`` layout) of activations with M rows."""
    G, K, N = out.shape
    if G == 0 or K == 0 or N == 0:
        return
    strides = (*a_t.stride(), *b_t.stride(), *out.stride())
    spec = (M, N, K, G, recipe, a_t.dtype, a_t.device, max(map(abs, strides)), accumulate, fast_accum)
    # TMA also needs 16-byte aligned base pointers (the one dynamic fact).
    ws_launch = (
        _k_ws_launch(*spec, a_t.stride(), b_t.stride(), out.stride(), out.dtype)
        if a_t.data_ptr() % 16 == 0 and b_t.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
        else None
    )
    if ws_launch is not None:
        _ensure_allocator()  # the loader's descriptors live in Triton's global scratch
        block = [k_ws.BLOCK_K // 2, k_ws.SUB_N]
        layout = _nvmma_layout(*block, _GL_DTYPES[out.dtype])
        out_desc = k_ws.TensorDescriptor(out.view(G * K, N), [G * K, N], [N, 1], block, layout)
        K_GROUPED_FP8_WS.launch(
            (*spec, out.dtype),
            (out_desc, a_t, b_t, sa, sb, group_sizes, out),
            (M, N, K, G, a_t.stride(0), b_t.stride(0), *_k_scale_strides(sa), *_k_scale_strides(sb)),
            lambda: ws_launch,
        )
        return
    K_GROUPED_FP8.launch(
        spec,
        (a_t, b_t, sa, sb, group_sizes, group_sizes, out, out),
        (M, N, K, G, G, *strides, *_k_scale_strides(sa), *_k_scale_strides(sb)),
        lambda: _k_launch(*spec),
    )


def _m_scale_strides(recipe: str, sx: torch.Tensor, sw: torch.Tensor) -> tuple[int, ...]:
    """(sx: group, row, k-block; sw: group, n, k-block) strides; a single tensorwise scale broadcasts."""
    if recipe == "tensorwise":
        return (sx.stride(0) if sx.numel() > 1 else 0, 0, 0, sw.stride(0), 0, 0)
    if recipe == "rowwise":
        return (0, sx.stride(0), 0, *sw.stride(), 0)
    return (0, *sx.stride(), *sw.stride())


@functools.lru_cache(maxsize=4096)
def _epilogue_split(M, N, K, G, recipe, dtype, device, max_stride, fast_accum, epilogue, row_strides) -> bool:
    problem = _m_problem(
        M, N, K, G, recipe, dtype, max_stride, fast_accum, gather=("x",), epilogue=epilogue, ws_layout=True,
        row_strides=row_strides,
    )  # fmt: skip
    return plan.fp8_epilogue_split(problem, _target(device), CAPABILITIES)


def fp8_epilogue_split(x, w, M: int, recipe: str, fast_accum: bool, epilogue: str) -> bool:
    """``plan.fp8_epilogue_split`` for the expert block's gathered launch of x's FP8 storage rows (padded to 16
    bytes, so a gathered copy has 16-byte rows) against w [G, N, K]: True where the copy, the plain launch and the
    SwiGLU row kernel run instead of one fused launch."""
    G, N, K = w.shape
    ws_layout = w.stride(2) == 1 and w.stride(1) % 16 == 0 and w.stride(0) == N * w.stride(1)
    if not ws_layout or w.data_ptr() % 16:
        return False
    row_strides = (fp8.padded(K), w.stride(1))
    return _epilogue_split(
        M, N, K, G, recipe, x.dtype, x.device, max(row_strides), fast_accum, epilogue, row_strides
    )


def launch_swiglu(z, h) -> None:
    """h [R, n] = silu(z[:, :n]) * z[:, n:] (``kernels/swiglu.py``); contiguous."""
    R, N = h.shape
    if R == 0 or N == 0:
        return
    spec = ("swiglu", N, z.dtype, h.dtype, z.device)
    grid = (triton.cdiv(R, swiglu_kernels.BLOCK_R), triton.cdiv(N, swiglu_kernels.BLOCK_N))
    meta = dict(
        N=N,
        BLOCK_R=swiglu_kernels.BLOCK_R,
        BLOCK_N=swiglu_kernels.BLOCK_N,
        num_warps=swiglu_kernels.NUM_WARPS,
    )
    SWIGLU.launch(spec, (z, h), (R,), lambda: _Grid(grid, meta))


def launch_swiglu_bwd(dh, z, row_scale, dz, hs, amax=None) -> torch.Tensor:
    """From dh [R, n], z [R, 2n] and row_scale [R]: dz [R, 2n], hs [R, n] = s * h, and returns ds [1, R] fp32
    (``kernels/swiglu.py``); contiguous. ``amax`` (fp32 [2], zeros): gets max |dz| and max |hs|."""
    R, N = dh.shape
    ds = torch.empty(1, R, dtype=torch.float32, device=dh.device)
    if R == 0:
        return ds
    if N == 0:
        return ds.zero_()
    spec = ("swiglu_bwd", N, dh.dtype, z.dtype, dz.dtype, dz.device, amax is not None)
    grid = (triton.cdiv(R, swiglu_kernels.BLOCK_R),)
    meta = dict(
        N=N,
        BLOCK_R=swiglu_kernels.BLOCK_R,
        BLOCK_N=swiglu_kernels.BLOCK_N,
        AMAX=amax is not None,
        num_warps=swiglu_kernels.NUM_WARPS,
    )
    tensors = (dh, z, row_scale, dz, hs, ds, ds if amax is None else amax)
    SWIGLU_BWD.launch(spec, tensors, (R,), lambda: _Grid(grid, meta))
    return ds


def _k_scale_strides(s: torch.Tensor) -> tuple[int, int]:
    """(group or token block, column) strides of a wgrad operand's scale_t ([G], [G, K] or [blocks, K])."""
    return s.stride(0), (s.stride(1) if s.dim() > 1 else 0)


def launch_quantize_fp8(
    x: torch.Tensor,
    group_sizes: torch.Tensor | None,
    recipe: str,
    q: torch.Tensor,
    s: torch.Tensor,
    qt: torch.Tensor | None,
    st: torch.Tensor | None,
    *,
    rows_per_group: int,
    G: int,
    gather: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    move_bytes: bool = False,
    colsum: torch.Tensor | None = None,
) -> None:
    """Quantizes the rows of x [R, C] (a weight passes [G * N, K] with rows_per_group = N and no
    group_sizes) into q [R, C] and s, and, when qt is given, the transposed copy qt and st. Layouts
    are ``moegemm._src.fp8``'s; a weight's qt is [G, C, N] (group-local), an activation's [C, M_t].
    q and s None: the transposed copy alone (its own launch). ``gather`` int32 [R] (transposed copy alone): row r
    is x[gather[r]] (the expert block's wgrad operands, docs/design.md, 'FP8 expert block'); tensorwise then takes
    its scales from ``amax`` [G], given (the launch computes no amax of gathered rows). ``move_bytes``
    (tensorwise, transposed copy alone): x is FP8 of qt's dtype at the copy's scale, and qt takes its bytes.
    ``colsum`` [G, C] (rowwise with qt, or tensorwise without a given amax; ungathered): also colsum[g] =
    sum(x[rows(g)], 0), the bias gradient when x is dy, from the read of x its amax takes (docs/design.md, 'FP8 bias
    gradient')."""
    R, C = x.shape if gather is None else (gather.shape[0], x.shape[1])
    if gather is not None and (q is not None or (recipe == "tensorwise" and amax is None and not move_bytes)):
        raise ValueError(
            "a gathered quantize writes the transposed copy alone, and tensorwise takes its amax"
        )
    if move_bytes and (recipe != "tensorwise" or q is not None or qt is None or x.dtype != qt.dtype):
        raise ValueError(
            f"move_bytes: a tensorwise transposed copy alone of FP8 rows into their own dtype, got {recipe}, "
            f"x {x.dtype}, data_t {None if qt is None else qt.dtype}, data {'given' if q is not None else None}"
        )
    if colsum is not None and (
        not plan.colsum_fused(recipe, qt is not None, amax is not None)
        or gather is not None
        or move_bytes
        or colsum.shape != (G, C)
    ):
        raise ValueError(
            f"colsum: the [G, C] = {(G, C)} column sums of ungathered rows, from rowwise's transposed copy or "
            f"tensorwise's amax pass; got {tuple(colsum.shape)} ({recipe}, transposed copy "
            f"{'given' if qt is not None else None}, amax {'given' if amax is not None else None}, gather "
            f"{'given' if gather is not None else None})"
        )
    if C == 0 or G == 0:
        return
    if R == 0:
        # No rows: every group is empty, so its scales are 1 (a zero block's) and the transposed copy's padding
        # columns are zeros, as the twins write them; a wgrad reads both.
        if colsum is not None:
            colsum.zero_()
        for t in (s, st):
            if t is not None:
                t.fill_(1.0)
        if qt is not None:
            qt.view(torch.uint8).zero_()
        return
    t_only = q is None
    if t_only:  # placeholders for the skipped data launch's pointers (q's dtype is the cast's)
        q, s = qt, st
    config, sms = _quantize_config(x.device)
    if gather is not None:
        config = dataclasses.replace(
            config,
            t_cols=config.gather_t_cols,
            t_warps=config.gather_t_warps,
            t_chunks=config.gather_t_chunks,
            num_stages=config.gather_stages,
        )
    fp8_max = fp8.FP8_MAX[_dtype_name(q.dtype)]
    has_sizes = group_sizes is not None
    sizes = group_sizes if has_sizes else s  # an unread pointer when the groups are uniform
    bg = max(16, triton.next_power_of_2(G + 1))
    max_stride = max(map(abs, (*x.stride(), *q.stride(), *(qt.stride() if qt is not None else ()))))
    aligned = x.stride(1) == 1 and x.stride(0) % 16 == 0 and C % 16 == 0 and x.data_ptr() % 16 == 0
    # Offsets within a pair tile reach its 128-element side times the largest stride.
    pair_wide = 2 * fp8.SCALE_BLOCK * max_stride >= 2**31 or x.numel() >= 2**31
    long_groups = R >= plan.ROWWISE_PAIR_MIN_ROWS * G
    pair = (
        not t_only
        and gather is None
        and _quantize_pair(recipe, qt is not None, aligned, long_groups, x.device)
    )
    if recipe == "rowwise" and pair:
        # The rows' and the groups' column maxima from one read, then both copies from a second (plan.quantize_pair).
        rmax = _group_amax(
            x, sizes, has_sizes, st, colsum, rows_per_group, G, bg, config, sms, fp8_max, st=st
        )
        qt8, t_local = qt.view(torch.uint8), qt.dim() == 3
        QUANTIZE_PAIR.launch(
            ("pair", x.device, R, C, G, has_sizes, qk.ROWWISE, t_local, fp8_max, pair_wide),
            (x, sizes, rmax, q, s, qt8, st),
            (
                R,
                C,
                G,
                rows_per_group,
                *x.stride(),
                *q.stride(),
                *(qt8.stride() if t_local else (0, *qt8.stride())),
                0,
                s.stride(-1),
                0,
                *st.stride(),
                rmax.stride(0),
            ),
            lambda: _pair_grid(
                R, C, G, bg, has_sizes, config, sms, qk.ROWWISE, t_local, fp8_max, pair_wide, rmax.shape[0]
            ),
        )
        return
    if recipe == "rowwise":
        if not t_only:
            QUANTIZE_ROWS.launch(
                ("rows", x.device, R, C, G, has_sizes, fp8_max),
                (x, sizes, q, s),
                (R, C, G, *x.stride(), *q.stride(), s.stride(-1)),
                lambda: _rows_grid(R, C, bg, has_sizes, config, fp8_max),
            )
        if qt is not None:
            t_strides = qt.stride() if qt.dim() == 3 else (0, *qt.stride())
            fused = colsum is not None
            QUANTIZE_COLS.launch(
                ("cols", x.device, R, C, G, has_sizes, qt.dim(), fp8_max, gather is not None, fused),
                (
                    x,
                    sizes,
                    sizes if gather is None else gather,
                    colsum if fused else st,
                    qt.view(torch.uint8),
                    st,
                ),
                (
                    R,
                    C,
                    G,
                    rows_per_group,
                    *x.stride(),
                    *t_strides,
                    *st.stride(),
                    *(colsum.stride() if fused else (0, 0)),
                ),
                lambda: _cols_grid(
                    R,
                    C,
                    G,
                    config,
                    BLOCK_G=bg,
                    HAS_SIZES=has_sizes,
                    NUM_STAGES=config.sweep_stages,
                    T_GROUP_LOCAL=qt.dim() == 3,
                    FP8_MAX=fp8_max,
                    EMULATE_CAST=INTERPRET,
                    GATHER=gather is not None,
                    COLSUM=fused,
                ),
            )
        return
    if recipe == "blockwise":
        scaling = qk.BLOCK_128X128 if s.dim() == 3 else qk.BLOCK_1X128
    elif move_bytes:
        # No scales: amax, s and st are unread pointers.
        scaling, x = qk.TENSOR, x.view(torch.uint8)
        amax = s = st = qt.view(torch.uint8)
    elif amax is not None:
        scaling = qk.TENSOR
    else:
        scaling = qk.TENSOR
        amax = torch.zeros(G, dtype=torch.float32, device=x.device)
        _group_amax(x, sizes, has_sizes, amax, colsum, rows_per_group, G, bg, config, sms, fp8_max)
    write_t = qt is not None
    t_local = write_t and qt.dim() == 3
    if write_t:
        qt8 = qt.view(torch.uint8)
        t_strides = qt8.stride() if t_local else (0, *qt8.stride())
    else:
        qt8, st, t_strides = q.view(torch.uint8), s, (0, 0, 0)
    # Scale strides by mode: TENSOR s[g]; BLOCK_1X128 s[row, kb] and st[blk, col]; BLOCK_128X128 s[g, nb, kb].
    if scaling == qk.TENSOR:
        s_strides, st_strides = (s.stride(0), 0, 0), (0, 0)
    elif scaling == qk.BLOCK_1X128:
        s_strides, st_strides = (0, *s.stride()), st.stride() if write_t else (0, 0)
    else:
        s_strides, st_strides = s.stride(), (0, 0)
    if pair:
        # One read of x for both copies (plan.quantize_pair).
        QUANTIZE_PAIR.launch(
            ("pair", x.device, R, C, G, has_sizes, scaling, t_local, fp8_max, pair_wide),
            (x, sizes, amax if scaling == qk.TENSOR else s, q, s, qt8, st),
            (R, C, G, rows_per_group, *x.stride(), *q.stride(), *t_strides, *s_strides, *st_strides, 0),
            lambda: _pair_grid(R, C, G, bg, has_sizes, config, sms, scaling, t_local, fp8_max, pair_wide),
        )
        return
    # data/scale and the transposed copy come from separate launches (fp8_quantize_tiles_kernel says why).
    for write_q in (False,) if t_only else (True, False) if write_t else (True,):
        # Offsets within a tile reach its widest side times the largest stride.
        wide = 2 * max(qk.tile_shape(scaling, write_q, config)) * max_stride >= 2**31 or x.numel() >= 2**31
        QUANTIZE_TILES.launch(
            (
                "tiles",
                x.device,
                R,
                C,
                G,
                has_sizes,
                scaling,
                write_q,
                t_local,
                fp8_max,
                wide,
                gather is not None,
                move_bytes,
            ),
            (
                x,
                sizes,
                amax if scaling == qk.TENSOR else s,
                sizes if gather is None else gather,
                q,
                s,
                qt8,
                st,
            ),
            (R, C, G, rows_per_group, *x.stride(), *q.stride(), *t_strides, *s_strides, *st_strides),
            lambda write_q=write_q, wide=wide: _tiles_grid(
                R,
                C,
                G,
                scaling,
                write_q,
                bg,
                has_sizes,
                config,
                sms,
                SCALING=scaling,
                WRITE_Q=write_q,
                WRITE_T=not write_q,
                T_GROUP_LOCAL=t_local,
                FP8_MAX=fp8_max,
                EMULATE_CAST=INTERPRET,
                WIDE_OFFSETS=wide,
                GATHER=gather is not None,
                BYTES=move_bytes,
            ),
        )


# Data tiles a row tile of the amax pass takes when it also sums columns or takes rowwise's maxima
# (fp8_group_amax_kernel's ROW_STEPS).
AMAX_COLSUM_ROW_STEPS = 8
COLUMNS_BLOCK = 256  # columns a grouped_columns_kernel program reduces


def _group_amax(
    x, sizes, has_sizes, amax, colsum, rows_per_group, G, block_g, config, sms, fp8_max, st=None
) -> torch.Tensor | None:
    """amax [G] (zeroed) = max |x[rows(g)]|; or, given st (rowwise), st [G, C] = the groups' column scales, and
    the return value rmax [cdiv(C, 128), R] = the rows' maxima per 128 columns; with colsum [G, C] also x's
    per-group column sums from the same read: fp8_group_amax_kernel's row-tile partials, which
    grouped_columns_kernel reduces per group in tile order."""
    R, C = x.shape
    rowwise = st is not None
    steps = AMAX_COLSUM_ROW_STEPS if colsum is not None or rowwise else 1
    partial = pmax = rmax = x  # unread pointers where not taken
    if steps > 1:  # partials: their row tiles (host time the amax-only launch does not pay)
        block_r, _, _, _, (row_tiles, _) = qk.tiles_geometry(R, C, G, qk.TENSOR, True, config, sms, steps)
        if colsum is not None:
            partial = torch.empty(row_tiles, C, dtype=torch.float32, device=x.device)
    if rowwise:
        pmax = torch.empty(row_tiles, C, dtype=torch.float32, device=x.device)
        rmax = torch.empty(triton.cdiv(C, fp8.SCALE_BLOCK), R, dtype=torch.float32, device=x.device)
    GROUP_AMAX.launch(
        ("amax", x.device, R, C, G, has_sizes, steps, colsum is not None, rowwise),
        (x, sizes, partial, pmax, rmax, amax),
        (R, C, G, rows_per_group, *x.stride(), C, R),
        lambda: _tiles_grid(
            R,
            C,
            G,
            qk.TENSOR,
            True,
            block_g,
            has_sizes,
            config,
            sms,
            steps,
            COLSUM=colsum is not None,
            ROW_STEPS=steps,
            ROWWISE=rowwise,
        ),
    )
    if colsum is None and not rowwise:
        return None
    GROUPED_COLUMNS.launch(
        (
            "columns",
            x.device,
            R,
            C,
            G,
            has_sizes,
            steps,
            None if colsum is None else colsum.dtype,
            rowwise,
            fp8_max,
        ),
        (partial, pmax, sizes, st if colsum is None else colsum, colsum if st is None else st),
        (
            R,
            C,
            G,
            rows_per_group,
            C,
            *((0, 0) if colsum is None else colsum.stride()),
            *((0, 0) if st is None else st.stride()),
        ),
        lambda: _Grid(
            (G * triton.cdiv(C, COLUMNS_BLOCK),),
            dict(
                TILE_R=block_r * steps,
                BLOCK_C=COLUMNS_BLOCK,
                BLOCK_G=block_g,
                HAS_SIZES=has_sizes,
                SUMS=colsum is not None,
                SCALES=rowwise,
                FP8_MAX=fp8_max,
                num_warps=4,
            ),
        ),
    )
    return rmax if rowwise else None


def _pair_grid(
    R, C, G, block_g, has_sizes, config, sms, scaling, t_local, fp8_max, wide, amax_cols=1
) -> _Grid:
    """The pair kernel's launch description (``qk.pair_geometry``); ``amax_cols``: ROWWISE's row maxima per row.
    Built on a miss only (DirectLaunch)."""
    chunks, grid = qk.pair_geometry(R, C, G, config, sms)
    return _Grid(
        grid,
        dict(
            CHUNKS=chunks,
            BLOCK_G=block_g,
            HAS_SIZES=has_sizes,
            NUM_STAGES=config.pair_stages,
            SCALING=scaling,
            T_GROUP_LOCAL=t_local,
            FP8_MAX=fp8_max,
            WIDE_OFFSETS=wide,
            # rowwise's maxima, one 128 x AMAX_COLS load (at least 32 columns: the checked form). Past C = 32768
            # (AMAX_COLS 512) the 16-warp kernel spills 32 bytes (docs/design.md, 'Quantize').
            AMAX_COLS=max(32, triton.next_power_of_2(amax_cols)),
            num_warps=config.pair_warps,
        ),
    )


def _cols_grid(R, C, G, config, **meta) -> _Grid:
    """The rowwise transposed-copy launch's description (``qk.cols_geometry``). Built on a miss only."""
    block_r, block_c, warps, grid = qk.cols_geometry(R, C, G, config)
    return _Grid(grid, dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps, **meta))


def _tiles_grid(R, C, G, scaling, write_q, block_g, has_sizes, config, sms, row_steps=1, **meta) -> _Grid:
    """The launch description of the amax or a tile kernel: ``qk.tiles_geometry`` and the shared
    meta-parameters, plus the kernel's own (``meta``). Built on a miss only (DirectLaunch)."""
    block_r, block_c, chunks, warps, grid = qk.tiles_geometry(
        R, C, G, scaling, write_q, config, sms, row_steps
    )
    return _Grid(
        grid,
        dict(
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            CHUNKS=chunks,
            BLOCK_G=block_g,
            HAS_SIZES=has_sizes,
            NUM_STAGES=config.num_stages,
            num_warps=warps,
            **meta,
        ),
    )


class _Grid:
    """A launch description (grid, meta) for DirectLaunch.describe."""

    def __init__(self, grid: tuple[int, ...], meta: dict) -> None:
        self.grid, self.meta = grid, meta
