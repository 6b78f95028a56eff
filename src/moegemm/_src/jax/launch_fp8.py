"""Launch descriptions of the FP8 kernels (quantize, scaled m- and k-grouped GEMMs) from JAX arrays.

Each builder returns a ``KernelCall`` (``moegemm._src.jax.launch``) that both executors run: ``gpu.py`` on
the GPU, the Triton interpreter in a ``pure_callback`` on CPU. As in the BF16 glue, sizes and strides
go in ``meta`` (the GPU executor passes the kernel's non-constexpr ints at run time), arrays are row-major and
their strides come from their shapes. Kernel parameters are pointers in order, outputs last: a kernel
pointer a launch never touches is filled with an input of the right type (named at each call).

Storage (``moegemm._src.fp8`` has the recipes' scale layouts): activations' data [M, K], a blockwise
activation scale [cdiv(K, 128), M] (M-major: the GEMM loads a tile's row scales as one vector),
data_t [K, M_t]; a weight's data [G, N, K] and data_t [G, K, padded(N)] (the quantize kernels write
each transposed row through its 16-aligned end; the GEMMs read [..., :N] through the row stride).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton

from moegemm._src import configs, fp8, plan
from moegemm._src.jax.launch import KernelCall, Target, _offset_arg, capabilities
from moegemm._src.kernels import quantize_fp8 as qk
from moegemm._src.kernels.k_grouped_fp8 import k_grouped_mm_fp8_kernel
from moegemm._src.kernels.k_grouped_fp8_ws import k_grouped_mm_fp8_ws_kernel
from moegemm._src.kernels.m_grouped_fp8 import m_grouped_mm_fp8_kernel
from moegemm._src.kernels.m_grouped_fp8_ws import m_grouped_mm_fp8_ws_kernel


def fp8_max(dtype) -> float:
    return fp8.FP8_MAX[jnp.dtype(dtype).name]


def _block_g(G: int) -> int:
    return max(16, triton.next_power_of_2(G + 1))


def _sizes_arg(group_sizes: jax.Array | None, x: jax.Array) -> jax.Array:
    """The kernels' group_sizes_ptr: the sizes, or (uniform groups, never read) x filling the slot."""
    return x if group_sizes is None else group_sizes


def _kernel_args(kernel, values: dict) -> dict:
    """The entries of ``values`` that are ``kernel``'s parameters: the Triton and the warp-specialized kernel of one
    GEMM share the names of the sizes and strides they both take."""
    names = {p.name for p in kernel.params}
    return {k: v for k, v in values.items() if k in names}


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _quantize_config(target: Target) -> configs.QuantizeConfig:
    return plan.quantize_config(target)


def group_amax_call(
    x: jax.Array, group_sizes: jax.Array | None, G: int, rows_per_group: int, target: Target
) -> KernelCall:
    """amax [G] fp32 = max |x[rows(g)]| over the rows of x [R, C] (groups by group_sizes, or G uniform
    groups of rows_per_group rows); the output starts zeroed (the kernel takes atomic maxima)."""
    R, C = x.shape
    config = _quantize_config(target)
    block_r, block_c, chunks, warps, grid = qk.tiles_geometry(
        R, C, G, qk.TENSOR, True, config, target.programs
    )
    meta = dict(
        R=R,
        C=C,
        G=G,
        rows_per_group=rows_per_group,
        stride_xr=C,
        stride_xc=1,
        stride_pr=0,  # no column sums (COLSUM) nor rowwise maxima: x stands in for their pointers
        stride_rj=0,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        CHUNKS=chunks,
        BLOCK_G=_block_g(G),
        HAS_SIZES=group_sizes is not None,
        NUM_STAGES=config.num_stages,
        num_warps=warps,
    )
    args = (x, _sizes_arg(group_sizes, x), x, x, x)
    return KernelCall(qk.fp8_group_amax_kernel, grid, args, _sds((G,), jnp.float32), meta, {}, (0,))


