"""Scaled m-grouped FP8 GEMM in Gluon for Hopper: ``for g: out[rows(g)] = (x * sx)[rows(g)] @ ((w * sw)[g])^T``.

Shapes and dtypes are ``m_grouped_fp8``'s: x [M, K] and w [G, N, K] float8 (e4m3 or e5m2), both
K-contiguous (stride_xk = stride_wk = 1, rows 16-byte aligned as ``moegemm.fp8`` stores them);
group_sizes [G] on the device; optional bias [G, N]; out [M, N] bf16/fp16/fp32; scales by SCALING
(0 tensorwise, 1 rowwise, 2 blockwise; layouts in ``moegemm.fp8``). Rows past sum(group_sizes) are
0. Same arguments, in the same order, as ``m_grouped_mm_fp8_kernel``, then NUM_STAGES, UNROLL and
PROXY_FENCE, so a launcher can swap the two kernels.

Why Gluon: each BLOCK_K step's partial product is promoted into an fp32 accumulator (scaled, for
blockwise). Triton 3.6 waits for every wgmma right after issuing it (``warp_group_dot_wait
{pendings = 0}``) since the promotion reads its result, so the tensor cores idle through every
promotion (H100: 627 TF/s blockwise vs 1271 with fast accumulation). Here step s + 1's wgmma is
issued before step s is retired (``wgmma.wait_group 1``) and promoted, so the promotion, the scale
loads and the next loads run under a wgmma. Each warpgroup holds three fp32 64x128 register
tiles: the accumulator, the partial being promoted and the partial in flight.

ptxas (CUDA 12.x, sm_90a) keeps wgmmas asynchronous only if no wgmma result crosses the loop's
back edge, neither in flight nor retired-but-unread: else it serializes every wgmma of the kernel
(C7514) or injects a full wait (C7517). So the main loop runs UNROLL = 2 steps an iteration and
drains at its end: half the promotions run under a wgmma, the other half are exposed. UNROLL 3
or 4 would hide more but spill at 128x128 (three 64-register tiles per thread leave ~60).

Loads are cp.async into a NUM_STAGES ring of NVMMA-swizzled shared buffers, not TMA: the kernel
must also launch from JAX through jax-triton 0.3.1, which can neither pass host TMA descriptors
nor provide the global scratch that device-side descriptors need. The load stream runs
NUM_STAGES - 2 steps ahead of the wgmmas over one flattened sequence of this program's (tile, k)
steps, so the next tile's loads start under the current tile's last steps. With K not a multiple
of 16 the partial last K step is loaded through registers instead (cp.async moves 4-16 bytes);
that compiles with some spills: correct, slower.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moegemm.kernels.schedule import locate_row_tile, row_tile_space

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _IMPORT_ERROR = None
except ImportError as e:  # a Triton without (this version of) Gluon's Hopper API

    class _NoGluon:
        """Lets this module import (and supported() answer) where Gluon is missing."""

        constexpr = None

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        constexpr_function = jit

    gluon = gl = _NoGluon()
    _IMPORT_ERROR = e

TENSOR, ROW, BLOCK = 0, 1, 2


def supported() -> bool:
    """Whether this Triton has the Gluon Hopper API this kernel uses (cp.async, async wgmma). It
    says nothing of the device: the kernel needs sm_90 (wgmma)."""
    return _IMPORT_ERROR is None


@gluon.constexpr_function
def _mma_warps(block_m, num_warps):
    """warps_per_cta of the wgmma accumulator: warps along M while each still owns 16 rows (a
    warpgroup covers 64 rows), the rest along N."""
    wm = 4
    while wm < num_warps and block_m >= 16 * wm * 2:
        wm *= 2
    return [wm, num_warps // wm]


@gluon.constexpr_function
def _mma_instr_n(block_n, warps_n):
    """The widest wgmma N (a multiple of 8, <= 256) dividing each warp column's share of BLOCK_N."""
    n = min(256, block_n // warps_n)
    while (block_n // warps_n) % n:
        n -= 8
    return n


@gluon.constexpr_function
def _copy_layout(block_k, num_warps):
    """Registers of the cp.async pointer tiles: 16 consecutive bytes of K per thread (one 16-byte
    cp.async.cg), a warp's threads along K first, so each row segment is read contiguously."""
    tpw_k = max(1, min(32, block_k // 16))
    return gl.BlockedLayout([1, 16], [32 // tpw_k, tpw_k], [num_warps, 1], [1, 0])


@gluon.jit
def _group_row_bounds(group_sizes_ptr, G, M, BLOCK_G: gl.constexpr, layout: gl.constexpr):
    """Gluon twin of ``schedule.group_row_bounds`` (same clamping): restated only because Gluon's
    arange needs an explicit layout. The other schedule helpers take these vectors and are reused."""
    offs = gl.arange(0, BLOCK_G, layout=layout)
    sizes = gl.load(group_sizes_ptr + offs, mask=offs < G, other=0).to(gl.int64)
    sizes = gl.minimum(gl.maximum(sizes, 0), M)
    ends_unclamped = tl.cumsum(sizes, 0)
    starts = gl.minimum(ends_unclamped - sizes, M)
    ends = gl.minimum(ends_unclamped, M)
    return offs, starts, ends


@gluon.constexpr_function
def _sched_layout(num_warps):
    """One group slot per thread (the group vectors are at most a few hundred long)."""
    return gl.BlockedLayout([1], [32], [num_warps], [0])


@gluon.jit
def _tile_coords(tile, sched, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(group, first row, valid rows, first column) of a tile, all int32 (M < 2**31: it is an i32).

    ``sched`` is shared memory holding the group vectors (starts, ends, m_tiles, tile_ends): they
    are read only when a tile starts, and held in registers they would cost the main loop ~10 of
    the registers the three wgmma tiles leave."""
    BLOCK_G: gl.constexpr = sched.shape[1]
    layout: gl.constexpr = _sched_layout(gl.num_warps())
    offs = gl.arange(0, BLOCK_G, layout=layout)
    starts = sched.index(0).load(layout)
    ends = sched.index(1).load(layout)
    m_tiles = sched.index(2).load(layout)
    tile_ends = sched.index(3).load(layout)
    # Steps past this program's last still get coordinates (their loads are masked off): keep them
    # those of a real tile, so that no lookup divides by a zero tile count.
    tile = gl.minimum(tile, gl.max(tile_ends, 0) - 1)
    g, _, n_tile, row0, row_end, _ = locate_row_tile(
        tile, offs, starts, ends, m_tiles, tile_ends, n_tiles, BLOCK_M, GROUP_M
    )
    return g, row0, row_end - row0, n_tile * BLOCK_N


@gluon.jit
def _step_coords(
    step,
    coords,
    pid,
    sched,
    n_tiles,
    K_STEPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    """The tile coordinates of step ``step`` of this program, given those of the step before: a new
    tile (tile pid + (step // K_STEPS) * NUM_PROGRAMS) is located only where one starts, since the
    lookup reduces over the group vectors."""
    if step % K_STEPS == 0:
        coords = _tile_coords(
            pid + (step // K_STEPS) * NUM_PROGRAMS, sched, n_tiles, BLOCK_M, BLOCK_N, GROUP_M
        )
    return coords


@gluon.jit
def _load_rows_through_registers(buf, base, stride, rows, k_left, valid, cp_k):
    """buf[r, k] = base[r * stride + k] for r < rows, k < k_left (else 0), a copy layout's worth of
    rows at a time so that only a few registers hold data (this runs inside the main loop)."""
    layout: gl.constexpr = cp_k.type.layout.parent
    CHUNK: gl.constexpr = layout.threads_per_warp[0] * layout.warps_per_cta[0]
    k_in = (cp_k < k_left)[None, :] & valid
    for c in gl.static_range(buf.shape[0] // CHUNK):
        r = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        chunk = gl.load(
            base + (r[:, None] * stride + cp_k[None, :]), mask=(r < rows)[:, None] & k_in, other=0.0
        )
        buf.slice(c * CHUNK, CHUNK).store(chunk)


@gluon.jit
def _load_tail_step(
    a_buf, b_buf, x_ptr, w_ptr, coords, k0, valid, N, K, stride_xm, stride_wg, stride_wn, cp_k
):
    """The partial last K step when K is not a multiple of 16, through registers (see _load_step)."""
    g, row0, rows, col0 = coords
    x_base = x_ptr + row0.to(gl.int64) * stride_xm + k0
    w_base = w_ptr + g.to(gl.int64) * stride_wg + col0.to(gl.int64) * stride_wn + k0
    _load_rows_through_registers(a_buf, x_base, stride_xm, rows, K - k0, valid, cp_k)
    _load_rows_through_registers(b_buf, w_base, stride_wn, N - col0, K - k0, valid, cp_k)
    # Generic-proxy stores read by wgmma (async proxy): fenced before the barrier that publishes
    # the slot.
    fence_async_shared()


@gluon.jit
def _load_step(
    a_buf,
    b_buf,
    x_ptr,
    w_ptr,
    coords,
    k,
    valid,
    N,
    K,
    stride_xm,
    stride_wg,
    stride_wn,
    cp_m,
    cp_n,
    cp_k,
    BLOCK_K: gl.constexpr,
    EVEN_K: gl.constexpr,
    K_STEPS: gl.constexpr,
):
    """Loads one K step's x [BLOCK_M, BLOCK_K] and w [BLOCK_N, BLOCK_K] tiles into a ring slot.

    cp.async, 16 bytes a copy; masked-off elements are zero-filled (source size 0), so rows past the
    group (and M), columns past N and K past its end add nothing, and ``valid`` False (a step past
    this program's last) reads nothing and leaves a slot of zeros. cp.async moves 4, 8 or 16 bytes,
    so when K is not a multiple of 16 the partial last step cannot be masked per byte with it: that
    one step goes through registers (plain masked loads, then a shared-memory store)."""
    g, row0, rows, col0 = coords
    k0 = k * BLOCK_K
    x_ptrs = x_ptr + row0.to(gl.int64) * stride_xm + k0 + (cp_m[:, None] * stride_xm + cp_k[None, :])
    w_ptrs = (
        w_ptr
        + g.to(gl.int64) * stride_wg
        + col0.to(gl.int64) * stride_wn
        + k0
        + (cp_n[:, None] * stride_wn + cp_k[None, :])
    )
    a_mask = (cp_m < rows)[:, None] & valid
    b_mask = (cp_n < N - col0)[:, None] & valid
    if EVEN_K:
        cp.async_copy_global_to_shared(a_buf, x_ptrs, mask=a_mask)
        cp.async_copy_global_to_shared(b_buf, w_ptrs, mask=b_mask)
    elif K % 16 == 0:  # the K mask is constant over each 16-byte chunk
        k_in = (cp_k < K - k0)[None, :]
        cp.async_copy_global_to_shared(a_buf, x_ptrs, mask=a_mask & k_in)
        cp.async_copy_global_to_shared(b_buf, w_ptrs, mask=b_mask & k_in)
    elif K_STEPS > 1:
        if k < K_STEPS - 1:  # a full step
            cp.async_copy_global_to_shared(a_buf, x_ptrs, mask=a_mask)
            cp.async_copy_global_to_shared(b_buf, w_ptrs, mask=b_mask)
        else:
            _load_tail_step(
                a_buf, b_buf, x_ptr, w_ptr, coords, k0, valid, N, K, stride_xm, stride_wg, stride_wn, cp_k
            )
    else:
        _load_tail_step(
            a_buf, b_buf, x_ptr, w_ptr, coords, k0, valid, N, K, stride_xm, stride_wg, stride_wn, cp_k
        )


@gluon.jit
def _load_scales(
    sx_ptr,
    sw_ptr,
    coords,
    k,
    valid,
    N,
    stride_sxm,
    stride_sxk,
    stride_swg,
    stride_swn,
    stride_swk,
    offs_m,
    offs_n,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,
):
    """Blockwise scales of one step: sx[row, kb] per accumulator row, and sw[g, n // 128, kb] as one
    scalar when the tile sits inside one 128-column weight block (BLOCK_N <= 128), per column
    otherwise. Nothing is read for a step past this program's last (its coordinates are no tile's)."""
    g, row0, rows, col0 = coords
    kb = (k * BLOCK_K) // SCALE_BLOCK
    sx_ptrs = sx_ptr + (row0 + offs_m).to(gl.int64) * stride_sxm + kb * stride_sxk
    sx = gl.load(sx_ptrs, mask=(offs_m < rows) & valid, other=0.0)
    sw_base = sw_ptr + g.to(gl.int64) * stride_swg + kb * stride_swk
    if BLOCK_N <= SCALE_BLOCK:
        sw = gl.load(sw_base + (col0 // SCALE_BLOCK) * stride_swn, mask=valid, other=0.0)
    else:
        sw_mask = (offs_n < N - col0) & valid
        sw = gl.load(sw_base + ((col0 + offs_n) // SCALE_BLOCK) * stride_swn, mask=sw_mask, other=0.0)
    return sx, sw


@gluon.jit
def _promote(acc, partial, sx, sw, BLOCK_N: gl.constexpr, SCALING: gl.constexpr, SCALE_BLOCK: gl.constexpr):
    """acc += partial, scaled by the step's blockwise scales (the other recipes scale in the epilogue)."""
    if SCALING == 2:
        if BLOCK_N <= SCALE_BLOCK:
            acc += partial * (sx * sw)[:, None]
        else:
            acc += partial * sx[:, None] * sw[None, :]
    else:
        acc += partial
    return acc


@gluon.jit
def _pin(x):
    """An empty asm statement with side effects that x passes through (the output is tied to the
    input: no instruction, no copy). It keeps LLVM from sinking x's computation past the next
    wgmma issue, which would read a pre-back-edge result after it: ptxas then injects a full wait."""
    return gl.inline_asm_elementwise("", "=r,0", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _opaque(x):
    """x (an integer scalar) as int64, through a move LLVM can neither see through nor hoist (an asm
    statement with side effects)."""
    return gl.inline_asm_elementwise(
        "mov.b64 $0, $1;", "=l,l", [x.to(gl.int64)], dtype=gl.int64, is_pure=False, pack=1
    )


@gluon.jit
def _col_offsets(cols, stride):
    """cols * stride for the epilogue, computed from the tile's own columns (not a tile-invariant
    offs_n * stride plus a base): LLVM would hoist such a grid out of the main loop, registers the
    three wgmma tiles cannot spare. A unit stride (the JIT makes a 1 a constexpr) keeps the columns'
    contiguity (paired bf16 stores); a runtime one is hidden from LICM and taken in int64."""
    if isinstance(stride, gl.tensor):
        offs = cols.to(gl.int64) * _opaque(stride)
    else:
        offs = cols * stride
    return offs


@gluon.jit
def _epilogue(
    acc,
    out_ptr,
    sx_ptr,
    sw_ptr,
    bias_ptr,
    coords,
    N,
    stride_om,
    stride_on,
    stride_bg,
    stride_bn,
    stride_sxg,
    stride_sxm,
    stride_swg,
    stride_swn,
    offs_m,
    offs_n,
    SCALING: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
    """Tensor/row scales, bias, and the masked store of one finished tile, straight from the wgmma
    register layout (it runs while the next tile's first wgmma is in flight)."""
    g, row0, rows, col0 = coords
    g64 = g.to(gl.int64)
    rows_g = (row0 + offs_m).to(gl.int64)
    cols_g = col0 + offs_n
    col_mask = cols_g < N
    if SCALING == 0:
        acc *= gl.load(sx_ptr + g64 * stride_sxg) * gl.load(sw_ptr + g64 * stride_swg)
    elif SCALING == 1:
        sx = gl.load(sx_ptr + rows_g * stride_sxm, mask=offs_m < rows, other=0.0)
        sw = gl.load(sw_ptr + g64 * stride_swg + _col_offsets(cols_g, stride_swn), mask=col_mask, other=0.0)
        acc *= sx[:, None] * sw[None, :]
    if HAS_BIAS:
        bias = gl.load(bias_ptr + g64 * stride_bg + _col_offsets(cols_g, stride_bn), mask=col_mask, other=0.0)
        acc += bias.to(gl.float32)[None, :]
    out_offs = (rows_g * stride_om)[:, None] + _col_offsets(cols_g, stride_on)[None, :]
    mask = (offs_m < rows)[:, None] & col_mask[None, :]
    gl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _issue(
    s,
    cur,
    ld,
    my_steps,
    pid,
    sched,
    n_tiles,
    a_bufs,
    b_bufs,
    ptrs,
    strides,
    cp_offs,
    mma_offs,
    N,
    K,
    zero,
    K_STEPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
    EVEN_K: gl.constexpr,
    SCALING: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    PROXY_FENCE: gl.constexpr,
):
    """Starts step s: its wgmma (async, into fresh registers), its blockwise scales, and the refill
    of the ring slot of step s - 2 with step s + NUM_STAGES - 2.

    Returns (token, sx, sw, coords of step s, loader coords). Steps past my_steps - 1 (the tail of
    the last unrolled iteration) multiply a slot of zeros, load no scale, and are never stored.
    """
    x_ptr, w_ptr, sx_ptr, sw_ptr, _, _ = ptrs
    (
        stride_xm,
        stride_wg,
        stride_wn,
        _,
        _,
        _,
        _,
        _,
        stride_sxm,
        stride_sxk,
        stride_swg,
        stride_swn,
        stride_swk,
    ) = strides
    cp_m, cp_n, cp_k = cp_offs
    offs_m, offs_n = mma_offs
    cur = _step_coords(s, cur, pid, sched, n_tiles, K_STEPS, NUM_PROGRAMS, BLOCK_M, BLOCK_N, GROUP_M)

    # This thread's copies of step s have landed; the barrier makes everyone's visible to both
    # warpgroups and tells the refill below that both retired step s - 2. No generic-to-async proxy
    # fence by default, as in Triton's own cp.async + wgmma pipelines (its fence pass fences only
    # register-to-shared stores): on sm_90 it is a MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S every step.
    cp.wait_group(NUM_STAGES - 3)
    if PROXY_FENCE:
        fence_async_shared()
    gl.thread_barrier()
    slot = s % NUM_STAGES
    token = warpgroup_mma(
        a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True
    )

    # The scales now, used when the step retires: their latency hides under the wgmma.
    if SCALING == 2:
        sx, sw = _load_scales(
            sx_ptr,
            sw_ptr,
            cur,
            s % K_STEPS,
            s < my_steps,
            N,
            stride_sxm,
            stride_sxk,
            stride_swg,
            stride_swn,
            stride_swk,
            offs_m,
            offs_n,
            BLOCK_N,
            BLOCK_K,
            SCALE_BLOCK,
        )
    else:
        sx = 0.0
        sw = 0.0

    nxt = s + NUM_STAGES - 2
    ld = _step_coords(nxt, ld, pid, sched, n_tiles, K_STEPS, NUM_PROGRAMS, BLOCK_M, BLOCK_N, GROUP_M)
    _load_step(
        a_bufs.index(nxt % NUM_STAGES),
        b_bufs.index(nxt % NUM_STAGES),
        x_ptr,
        w_ptr,
        ld,
        nxt % K_STEPS,
        nxt < my_steps,
        N,
        K,
        stride_xm,
        stride_wg,
        stride_wn,
        cp_m,
        cp_n,
        cp_k,
        BLOCK_K,
        EVEN_K,
        K_STEPS,
    )
    cp.commit_group()
    return token, sx, sw, cur, ld


@gluon.jit
def _retire(
    acc,
    partial,
    sx,
    sw,
    coords,
    t,
    my_steps,
    ptrs,
    strides,
    mma_offs,
    N,
    K_STEPS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    SCALING: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,
):
    """Folds step t's retired partial into the accumulator; after a tile's last step, runs the
    epilogue and restarts the accumulator. t = -1 (nothing yet) and t >= my_steps store nothing."""
    _, _, sx_ptr, sw_ptr, bias_ptr, out_ptr = ptrs
    (
        _,
        _,
        _,
        stride_om,
        stride_on,
        stride_bg,
        stride_bn,
        stride_sxg,
        stride_sxm,
        _,
        stride_swg,
        stride_swn,
        _,
    ) = strides
    offs_m, offs_n = mma_offs
    acc = _promote(acc, partial, sx, sw, BLOCK_N, SCALING, SCALE_BLOCK)
    if (t % K_STEPS == K_STEPS - 1) & (t < my_steps):
        _epilogue(
            acc,
            out_ptr,
            sx_ptr,
            sw_ptr,
            bias_ptr,
            coords,
            N,
            stride_om,
            stride_on,
            stride_bg,
            stride_bn,
            stride_sxg,
            stride_sxm,
            stride_swg,
            stride_swn,
            offs_m,
            offs_n,
            SCALING,
            HAS_BIAS,
        )
        acc = gl.zeros_like(acc)
    return acc


@gluon.jit
def m_grouped_mm_fp8_gluon_kernel(
    x_ptr,
    w_ptr,
    sx_ptr,
    sw_ptr,
    group_sizes_ptr,
    bias_ptr,
    out_ptr,
    M,
    N: gl.constexpr,
    K: gl.constexpr,
    G: gl.constexpr,
    stride_xm,
    stride_xk,  # assumed 1 (16-byte cp.async along K); checked only under debug
    stride_wg,
    stride_wn,
    stride_wk,  # assumed 1, as stride_xk
    stride_om,
    stride_on,
    stride_bg,
    stride_bn,
    stride_sxg,  # TENSOR
    stride_sxm,  # ROW, BLOCK
    stride_sxk,  # BLOCK
    stride_swg,
    stride_swn,  # ROW, BLOCK
    stride_swk,  # BLOCK
    NUM_PROGRAMS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_G: gl.constexpr,
    EVEN_K: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    WIDE_OFFSETS: gl.constexpr,
    SCALING: gl.constexpr,
    SCALE_BLOCK: gl.constexpr,  # 128
    IMPRECISE_ACC: gl.constexpr = None,  # accepted for launcher compatibility: every step is promoted here
    UPCAST: gl.constexpr = False,  # the Triton kernel's interpreter path; Gluon has no interpreter
    NUM_STAGES: gl.constexpr = 4,  # ring slots; the loads run NUM_STAGES - 2 steps ahead of the wgmma
    UNROLL: gl.constexpr = 2,  # steps per main-loop iteration; 3 and more spill at 128x128 (sm_90, 3.6)
    PROXY_FENCE: gl.constexpr = False,  # fence.proxy.async between each step's cp.async and wgmma
):
    gl.static_assert(not UPCAST, "the Gluon kernel does not run under the interpreter")
    gl.static_assert(NUM_STAGES >= 3, "two slots are held by the wgmmas in flight, one or more load")
    gl.static_assert(UNROLL >= 2, "one wgmma must stay in flight while the previous step is promoted")
    gl.static_assert(
        SCALING != 2 or SCALE_BLOCK % BLOCK_K == 0, "blockwise scaling needs BLOCK_K dividing 128"
    )
    gl.static_assert(
        SCALING != 2 or BLOCK_N % SCALE_BLOCK == 0 or SCALE_BLOCK % BLOCK_N == 0,
        "blockwise scaling needs BLOCK_N and 128 to divide one another",
    )
    gl.device_assert((stride_xk == 1) & (stride_wk == 1), "x and w must be contiguous along K")
    NUM_WARPS: gl.constexpr = gl.num_warps()
    K_STEPS: gl.constexpr = triton.cdiv(K, BLOCK_K)
    x_dtype: gl.constexpr = x_ptr.dtype.element_ty
    w_dtype: gl.constexpr = w_ptr.dtype.element_ty

    # --- layouts ------------------------------------------------------------------------------------
    sched_layout: gl.constexpr = _sched_layout(NUM_WARPS)
    warps: gl.constexpr = _mma_warps(BLOCK_M, NUM_WARPS)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=warps, instr_shape=[16, _mma_instr_n(BLOCK_N, warps[1]), 32]
    )
    copy_layout: gl.constexpr = _copy_layout(BLOCK_K, NUM_WARPS)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], x_dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], w_dtype)
    a_bufs = gl.allocate_shared_memory(x_dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(w_dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_layout)

    # --- tile space (moegemm.kernels.schedule) ------------------------------------------------------
    pid = gl.program_id(0)
    offs_g, starts, ends = _group_row_bounds(group_sizes_ptr, G, M, BLOCK_G, sched_layout)
    n_tiles: gl.constexpr = triton.cdiv(N, BLOCK_N)
    starts, ends, m_tiles, tile_ends, total_tiles = row_tile_space(
        offs_g, starts, ends, G, M, n_tiles, BLOCK_M
    )
    sched = gl.allocate_shared_memory(
        gl.int32, [4, BLOCK_G], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    )
    sched.index(0).store(starts.to(gl.int32))
    sched.index(1).store(ends.to(gl.int32))
    sched.index(2).store(m_tiles.to(gl.int32))
    sched.index(3).store(tile_ends.to(gl.int32))
    # Slot G's (zero-fill) tiles come after every group's, so the first owned_tiles tiles compute and
    # this program's steps are one flattened (tile, k) sequence: tile pid + (s // K_STEPS) * NUM_PROGRAMS.
    owned_tiles = (gl.sum(gl.where(offs_g < G, m_tiles, 0), 0) * n_tiles).to(gl.int32)
    my_tiles = gl.cdiv(gl.maximum(owned_tiles - pid, 0), NUM_PROGRAMS)
    my_steps = my_tiles * K_STEPS

    # Index vectors: the cp.async tiles' layout, and the wgmma accumulator's rows and columns.
    cp_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
    cp_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
    cp_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    if WIDE_OFFSETS:
        cp_m = cp_m.to(gl.int64)
        cp_n = cp_n.to(gl.int64)
        cp_k = cp_k.to(gl.int64)
        offs_m = offs_m.to(gl.int64)
        offs_n = offs_n.to(gl.int64)
    cp_offs = (cp_m, cp_n, cp_k)
    mma_offs = (offs_m, offs_n)
    ptrs = (x_ptr, w_ptr, sx_ptr, sw_ptr, bias_ptr, out_ptr)
    strides = (
        stride_xm,
        stride_wg,
        stride_wn,
        stride_om,
        stride_on,
        stride_bg,
        stride_bn,
        stride_sxg,
        stride_sxm,
        stride_sxk,
        stride_swg,
        stride_swn,
        stride_swk,
    )

    # --- prologue: loads of steps 0 .. NUM_STAGES - 3 -------------------------------------------------
    ld = _tile_coords(pid, sched, n_tiles, BLOCK_M, BLOCK_N, GROUP_M)
    for ps in gl.static_range(NUM_STAGES - 2):
        ld = _step_coords(ps, ld, pid, sched, n_tiles, K_STEPS, NUM_PROGRAMS, BLOCK_M, BLOCK_N, GROUP_M)
        _load_step(
            a_bufs.index(ps),
            b_bufs.index(ps),
            x_ptr,
            w_ptr,
            ld,
            ps % K_STEPS,
            ps < my_steps,
            N,
            K,
            stride_xm,
            stride_wg,
            stride_wn,
            cp_m,
            cp_n,
            cp_k,
            BLOCK_K,
            EVEN_K,
            K_STEPS,
        )
        cp.commit_group()

    # --- main loop: UNROLL steps an iteration -------------------------------------------------------
    # Step s's wgmma is issued before step s - 1 is retired (wgmma.wait_group 1) and promoted, so each
    # promotion runs under the next step's wgmma. Except the iteration's last: no wgmma may stay in
    # flight across the loop's back edge, nor may a result retired before it be read after it. ptxas
    # cannot follow a partial wait through the back edge: it serializes every wgmma of the kernel
    # (C7514) in the first case and injects a full wait before the read (C7517) in the second. So an
    # iteration ends with wait_group 0 and an exposed promotion, one in UNROLL.
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    cur = _tile_coords(pid, sched, n_tiles, BLOCK_M, BLOCK_N, GROUP_M)
    for it in range(gl.cdiv(my_steps, UNROLL)):
        # Step s - 1's token, scales and coordinates, set by the unrolled sub-step before.
        prev_token = None
        prev_sx = None
        prev_sw = None
        prev_coords = None
        for u in gl.static_range(UNROLL):
            s = it * UNROLL + u
            token, sx, sw, cur, ld = _issue(
                s,
                cur,
                ld,
                my_steps,
                pid,
                sched,
                n_tiles,
                a_bufs,
                b_bufs,
                ptrs,
                strides,
                cp_offs,
                mma_offs,
                N,
                K,
                zero,
                K_STEPS,
                NUM_PROGRAMS,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                GROUP_M,
                EVEN_K,
                SCALING,
                SCALE_BLOCK,
                NUM_STAGES,
                PROXY_FENCE,
            )
            if u > 0:
                # acc rides through the wait so that LLVM keeps the previous promotion before it
                # (it would sink it below the next wait, out from under the wgmma).
                partial, acc = warpgroup_mma_wait(num_outstanding=1, deps=(prev_token, acc))
                acc = _retire(
                    acc,
                    partial,
                    prev_sx,
                    prev_sw,
                    prev_coords,
                    s - 1,
                    my_steps,
                    ptrs,
                    strides,
                    mma_offs,
                    N,
                    K_STEPS,
                    BLOCK_N,
                    HAS_BIAS,
                    SCALING,
                    SCALE_BLOCK,
                )
            prev_token = token
            prev_sx = sx
            prev_sw = sw
            prev_coords = cur
        partial, acc = warpgroup_mma_wait(num_outstanding=0, deps=(prev_token, acc))
        acc = _retire(
            acc,
            partial,
            prev_sx,
            prev_sw,
            prev_coords,
            it * UNROLL + UNROLL - 1,
            my_steps,
            ptrs,
            strides,
            mma_offs,
            N,
            K_STEPS,
            BLOCK_N,
            HAS_BIAS,
            SCALING,
            SCALE_BLOCK,
        )
        acc = _pin(acc)
    cp.wait_group(0)

    # --- slot G: zeros in the rows past the last group -----------------------------------------------
    zero_out = gl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty, mma_layout)
    for tile in range(pid + my_tiles * NUM_PROGRAMS, total_tiles.to(gl.int32), NUM_PROGRAMS):
        _, row0, rows, col0 = _tile_coords(tile, sched, n_tiles, BLOCK_M, BLOCK_N, GROUP_M)
        rows_g = (row0 + offs_m).to(gl.int64)
        cols_g = col0 + offs_n
        mask = (offs_m < rows)[:, None] & (cols_g < N)[None, :]
        out_offs = (rows_g * stride_om)[:, None] + _col_offsets(cols_g, stride_on)[None, :]
        gl.store(out_ptr + out_offs, zero_out, mask=mask)