def quantize_tiles_call(
    x: jax.Array,
    group_sizes: jax.Array | None,
    G: int,
    rows_per_group: int,
    *,
    scaling: int,
    write_q: bool,
    dtype,
    target: Target,
    amax: jax.Array | None = None,
    q: jax.Array | None = None,
    s: jax.Array | None = None,
    t_columns: int = 0,
    t_local_n: int = 0,
) -> KernelCall:
    """One launch of fp8_quantize_tiles_kernel over x [R, C].

    write_q: outputs (data [R, C], scale, two 1-element placeholders), the scale being [G] (TENSOR,
    from ``amax``), [cdiv(C, 128), R] (BLOCK_1X128) or [G, cdiv(N, 128), cdiv(C, 128)] (BLOCK_128X128,
    R = G * N). Otherwise the transposed copy: outputs (data_t as uint8, scale_t): activations
    [C, t_columns] and [cdiv(R, 128) + G, C] (BLOCK_1X128; a placeholder otherwise); a weight
    (``t_local_n`` = padded(N)) [G, C, t_local_n] and a placeholder. ``q`` and ``s`` (the write_q
    launch's outputs) fill their pointers: the kernel takes the FP8 type from q and never writes them.
    """
    R, C = x.shape
    config = _quantize_config(target)
    block_r, block_c, chunks, warps, grid = qk.tiles_geometry(
        R, C, G, scaling, write_q, config, target.programs
    )
    kb = fp8.cdiv(C, fp8.SCALE_BLOCK)
    N = rows_per_group
    if scaling == qk.TENSOR:
        s_shape, s_strides = (G,), (1, 0, 0)
    elif scaling == qk.BLOCK_1X128:
        s_shape, s_strides = (kb, R), (0, 1, R)  # s[row, kb] at kb * R + row
    else:
        nb = fp8.cdiv(N, fp8.SCALE_BLOCK)
        s_shape, s_strides = (G, nb, kb), (nb * kb, kb, 1)
    t_local = t_local_n > 0
    st_strides = (0, 0)
    if write_q:
        outs = (
            _sds((R, C), dtype),
            _sds(s_shape, jnp.float32),
            _sds((1,), jnp.uint8),
            _sds((1,), jnp.float32),
        )
        t_strides = (0, 0, 0)
        # amax: read by TENSOR only; x fills the unread gather slot.
        args = (x, _sizes_arg(group_sizes, x), x if amax is None else amax, x)
    else:
        if t_local:
            qt = _sds((G, C, t_local_n), jnp.uint8)
            t_strides = (C * t_local_n, t_local_n, 1)
        else:
            qt = _sds((C, t_columns), jnp.uint8)
            t_strides = (0, t_columns, 1)
        if scaling == qk.BLOCK_1X128:
            st = _sds((fp8.cdiv(R, fp8.SCALE_BLOCK) + G, C), jnp.float32)
            st_strides = (C, 1)
        else:
            st = _sds((1,), jnp.float32)
        outs = (qt, st)
        args = (x, _sizes_arg(group_sizes, x), x if amax is None else amax, x, q, s)
    max_stride = max(C, t_local_n, t_columns, 1)
    meta = dict(
        R=R,
        C=C,
        G=G,
        rows_per_group=rows_per_group,
        stride_xr=C,
        stride_xc=1,
        stride_qr=C,
        stride_qc=1,
        stride_tg=t_strides[0],
        stride_tc=t_strides[1],
        stride_tr=t_strides[2],
        stride_sg=s_strides[0],
        stride_sr=s_strides[1],
        stride_sc=s_strides[2],
        stride_stb=st_strides[0],
        stride_stc=st_strides[1],
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        CHUNKS=chunks,
        BLOCK_G=_block_g(G),
        HAS_SIZES=group_sizes is not None,
        NUM_STAGES=config.num_stages,
        SCALING=scaling,
        WRITE_Q=write_q,
        WRITE_T=not write_q,
        T_GROUP_LOCAL=t_local,
        FP8_MAX=fp8_max(dtype),
        EMULATE_CAST=target.name == "interpret",
        WIDE_OFFSETS=2 * max(block_r, block_c) * max_stride >= 2**31 or R * C >= 2**31,
        num_warps=warps,
    )
    return KernelCall(qk.fp8_quantize_tiles_kernel, grid, args, outs, meta, {})


def quantize_rows_call(
    x: jax.Array, group_sizes: jax.Array | None, G: int, *, dtype, target: Target
) -> KernelCall:
    """Rowwise: (data [R, C], scale [R]) of x [R, C]; rows past the last group give 0 with scale 1."""
    R, C = x.shape
    config = _quantize_config(target)
    block_r, block_c, one_sweep, warps, grid = qk.rows_geometry(R, C, config)
    meta = dict(
        R=R,
        C=C,
        G=G,
        stride_xr=C,
        stride_xc=1,
        stride_qr=C,
        stride_qc=1,
        stride_s=1,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        BLOCK_G=_block_g(G),
        HAS_SIZES=group_sizes is not None,
        NUM_STAGES=config.sweep_stages,
        FP8_MAX=fp8_max(dtype),
        EMULATE_CAST=target.name == "interpret",
        ONE_SWEEP=one_sweep,
        num_warps=warps,
    )
    outs = (_sds((R, C), dtype), _sds((R,), jnp.float32))
    return KernelCall(qk.fp8_quantize_rows_kernel, grid, (x, _sizes_arg(group_sizes, x)), outs, meta, {})


def quantize_cols_call(
    x: jax.Array,
    group_sizes: jax.Array | None,
    G: int,
    rows_per_group: int,
    *,
    dtype,
    target: Target,
    t_columns: int = 0,
    t_local_n: int = 0,
) -> KernelCall:
    """Rowwise transposed copy: (data_t as uint8, scale_t [G, C]), data_t [C, t_columns] for activations
    or [G, C, t_local_n] for a weight (R = G * N rows, t_local_n = padded(N))."""
    R, C = x.shape
    config = _quantize_config(target)
    block_r, block_c, warps, grid = qk.cols_geometry(R, C, G, config)
    if t_local_n:
        qt, t_strides = _sds((G, C, t_local_n), jnp.uint8), (C * t_local_n, t_local_n, 1)
    else:
        qt, t_strides = _sds((C, t_columns), jnp.uint8), (0, t_columns, 1)
    meta = dict(
        R=R,
        C=C,
        G=G,
        rows_per_group=rows_per_group,
        stride_xr=C,
        stride_xc=1,
        stride_tg=t_strides[0],
        stride_tc=t_strides[1],
        stride_tr=t_strides[2],
        stride_stg=C,
        stride_stc=1,
        stride_bg=0,  # no column sums (COLSUM): x stands in for their pointer
        stride_bc=0,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        BLOCK_G=_block_g(G),
        HAS_SIZES=group_sizes is not None,
        NUM_STAGES=config.sweep_stages,
        T_GROUP_LOCAL=t_local_n > 0,
        FP8_MAX=fp8_max(dtype),
        EMULATE_CAST=target.name == "interpret",
        num_warps=warps,
    )
    outs = (qt, _sds((G, C), jnp.float32))
    return KernelCall(
        qk.fp8_quantize_cols_kernel, grid, (x, _sizes_arg(group_sizes, x), x, x), outs, meta, {}
    )


# ---------------------------------------------------------------- GEMMs


def m_grouped_mm_fp8_call(
    x: jax.Array,
    sx: jax.Array,
    w: jax.Array,
    sw: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: str,
    out_dtype,
    target: Target,
    w_row_stride: int | None = None,
    group_offset: jax.Array | None = None,
    fast_accum: bool = False,
) -> KernelCall:
    """out [M, N] = for g: (x * sx)[rows(g)] @ ((w * sw)[g, :N])^T, x [M, K] and w [G, N, >= K] fp8.

    w_row_stride: the stride of w's rows when w is a transposed copy with padded rows ([G, N, Kp],
    the first K columns read). With ``group_offset``, group_sizes covers G_total groups and w the G
    local ones (rows of other groups come out 0); a tensorwise sx has one scale or one per group of
    group_sizes.
    """
    M, K = x.shape
    G, N = w.shape[0], w.shape[1]
    kw = w.shape[2] if w_row_stride is None else w_row_stride
    g_total = None if group_offset is None else group_sizes.shape[0]
    problem = plan.Problem(
        plan.M_GROUPED,
        M,
        N,
        K,
        G,
        jnp.dtype(x.dtype).name,
        g_total=g_total,
        max_stride=max(K, N, kw, 1),
        recipe=recipe,
        fast_accum=fast_accum,
        # The warp-specialized kernel's TMA reads x [M, K] and w [G * N, kw] (groups back to back): 16-byte rows.
        ws_layout=K % 16 == 0 and kw % 16 == 0,
        row_strides=(K, kw),
        out_itemsize=jnp.dtype(out_dtype).itemsize,
        tma_store_layout=(N * jnp.dtype(out_dtype).itemsize) % 16 == 0,  # XLA's buffers are 16-byte aligned
    )
    launch = plan.plan(problem, target, capabilities(target))
    if recipe == "tensorwise":
        scale_strides = (1 if sx.size > 1 else 0, 0, 0, 1, 0, 0)
    elif recipe == "rowwise":
        scale_strides = (0, 1, 0, N, 1, 0)
    else:  # sx [kb, M] M-major; sw [G, nb, kb]
        nb, kb = sw.shape[1], sw.shape[2]
        scale_strides = (0, 1, M, nb * kb, kb, 1)
    names = ("stride_sxg", "stride_sxm", "stride_sxk", "stride_swg", "stride_swn", "stride_swk")
    sizes = dict(
        M=M,
        N=N,
        K=K,
        G=G,
        G_TOTAL=G if g_total is None else g_total,
        stride_xm=K,
        stride_xk=1,
        stride_wg=N * kw,
        stride_wn=kw,
        stride_wk=1,
        stride_om=N,
        stride_on=1,
        stride_bg=0,
        stride_bn=0,
        **dict(zip(names, scale_strides)),
    )
    out_shape = _sds((M, N), out_dtype)
    if launch.kernel == "m_grouped_fp8_ws":
        # No bias: sx fills bias_ptr's slot. The ints go at run time (the executor), as PyTorch passes them.
        meta = {**launch.meta, **_kernel_args(m_grouped_mm_fp8_ws_kernel, sizes)}
        args = (x, w, sx, sw, group_sizes, sx)
        return KernelCall(m_grouped_mm_fp8_ws_kernel, launch.grid, args, out_shape, meta, {})
    # No bias (HAS_BIAS=False): the kernel never reads bias_ptr; sx fills the slot. The expert block's pointers
    # (gather, act, row_scale, act_out, ds) are not read without its options.
    args = (
        x,
        w,
        sx,
        sw,
        group_sizes,
        _offset_arg(group_offset, group_sizes),
        sx,
        group_sizes,
        sx,
        sx,
        sx,
        sx,
    )
    return KernelCall(m_grouped_mm_fp8_kernel, launch.grid, args, out_shape, {**launch.meta, **sizes}, {})


def k_grouped_mm_fp8_call(
    M: int,
    a_t: jax.Array,
    sa: jax.Array,
    b_t: jax.Array,
    sb: jax.Array,
    group_sizes: jax.Array,
    c: jax.Array | None,
    *,
    recipe: str,
    out_dtype,
    target: Target,
    group_offset: jax.Array | None = None,
    num_groups: int | None = None,
    fast_accum: bool = False,
) -> KernelCall:
    """out [G, Ka, Nb] = for g: (c[g] +) (a * sa)[rows(g)]^T @ (b * sb)[rows(g)] from the transposed
    copies a_t [Ka, M_t], b_t [Nb, M_t] of activations with M rows; c, when given, is aliased to out.
    With ``group_offset``, out holds the num_groups groups [offset, offset + num_groups)."""
    K, M_t = a_t.shape
    N = b_t.shape[0]
    G_total = group_sizes.shape[0]
    G = G_total if group_offset is None else num_groups
    problem = plan.Problem(
        plan.K_GROUPED,
        M,
        N,
        K,
        G,
        jnp.dtype(a_t.dtype).name,
        out_itemsize=jnp.dtype(out_dtype).itemsize,
        g_total=None if group_offset is None else G_total,
        max_stride=max(M_t, K * N, 1),
        accumulate=c is not None,
        recipe=recipe,
        fast_accum=fast_accum,
        # The warp-specialized wgrad's TMA reads the transposed copies' token rows (M_t, a multiple of 16) and
        # stores out [G * K, N] through a descriptor (16-byte rows); it has no c operand to alias out to.
        ws_layout=M_t % 16 == 0 and c is None,
        tma_store_layout=(N * jnp.dtype(out_dtype).itemsize) % 16 == 0,
        row_strides=(M_t, M_t),
        out_span=K * N,
    )
    launch = plan.plan(problem, target, capabilities(target))
    # Scales of the wgrad operands: [G] (tensorwise), [G, K] (rowwise), [blocks, K] (blockwise).
    scale_strides = lambda s: (1, 0) if s.ndim == 1 else (s.shape[1], 1)
    out_shape = _sds((G, K, N), out_dtype)
    sizes = dict(
        M=M,
        N=N,
        K=K,
        G=G,
        G_TOTAL=G_total,
        stride_ak=M_t,
        stride_ar=1,
        stride_bn=M_t,
        stride_br=1,
        stride_og=K * N,
        stride_ok=N,
        stride_on=1,
    )
    sizes |= dict(zip(("stride_sag", "stride_sak"), scale_strides(sa)))
    sizes |= dict(zip(("stride_sbg", "stride_sbn"), scale_strides(sb)))
    if launch.kernel == "k_grouped_fp8_ws":
        # The kernel makes out's descriptor (OUT_DESC_ON_DEVICE): a_t fills the host descriptor's slot.
        meta = {**launch.meta, **_kernel_args(k_grouped_mm_fp8_ws_kernel, sizes)}
        args = (a_t, a_t, b_t, sa, sb, group_sizes)
        return KernelCall(k_grouped_mm_fp8_ws_kernel, launch.grid, args, out_shape, meta, {})
    # Without accumulation the kernel never reads c_ptr; a_t fills the slot.
    args = (a_t, b_t, sa, sb, group_sizes, _offset_arg(group_offset, group_sizes), a_t if c is None else c)
    aliases = {} if c is None else {6: 0}
    return KernelCall(
        k_grouped_mm_fp8_kernel, launch.grid, args, out_shape, {**launch.meta, **sizes}, aliases
    )
