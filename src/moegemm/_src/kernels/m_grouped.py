"""m-grouped GEMM kernel: ``for g: out[rows(g)] = x[rows(g)] @ w[g] (+ bias[g])``; unowned rows are 0.

Shapes: x [M, K], w [G, K, N] (any strides; an nn.Linear weight [G, N, K] is passed as ``w.mT``),
group_sizes [G] int32/int64 on the device, optional bias [G, N], out [M, N]. The bias is added to
the fp32 accumulator before the one rounding to out's dtype (a GroupedLinear forward in one launch).

Expert parallelism (``HAS_GROUP_OFFSET``): group_sizes holds G_TOTAL groups and w the G local ones,
groups [offset, offset + G) with offset = ``*group_offset_ptr`` on the device; the local rows are read
and written where they are, and every other row is zero-filled by the same launch (no row copies).

Persistent kernel. The tile space is laid out group by group: group g owns
``cdiv(rows_g, BLOCK_M) * cdiv(N, BLOCK_N)`` consecutive tiles, and one extra slot (index G)
owns the unowned tail rows, which are zero-filled (with a group offset the unowned rows before and
after the local groups are zero tiles interleaved with the GEMM tiles). The real number of tiles is only known on
the device, so the grid is ``min(upper bound, programs)`` and each program strides over the
tile space until the device-side total. With ``TMA_STORE`` (a 2-byte out, PyTorch on sm90) every BLOCK_M
high tile, a group's partial last one included, leaves through shared memory and a bulk tensor copy that
runs under the next tile's main loop, clipped at its group's end (``_clipped_out_desc``); half-high tiles
keep the masked store. Schedule variants, all
from the same tile space: ``MIXED_M`` runs a group's last row tile half high where at most half its
rows are left; ``TAIL_SPLIT`` runs the last, partial round's tiles as two half-high halves on two
programs; ``FLAT`` (TMA loads, short K) runs one loop over every step of a program's tiles, and
``FLAT_WHOLE_TILES`` (TMA loads and store, mid K) runs it where every group's rows fill whole row tiles.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from moegemm._src.kernels.schedule import (
    locate_row_tile,
    m_grouped_tile_space,
    pick,
    sm90_shared_fits,
    store_zero_tiles,
    strided_share,
)


@triton.jit
def _m_epilogue(
    acc, bias_ptr, out_desc, out_ptr, g, row0, row_end, col0, N: tl.constexpr, bias_end, stride_om, stride_on,
    stride_bg, stride_bn, BM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
    TMA_STORE: tl.constexpr,
):  # fmt: skip
    """Adds bias[g] to a BM x BLOCK_N fp32 tile (g < bias_end: G, or 0 for a split-K partial other than the
    first) and stores its rows below row_end (``_m_tile`` says which
    rows it holds): with TMA_STORE in one bulk copy through ``_clipped_out_desc``'s view (out_desc), which runs
    under the next tile's main loop, else from registers with a mask."""
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BLOCK_N)
    if WIDE_OFFSETS:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    row_mask = offs_m < row_end - row0
    col_mask = offs_n < N - col0
    out_base = out_ptr + row0 * stride_om + col0.to(tl.int64) * stride_on
    if HAS_BIAS:
        # The unowned slots (g >= G) read no bias and its rows stay 0: its column bound folds to 0. A
        # scalar condition and-ed into a block mask is rejected by triton 3.9's interpreter
        # ("mask has unsupported dtype"), so the condition goes into the bound instead.
        bias_cols = tl.where(g < bias_end, N - col0, 0)
        bias_base = bias_ptr + g.to(tl.int64) * stride_bg + col0.to(tl.int64) * stride_bn
        bias = tl.load(bias_base + offs_n * stride_bn, mask=offs_n < bias_cols, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out_offs = offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if TMA_STORE:
        # The tile's L owned rows sit at r = BM - L.. of the view's block at t = row0 + L, and its rows past
        # the group's end at r >= BM, which the copy engine clips (see _clipped_out_desc). The reshape keeps
        # the wgmma layout, so the staging write needs no layout-conversion scratch
        # (docs/design.md, 'TMA stores').
        owned = tl.minimum(row_end - row0, BM)
        out_desc.store(
            [(row0 + owned).to(tl.int32), (BM - owned).to(tl.int32), col0.to(tl.int32)],
            tl.reshape(acc.to(out_desc.dtype), [1, BM, BLOCK_N]),
        )
    else:
        tl.store(
            out_base + out_offs,
            acc.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )


@triton.jit
def _swiglu_columns(col0, offs_n, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """The w columns of a SwiGLU tile and their mask: tile columns [0, BLOCK_N // 2) are gate columns
    c = col0 // 2 + i and [BLOCK_N // 2, BLOCK_N) the up columns N // 2 + c (w13's rows [0, n) and [n, 2n)), so one
    accumulator holds both halves of the same n columns (docs/design.md, 'Fused expert block')."""
    HALF: tl.constexpr = BLOCK_N // 2
    h_cols = (col0 // 2).to(tl.int64) + (offs_n % HALF)
    return h_cols + (offs_n // HALF) * (N // 2), h_cols < N // 2


@triton.jit
def _swiglu_epilogue(
    acc, act_ptr, out_ptr, row0, row_end, col0, N: tl.constexpr, stride_om, stride_on, BM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """fc1's SwiGLU epilogue: stores the tile's pre-activation z (gate and up halves, ``_swiglu_columns``) into
    act [M, N] (contiguous, N = 2n), rounded to act's dtype, and h = silu(gate) * up of the rounded values (what
    the backward recomputes from z) into out [M, n]."""
    HALF: tl.constexpr = BLOCK_N // 2
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BLOCK_N)
    rows = row0 + offs_m
    row_mask = offs_m < row_end - row0
    z_cols, col_mask = _swiglu_columns(col0, offs_n, N, BLOCK_N)
    z = acc.to(act_ptr.dtype.element_ty)
    tl.store(act_ptr + rows[:, None] * N + z_cols[None, :], z, mask=row_mask[:, None] & col_mask[None, :])
    gate, up = tl.split(tl.permute(tl.reshape(z.to(tl.float32), [BM, 2, HALF]), (0, 2, 1)))
    h = gate * tl.sigmoid(gate) * up
    h_cols = (col0 // 2).to(tl.int64) + tl.arange(0, HALF)
    tl.store(
        out_ptr + rows[:, None] * stride_om + h_cols[None, :] * stride_on,
        h.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & (h_cols < N // 2)[None, :],
    )


@triton.jit
def _swiglu_bwd_epilogue(
    acc, act_ptr, row_scale_ptr, act_out_ptr, ds_ptr, out_ptr, M, row0, row_end, col0, N: tl.constexpr,
    BM: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """fc2's dgrad epilogue with the SwiGLU backward: acc = dh = dy[token] @ w2[e] for the tile's n columns
    (unweighted). From the kept pre-activation z [M, 2n] (act) and the row's routing weight s it stores
    dz = s * dh * swiglu'(z) into out [M, 2n] (gate and up halves), the weighted activation s * h into act_out
    [M, n] (fc2's wgrad reads it) and the tile's share of the routing weight's gradient, sum_cols(dh * h), into
    ds [cdiv(n, BLOCK_N), M]: fc2's per-row outputs are never formed (docs/design.md, 'Fused expert block').
    The tile is worked in two column halves: the whole tile's z, activation and gradients at once spilled
    (1.8 KB at 128 x 128, 8 warps: sm_90a compile)."""
    HALF: tl.constexpr = BLOCK_N // 2
    rows = row0 + tl.arange(0, BM)
    row_mask = tl.arange(0, BM) < row_end - row0
    s = tl.load(row_scale_ptr + rows, mask=row_mask, other=0.0)
    left, right = tl.split(tl.permute(tl.reshape(acc, [BM, 2, HALF]), (0, 2, 1)))
    ds, _, _ = _swiglu_bwd_columns(
        left, act_ptr, act_out_ptr, out_ptr, rows, row_mask, s, col0, N, HALF, False
    )
    ds_right, _, _ = _swiglu_bwd_columns(
        right, act_ptr, act_out_ptr, out_ptr, rows, row_mask, s, col0 + HALF, N, HALF, False
    )
    ds += ds_right
    tl.store(ds_ptr + (col0 // BLOCK_N).to(tl.int64) * M + rows, ds, mask=row_mask)


@triton.jit
def _swiglu_bwd_columns(
    dh, act_ptr, act_out_ptr, out_ptr, rows, row_mask, s, col0, N: tl.constexpr, WIDTH: tl.constexpr,
    AMAX: tl.constexpr,
):  # fmt: skip
    """``_swiglu_bwd_epilogue`` on columns [col0, col0 + WIDTH) of n: stores dz's gate and up columns and s * h,
    returns the rows' sums of dh * h over these columns, and with AMAX the largest |s * h| and |dz| stored (an FP8
    tensorwise scale's amax: ``kernels/swiglu.py``; 0 without, so the GEMM epilogue's registers stay as they were)."""
    cols = col0.to(tl.int64) + tl.arange(0, WIDTH)
    mask = row_mask[:, None] & (cols < N)[None, :]
    z_row = rows[:, None] * (2 * N)
    gate = tl.load(act_ptr + z_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    up = tl.load(act_ptr + z_row + N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = (silu * up).to(act_out_ptr.dtype.element_ty)  # fc2's input as the forward rounded it
    hs = (h.to(tl.float32) * s[:, None]).to(h.dtype)
    tl.store(act_out_ptr + rows[:, None] * N + cols[None, :], hs, mask=mask)
    ds = tl.sum(tl.where(mask, dh * h.to(tl.float32), 0.0), 1)
    dh = dh * s[:, None]
    out_ty = out_ptr.dtype.element_ty
    dz_up = (dh * silu).to(out_ty)
    tl.store(out_ptr + z_row + N + cols[None, :], dz_up, mask=mask)
    dz_gate = (dh * up * sig * (1.0 + gate * (1.0 - sig))).to(out_ty)
    tl.store(out_ptr + z_row + cols[None, :], dz_gate, mask=mask)
    if AMAX:  # masked elements are 0 (z loads 0, so h, dz and s * h are 0 there)
        hs_amax = tl.max(tl.max(tl.abs(hs.to(tl.float32)), 1), 0)
        dz_amax = tl.maximum(
            tl.max(tl.max(tl.abs(dz_up.to(tl.float32)), 1), 0),
            tl.max(tl.max(tl.abs(dz_gate.to(tl.float32)), 1), 0),
        )
    else:
        hs_amax = 0.0
        dz_amax = 0.0
    return ds, hs_amax, dz_amax


@triton.jit
def _clipped_out_desc(out_ptr, M, N: tl.constexpr, stride_om, BM: tl.constexpr, BLOCK_N: tl.constexpr):
    """A 3-D view [M + BM, BM, N] of out whose element (t, r, n) is out[t + r - BM, n] (the two row axes
    overlap: both step by stride_om, from BM rows before out). A block [1, BM, BLOCK_N] at (t, r, col0) covers
    rows t + r - BM .. t - 1 of out, and the copy engine drops its rows at r >= BM: stored at t = row_end
    of a tile's rows, r = BM - rows, it writes exactly those rows, so one bulk copy stores a group's partial
    last tile without touching the next group's rows, which a 2-D descriptor over out cannot clip. Made on the
    device (Triton's global scratch), so the launch encodes no host descriptor
    (docs/design.md, 'TMA stores')."""
    return tl.make_tensor_descriptor(
        out_ptr - BM * stride_om, [M + BM, BM, N], [stride_om, stride_om, 1], [1, BM, BLOCK_N]
    )


@triton.jit
def _m_tile(
    x_ptr,
    w_ptr,
    x_desc,  # TMA_LOAD: a device descriptor over x [M, K], block [BM, BLOCK_K]; else unused
    w_desc,  # TMA_LOAD: a device descriptor over w's 2-D view; else unused
    bias_ptr,
    out_desc,  # TMA_STORE: _clipped_out_desc's view of out; else unused
    out_ptr,
    gather_ptr,  # GATHER: int32 [M], the x row each out row reads
    act_ptr,  # EPILOGUE: the fc1 pre-activation z [M, 2 * n] ("swiglu": written; "swiglu_bwd": read)
    row_scale_ptr,  # "swiglu_bwd": fp32 [M], each row's routing weight
    act_out_ptr,  # "swiglu_bwd": [M, N], the weighted activation s * swiglu(z) (fc2's wgrad operand)
    ds_ptr,  # "swiglu_bwd": fp32 [cdiv(N, BLOCK_N), M], per column tile: sum over its columns of dh * h
    M,
    g,
    row0,
    row_end,
    col0,
    k_begin,  # the reduction steps [k_begin, k_end) of BLOCK_K (a split-K partial's share; none for g >= G)
    k_end,
    bias_end,  # bias[g] is added where g < bias_end (_m_epilogue)
    N: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    stride_xm,
    stride_xk,
    stride_wg,
    stride_wk,
    stride_wn,
    stride_om,
    stride_on,
    stride_bg,
    stride_bn,
    BM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    LOAD_PAD: tl.constexpr,
    W_K_CONTIGUOUS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    TMA_STORE: tl.constexpr,
    TMA_LOAD: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    GATHER: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    """One BM x BLOCK_N output tile: rows [row0, min(row0 + BM, row_end)) of group g (g == G: the
    unowned rows, stored as zeros), columns [col0, col0 + BLOCK_N) (with EPILOGUE "swiglu", the tile's
    columns are BLOCK_N // 2 gate columns and the matching up columns: ``_swiglu_columns``)."""
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if WIDE_OFFSETS:  # a stride times a block size may not fit in int32
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        offs_k = offs_k.to(tl.int64)
    row_mask = offs_m < row_end - row0  # row0 is int64
    # The masks along an operand's contiguous axis stop at its padded extent (LOAD_PAD: the launcher staged
    # x and w into zero-padded, 16-byte aligned rows), which Triton can prove constant over whole 16-byte
    # vectors; the masks along rows stop at the true extent (docs/design.md, 'Unaligned rows').
    K_COLS: tl.constexpr = (K + LOAD_PAD - 1) // LOAD_PAD * LOAD_PAD
    N_COLS: tl.constexpr = (N + LOAD_PAD - 1) // LOAD_PAD * LOAD_PAD
    if W_K_CONTIGUOUS:
        col_mask = offs_n < N - col0
    else:
        col_mask = offs_n < N_COLS - col0
    # 64-bit scalar tile origins (here and in _m_epilogue); per-element offsets stay 32-bit (WIDE_OFFSETS
    # when they can't), which keeps the pointer tensors out of the register budget of the accumulator.
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    if GATHER:
        # The tile's x rows by index (the expert block's token rows: docs/design.md, 'Fused expert block'):
        # 64-bit row offsets per tile row, the k offsets as before.
        src = tl.load(gather_ptr + row0 + offs_m, mask=row_mask, other=0).to(tl.int64)
        x_base = x_ptr
        x_offs = src[:, None] * stride_xm + offs_k[None, :] * stride_xk
    else:
        x_base = x_ptr + row0 * stride_xm
        x_offs = offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_cols = offs_n  # w's columns the tile reads, from col0
    w_col0 = col0.to(tl.int64)
    if EPILOGUE == "swiglu":
        w_cols, col_mask = _swiglu_columns(col0, offs_n, N, BLOCK_N)
        w_col0 = tl.zeros((), dtype=tl.int64)
    w_base = w_ptr + g.to(tl.int64) * stride_wg + w_col0 * stride_wn
    if W_K_CONTIGUOUS:  # nn.Linear layout: load [BLOCK_N, BLOCK_K] rows as stored, transpose in smem
        w_offs = w_cols[:, None] * stride_wn + offs_k[None, :] * stride_wk
    else:
        w_offs = offs_k[:, None] * stride_wk + w_cols[None, :] * stride_wn
    # The bases stay loop-invariant and the step enters the offsets: a loop-carried scalar pointer
    # loses its alignment facts, which stops Triton from pipelining the loads with cp.async.
    for k in range(k_begin, k_end):
        k_mask = offs_k < K - k * BLOCK_K
        k_cols = offs_k < K_COLS - k * BLOCK_K
        # Gathered x rows take the pointer loads; w may still come through its descriptor (the SwiGLU backward).
        if TMA_LOAD and not GATHER:
            a = x_desc.load([row0.to(tl.int32), k * BLOCK_K])
        else:
            x_ptrs = x_base + (x_offs + k * BLOCK_K * stride_xk)
            if EVEN_K:
                a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            else:
                a = tl.load(x_ptrs, mask=row_mask[:, None] & k_cols[None, :], other=0.0)
        if TMA_LOAD:
            if W_K_CONTIGUOUS:
                b = tl.trans(w_desc.load([(g * N + col0).to(tl.int32), k * BLOCK_K]))
            else:
                b = w_desc.load([(g * K + k * BLOCK_K).to(tl.int32), col0.to(tl.int32)])
        else:
            w_ptrs = w_base + (w_offs + k * BLOCK_K * stride_wk)
            if W_K_CONTIGUOUS:
                if EVEN_K:
                    b = tl.trans(tl.load(w_ptrs, mask=col_mask[:, None], other=0.0))
                else:
                    b = tl.trans(tl.load(w_ptrs, mask=col_mask[:, None] & k_cols[None, :], other=0.0))
            elif EVEN_K:
                b = tl.load(w_ptrs, mask=col_mask[None, :], other=0.0)
            else:
                b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if EPILOGUE == "swiglu":
        _swiglu_epilogue(acc, act_ptr, out_ptr, row0, row_end, col0, N, stride_om, stride_on, BM, BLOCK_N)
    elif EPILOGUE == "swiglu_bwd":
        _swiglu_bwd_epilogue(
            acc, act_ptr, row_scale_ptr, act_out_ptr, ds_ptr, out_ptr, M, row0, row_end, col0, N, BM, BLOCK_N
        )
    else:
        _m_epilogue(
            acc, bias_ptr, out_desc, out_ptr, g, row0, row_end, col0, N, bias_end, stride_om, stride_on, stride_bg,
            stride_bn, BM, BLOCK_N, HAS_BIAS, WIDE_OFFSETS, TMA_STORE,
        )  # fmt: skip


@triton.jit
def _m_flat_loop(
    x_desc, w_desc, bias_ptr, out_desc, out_ptr, pid, offs, starts, ends, m_tiles, tile_ends, total_tiles, n_tiles,
    N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, stride_om, stride_on, stride_bg, stride_bn,
    NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M,
    W_K_CONTIGUOUS: tl.constexpr, HAS_BIAS: tl.constexpr, WIDE_OFFSETS: tl.constexpr, TMA_STORE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The program's tiles (pid, pid + NUM_PROGRAMS, ...) as one loop over all their reduction steps, with each
    tile's epilogue under an `if` at its last step, as the wgrad's flat loop (k_grouped): the software
    pipeliner then loads the next tile's first steps while this one finishes and stores, where the per-tile
    loop fills and drains its pipeline at every tile. Every tile is BLOCK_M high. A tile of the unowned rows
    (g == G) takes one step: its w rows lie past the descriptor's G experts, which the copy engine reads as
    zeros, so it stores zeros. With TMA_STORE every tile leaves through one bulk copy (``_m_epilogue``)."""
    k_steps = tl.cdiv(K, BLOCK_K)
    gemm_tiles = pick(tile_ends, offs, G - 1)  # tiles of groups 0..G-1; the unowned rows' follow
    my_tiles = strided_share(total_tiles, pid, NUM_PROGRAMS)
    my_gemm = strided_share(gemm_tiles, pid, NUM_PROGRAMS)
    total = (my_gemm * k_steps + my_tiles - my_gemm).to(tl.int32)
    tile = pid - NUM_PROGRAMS
    step = -1
    num_steps = 0
    g = 0
    col0 = tl.zeros((), dtype=tl.int64)
    row0 = tl.zeros((), dtype=tl.int64)
    row_end = tl.zeros((), dtype=tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, total):
        step = tl.where(step == num_steps - 1, 0, step + 1)
        if step == 0:
            tile += NUM_PROGRAMS
            g, m_tile, n_tile, row0, row_end, first_m = locate_row_tile(
                tile, offs, starts, ends, m_tiles, tile_ends, n_tiles, BLOCK_M, GROUP_M
            )
            col0 = n_tile * BLOCK_N
            num_steps = tl.where(g < G, k_steps, 1)
        a = x_desc.load([row0.to(tl.int32), step * BLOCK_K])
        if W_K_CONTIGUOUS:
            b = tl.trans(w_desc.load([(g * N + col0).to(tl.int32), step * BLOCK_K]))
        else:
            b = w_desc.load([(g * K + step * BLOCK_K).to(tl.int32), col0.to(tl.int32)])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if step == num_steps - 1:
            _m_epilogue(
                acc, bias_ptr, out_desc, out_ptr, g, row0, row_end, col0, N, G, stride_om, stride_on, stride_bg,
                stride_bn, BLOCK_M, BLOCK_N, HAS_BIAS, WIDE_OFFSETS, TMA_STORE,
            )  # fmt: skip
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def m_grouped_mm_kernel(
    # Pointers first, the output last among them; sizes and strides follow (the order both launchers pass:
    # arrays, then ints). N, K, G and the strides are constexprs for every caller: fixed
    # per layer, and compiled in they gave +3-6% on compute-bound shapes; a runtime stride's alignment is
    # known only when it is a multiple of 16 elements, so a row of 1000 or 1400 bf16 (16-byte aligned) was
    # loaded element by element, 3-10x slower (docs/design.md, 'Compiled-in sizes'). M, the token count,
    # stays a runtime int, so batch sizes share a compiled kernel.
    x_ptr,
    w_ptr,
    group_sizes_ptr,
    group_offset_ptr,  # int32 [1]: the first local group (read only with HAS_GROUP_OFFSET)
    bias_ptr,
    gather_ptr,  # GATHER: int32 [M], the x row each out row reads
    act_ptr,  # EPILOGUE: the fc1 pre-activation z (_swiglu_epilogue, _swiglu_bwd_epilogue)
    row_scale_ptr,  # "swiglu_bwd": fp32 [M]
    act_out_ptr,  # "swiglu_bwd": [M, N]
    ds_ptr,  # "swiglu_bwd": fp32 [cdiv(N, BLOCK_N), M]
    out_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    G_TOTAL: tl.constexpr,  # entries of group_sizes (G without a group offset)
    stride_xm: tl.constexpr,
    stride_xk: tl.constexpr,
    stride_wg: tl.constexpr,
    stride_wk: tl.constexpr,
    stride_wn: tl.constexpr,
    stride_om: tl.constexpr,
    stride_on: tl.constexpr,
    stride_bg: tl.constexpr,
    stride_bn: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_G_TOTAL: tl.constexpr,
    HAS_GROUP_OFFSET: tl.constexpr,
    EVEN_K: tl.constexpr,
    # Elements the launcher zero-padded x's and w's contiguous axes to (1: none; 16 bytes' worth where it
    # staged rows that were not 16-byte aligned: docs/design.md, 'Unaligned rows').
    LOAD_PAD: tl.constexpr,
    W_K_CONTIGUOUS: tl.constexpr,  # stride_wk == 1, e.g. an nn.Linear weight [G, N, K] passed as w.mT
    HAS_BIAS: tl.constexpr,  # add bias[g] to every owned row; bias_ptr is not read otherwise
    WIDE_OFFSETS: tl.constexpr,
    TMA_STORE: tl.constexpr,  # BLOCK_M high tiles leave in bulk async copies (_clipped_out_desc; 2-byte out)
    TMA_LOAD: tl.constexpr,  # load x and w through TMA descriptors the kernel makes once per program
    MIXED_M: tl.constexpr,  # a tile with at most BLOCK_M // 2 rows left in its group runs BLOCK_M // 2 high
    TAIL_SPLIT: tl.constexpr,  # the last, partial round's tiles run as two BLOCK_M // 2 high halves each
    FLAT: tl.constexpr,  # TMA_LOAD only: one loop over every step of the program's tiles (flat_fits)
    FLAT_WHOLE_TILES: tl.constexpr,  # the flat loop where every group's rows fill whole row tiles
    # >1: every tile's reduction in SPLIT_K slices, each one work item storing its fp32 partial into out, then
    # [SPLIT_K, M, N] (split_k.reduce_kernel sums them in order; docs/design.md, 'Split reduction')
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot is wrong on bf16 operands
    PRECISION: tl.constexpr,
    # The expert block's options (docs/design.md, 'Fused expert block'), per-tile loop only (MGroupedLaunch.make):
    GATHER: tl.constexpr = False,  # x's rows by index (gather_ptr): out row r = x[gather[r]] @ w[g]
    # "" (none); "swiglu": fc1, N = 2n columns of w (gate, up), out = h [M, n] and act = z [M, 2n];
    # "swiglu_bwd": fc2's dgrad, out = dz [M, 2n] from the kept z (act), with act_out and ds
    EPILOGUE: tl.constexpr = "",
    # False: rows past the last group are neither read nor written (no tail slot): the expert-parallel local
    # step's absent rows, which nothing reads (docs/design.md, 'Expert parallelism').
    FILL_TAIL: tl.constexpr = True,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    # Slot G (no offset) zero-fills the rows past the last group; with a group offset the unowned rows
    # are zero tiles interleaved with the GEMM tiles (m_grouped_tile_space says how).
    (
        offs, starts, ends, m_tiles, tile_ends, total_tiles, first_row, local_end, head_tiles, zero_tiles,
        zero_per_tile,
    ) = m_grouped_tile_space(
        group_sizes_ptr, group_offset_ptr, G, G_TOTAL, M, n_tiles, NUM_PROGRAMS, BLOCK_M, BLOCK_G,
        BLOCK_G_TOTAL, HAS_GROUP_OFFSET, FILL_TAIL,
    )  # fmt: skip
    HALF_M: tl.constexpr = BLOCK_M // 2
    zero_offs_m = tl.arange(0, BLOCK_M)  # the zero tiles' (HAS_GROUP_OFFSET)
    zero_offs_n = tl.arange(0, BLOCK_N)
    if WIDE_OFFSETS:
        zero_offs_m = zero_offs_m.to(tl.int64)
        zero_offs_n = zero_offs_n.to(tl.int64)
    if TMA_LOAD:
        # Descriptors over x [M, K] and w's 2-D view (the launcher checked that w's groups sit back to
        # back): [G * N, K] K-contiguous, [G * K, N] N-contiguous with K % BLOCK_K == 0, so no step reads
        # the next expert's rows into the reduction. The copy engine zero-fills past M, K and G * N;
        # rows past a group's end are the next group's, loaded but never stored (the masked store drops
        # them, the TMA store's view clips them). Made once per program, unlike the wgrad's per-group ones
        # (k_grouped).
        x_desc = x_ptr  # gathered rows (GATHER) take pointer loads
        x_desc_half = x_ptr
        if not GATHER:
            x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])
            x_desc_half = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [HALF_M, BLOCK_K])
        if W_K_CONTIGUOUS:
            w_desc = tl.make_tensor_descriptor(w_ptr, [G * N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, [G * K, N], [stride_wk, 1], [BLOCK_K, BLOCK_N])
    else:  # placeholders: _m_tile reads no descriptor without TMA_LOAD
        x_desc = x_ptr
        x_desc_half = x_ptr
        w_desc = w_ptr
    out_desc = out_ptr  # a placeholder without TMA_STORE
    if TMA_STORE:
        out_desc = _clipped_out_desc(out_ptr, M, N, stride_om, BLOCK_M, BLOCK_N)
    if FLAT or FLAT_WHOLE_TILES:  # both need TMA loads: the flat loop is not compiled in otherwise
        run_flat = True
        if FLAT_WHOLE_TILES:
            # Where every group's rows fill whole row tiles (balanced routing, or layouts padded per expert) no
            # tile is partial, so the per-tile loop's half-high tiles have nothing to save; the flat loop wins
            # there at K 2048-3072 and loses with partial tiles (docs/design.md, 'Flat loop'). Both loops are
            # compiled in; the group sizes on the device pick one.
            partial_tiles = tl.sum(((offs < G) & ((ends - starts) % BLOCK_M != 0)).to(tl.int32), 0)
            run_flat = partial_tiles == 0
        if run_flat:
            _m_flat_loop(
                x_desc, w_desc, bias_ptr, out_desc, out_ptr, pid, offs, starts, ends, m_tiles, tile_ends,
                total_tiles, n_tiles, N, K, G, stride_om, stride_on, stride_bg, stride_bn, NUM_PROGRAMS, BLOCK_M,
                BLOCK_N, BLOCK_K, GROUP_M, W_K_CONTIGUOUS, HAS_BIAS, WIDE_OFFSETS, TMA_STORE, UPCAST, PRECISION,
            )  # fmt: skip
            return
    # The work items: tiles, except that with TAIL_SPLIT the last, partial round's tiles (``tail`` of them,
    # after ``full`` tiles of whole rounds) run as two half-high items each where that leaves no program
    # with two (docs/design.md, 'Split last round'): a round that would keep ``tail`` SMs busy for a whole
    # tile time keeps twice as many busy for about half of it.
    full = total_tiles
    n_work = total_tiles
    if TAIL_SPLIT:
        tail = total_tiles % NUM_PROGRAMS
        if 2 * tail <= NUM_PROGRAMS:
            full = total_tiles - tail
            n_work = total_tiles + tail
    K_STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    SPLIT_STEPS: tl.constexpr = (K_STEPS + SPLIT_K - 1) // SPLIT_K  # a split-K partial's reduction steps
    for item in range(pid, n_work * SPLIT_K, NUM_PROGRAMS):
        work = item
        k_begin = 0
        k_end = K_STEPS
        bias_end = G
        part_ptr = out_ptr
        if SPLIT_K > 1:
            # The slices of one tile are consecutive items, so programs running together read the same x rows.
            work = item // SPLIT_K
            split = item % SPLIT_K
            # int32: a TMA load's coordinates must be (the item index is 64-bit where the tile count is)
            k_begin = (split * SPLIT_STEPS).to(tl.int32)
            k_end = tl.minimum(k_begin + SPLIT_STEPS, K_STEPS)
            bias_end = tl.where(split == 0, G, 0)
            part_ptr = out_ptr + split.to(tl.int64) * M * stride_om
        tile = work
        lower = False  # the second half of a split tile: rows [row0 + HALF_M, row0 + BLOCK_M)
        if TAIL_SPLIT:
            tile = tl.where(work < full, work, full + (work - full) // 2)
            lower = (work >= full) & ((work - full) % 2 == 1)
        g, m_tile, n_tile, row0, row_end, _ = locate_row_tile(
            tile, offs, starts, ends, m_tiles, tile_ends, n_tiles, BLOCK_M, GROUP_M
        )
        col0 = n_tile * BLOCK_N
        k_end = tl.where(g < G, k_end, k_begin)  # the unowned slots run no steps: their rows are stored as 0
        if lower:
            row0 += HALF_M
        # A half-high tile: half of a split tail tile, or (MIXED_M, docs/design.md, 'Mixed tile heights') a
        # group's last row tile with at most half its rows left, where the full tile's MMA work would mostly
        # be on rows it never stores. One call site for both: with two, the sm_90a compile of the mixed-height
        # forward took 245 760 bytes of shared memory instead of 147 456 (more than an SM has). It takes the
        # masked store (the TMA store's block is BLOCK_M high); an empty lower half (its group had at most
        # HALF_M rows left) does nothing.
        if TAIL_SPLIT and MIXED_M:
            half = (work >= full) | (row_end - row0 <= HALF_M)
        elif TAIL_SPLIT:
            half = work >= full
        elif MIXED_M:
            half = row_end - row0 <= HALF_M
        else:
            half = False
        if half:
            if row0 < row_end:
                _m_tile(
                    x_ptr, w_ptr, x_desc_half, w_desc, bias_ptr, out_desc, part_ptr, gather_ptr, act_ptr,
                    row_scale_ptr, act_out_ptr, ds_ptr, M, g, row0, row_end, col0,
                    k_begin, k_end, bias_end, N, K, G, stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, stride_om, stride_on,
                    stride_bg, stride_bn, HALF_M, BLOCK_N, BLOCK_K, EVEN_K, LOAD_PAD, W_K_CONTIGUOUS, HAS_BIAS,
                    WIDE_OFFSETS, False, TMA_LOAD, UPCAST, PRECISION, GATHER, EPILOGUE,
                )  # fmt: skip
        else:
            _m_tile(
                x_ptr, w_ptr, x_desc, w_desc, bias_ptr, out_desc, part_ptr, gather_ptr, act_ptr, row_scale_ptr,
                act_out_ptr, ds_ptr, M, g, row0, row_end, col0, k_begin, k_end,
                bias_end, N, K, G, stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, stride_om, stride_on, stride_bg,
                stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, LOAD_PAD, W_K_CONTIGUOUS, HAS_BIAS, WIDE_OFFSETS,
                TMA_STORE, TMA_LOAD, UPCAST, PRECISION, GATHER, EPILOGUE,
            )  # fmt: skip
        if HAS_GROUP_OFFSET and not lower:  # a split tile's zero tiles go with its first half
            zero_begin = tile * zero_per_tile
            store_zero_tiles(
                out_ptr, zero_begin, tl.minimum(zero_begin + zero_per_tile, zero_tiles), first_row, local_end,
                head_tiles, M, N, n_tiles, stride_om, stride_on, zero_offs_m, zero_offs_n, BLOCK_M, BLOCK_N,
            )  # fmt: skip
    if HAS_GROUP_OFFSET:  # zero tiles no GEMM tile took (all of them when no local group has rows)
        for z in range(total_tiles * zero_per_tile + pid, zero_tiles, NUM_PROGRAMS):
            store_zero_tiles(
                out_ptr, z, z + 1, first_row, local_end, head_tiles, M, N, n_tiles, stride_om, stride_on,
                zero_offs_m, zero_offs_n, BLOCK_M, BLOCK_N,
            )  # fmt: skip


def ring_bytes(config, in_itemsize: int) -> int:
    """Shared memory of the config's operand ring: NUM_STAGES x and w tiles."""
    return config.num_stages * config.block_k * (config.block_m + config.block_n) * in_itemsize


def tma_store_fits(config, in_itemsize: int) -> bool:
    """Whether the TMA store's 2-byte staging tile (BLOCK_M x BLOCK_N) fits next to the operand ring at
    the config's CTAs per SM (the estimate k_grouped.tma_store_fits explains)."""
    return sm90_shared_fits(
        ring_bytes(config, in_itemsize) + config.block_m * config.block_n * 2, config.ctas_per_sm
    )


def tma_load_fits(K: int, block_k: int, w_k_contiguous: bool) -> bool:
    """Whether a TMA load of w's 2-D view stays inside one expert's reduction: always K-contiguous (the
    rows are N, masked at the store), N-contiguous only without a K tail (the rows are K)."""
    return w_k_contiguous or K % block_k == 0


# The longest reduction (K) on which the GPU runs half-high tail tiles. Measured on the H100
# (docs/design.md, 'Mixed tile heights'; paired clock, two runs): over every tile full height, +0.5-2.8% on the suite's
# launches with K <= 2880 and -1.1% to -4.8% on those with K >= 4096, the rule the suite gave; on the held-out
# set every launch under it gained or held (-0.2% to +2.8%) and the four at K = 4096 went -3.4% to +1.4%.
MIXED_M_MAX_K = 4095


def half_tiles_fit(block_m: int, K: int, N: int, interpret: bool) -> bool:
    """Whether a launch may run BLOCK_M // 2 high tiles at all (MIXED_M, TAIL_SPLIT): on the GPU a 128-row
    tile (its half, 64 rows, is the wgmma height of a warpgroup) with K and N multiples of 8 (the caller
    also checks that x's, w's and out's rows are 16-byte aligned); the interpreter any tile (its configs
    are 32 high), so that CI runs both paths.

    Why the alignment: with rows Triton cannot vectorize (K = 31, N = 17, bias, K-contiguous w) the H100
    computed wrong half-high tiles (docs/design.md, 'Mixed tile heights'; the interpreter was right, and so
    was every aligned shape the GPU tests run). Such rows also keep loads out of the software pipeline, so
    the half-high tile would gain nothing there. Rows of 16 bytes vectorize since the strides are compiled in
    (docs/design.md, 'Compiled-in sizes')."""
    if interpret:
        return block_m >= 32
    return block_m >= 128 and K % 8 == 0 and N % 8 == 0


# The longest reduction (K) on which launches with TMA loads take the flat loop (FLAT). Measured on the H100
# (docs/design.md, 'Flat loop'; paired, Dirichlet and balanced sizes, flat over the nested loop with its TMA
# store, mixed heights and split tail): on the suite's two launches with K <= 1536 +2.9/-0.5% and +2.4/+0.4%;
# from K = 2048 up -1.9% to +1.8% and -6.0% on gpt-oss-120b fwd (K 2880). Held out (validation only), K =
# 512-1408: +1.5/+6.9%, +4.0/+7.7%, +3.8/-2.7%.
FLAT_MAX_K = 1536


def flat_shared_bytes(config, in_itemsize: int) -> int:
    """Shared memory of the flat loop with the register store: its operand ring stays live through the
    epilogue, beside the masked store's layout-conversion scratch. The scratch as sm_90a compiles showed it on
    triton 3.6 and 3.9 (32 KB at 8 warps, BLOCK_N * 64 bytes at 4); tests/test_sm90_compile.py compiles every
    candidate this admits. The TMA store's staging tile is no smaller than that scratch, and the flat loop with
    it has no masked store, so ``tma_store_fits`` decides that store alone."""
    scratch = 32768 if config.num_warps == 8 else config.block_n * 64
    return ring_bytes(config, in_itemsize) + scratch


def flat_fits(config, K: int, in_itemsize: int, tma_load: bool, has_group_offset: bool) -> bool:
    """Whether a launch runs the flat loop: TMA loads (the nested loop's cp.async path has no flat twin), no
    group offset (its zero tiles live in the per-tile loop), K <= FLAT_MAX_K, where a tile's pipeline fill is
    the largest share of its time, and the config's CTAs per SM fit with the ring live (``flat_shared_bytes``)."""
    return (
        tma_load
        and not has_group_offset
        and K <= FLAT_MAX_K
        and sm90_shared_fits(flat_shared_bytes(config, in_itemsize), config.ctas_per_sm)
    )


# The longest reduction on which a launch takes the flat loop where every group's rows fill whole BLOCK_M tiles
# (FLAT_WHOLE_TILES; the kernel decides from group_sizes). Measured on the H100 (docs/design.md, 'Flat loop';
# paired, the flat loop with the TMA store over the per-tile loop at K 2048-3072): with balanced sizes (every
# group a multiple of 128 rows) +1.0% to +2.7% on 8 of 9 launches (qwen3next dgrad -0.6%); with Dirichlet
# sizes -2.0% to +0.7%, where the per-tile loop's half-high tiles pay. With this rule, over the launcher
# without it: +1.0% geomean on its 10 launches with balanced sizes, 1.000x with Dirichlet sizes.
FLAT_WHOLE_TILES_MAX_K = 3072


def flat_whole_tiles_fits(K: int, tma_load: bool, tma_store: bool, has_group_offset: bool) -> bool:
    """Whether a launch beyond FLAT_MAX_K carries the flat loop for group sizes that fill whole row tiles: TMA
    loads and the TMA store (the flat loop was measured with both; ``tma_store_fits`` already gave the staging
    tile room beside the ring, all that the flat loop keeps live), no group offset, FLAT_MAX_K < K <=
    FLAT_WHOLE_TILES_MAX_K."""
    return tma_load and tma_store and not has_group_offset and FLAT_MAX_K < K <= FLAT_WHOLE_TILES_MAX_K


def mixed_m_fits(block_m: int, K: int, N: int, interpret: bool) -> bool:
    """Whether a launch runs a group's last row tile half high where at most half its rows are left
    (MIXED_M): where half-high tiles fit (``half_tiles_fit``) and, on the GPU, K <= MIXED_M_MAX_K."""
    return half_tiles_fit(block_m, K, N, interpret) and (interpret or K <= MIXED_M_MAX_K)


@dataclasses.dataclass(frozen=True)
class MGroupedLaunch:
    """Grid and meta-parameters of one m_grouped_mm_kernel launch, derived from static shapes only."""

    grid: tuple[int]
    meta: dict

    @staticmethod
    def make(
        M: int,
        N: int,
        K: int,
        G: int,
        *,
        config,
        num_programs_cap: int,
        fp32_inputs: bool,
        interpret: bool,
        max_stride: int | None = None,
        w_k_contiguous: bool = False,
        has_bias: bool = False,
        g_total: int | None = None,
        tma_store: bool = False,
        tma_load: bool = False,
        mixed_m: bool = False,
        tail_split: bool = False,
        flat: bool = False,
        load_pad: int = 1,
        split_k: int = 1,
        gather: bool = False,
        epilogue: str = "",
        fill_tail: bool = True,
    ) -> MGroupedLaunch:
        """max_stride: the largest row/column stride of x, w[g] and out (default: contiguous, max(K, N)).
        Element offsets inside one tile or one expert's K range are int32 unless they could overflow.
        w_k_contiguous: w's K stride is 1 (the [G, N, K] storage of an nn.Linear weight seen as [G, K, N]).
        has_bias: the launch passes a [G, N] bias (its strides count in max_stride).
        g_total: expert parallelism: group_sizes has g_total entries, w the G local groups from a
        device-side group offset (None: no offset, g_total = G).
        tma_store: out is 2-byte with a unit column stride and a 16-byte aligned base and row stride (the
        kernel makes a descriptor over it); used where the config's shared memory leaves room for the staging
        tile beside the ring (``tma_store_fits``; in the flat loop the ring stays live through the epilogue, as
        the estimate assumes anyway).
        tma_load: the launch can read x and w through descriptors the kernel makes (the launcher checked
        K > 0, unit inner strides, 16-byte row strides and bases, w's groups back to back, int32 coordinates);
        used for 2-byte inputs where an N-contiguous w has K % BLOCK_K == 0 (``tma_load_fits``).
        mixed_m: a group's last row tile may run BLOCK_M // 2 high where at most that many rows are left (the
        caller checked that x's, w's and out's rows are 16-byte aligned); used where that measured faster
        (``mixed_m_fits``).
        tail_split: the last, partial round of tiles may run as half-high halves on twice as many programs
        (same caller check as mixed_m; used where half-high tiles fit, ``half_tiles_fit``).
        flat: one loop over every step of the program's tiles (``plan.Constraints.flat``); used where ``flat_fits``, and
        then with neither mixed heights nor a split tail; where ``flat_whole_tiles_fits``, only if every group's
        rows fill whole row tiles (the kernel checks group_sizes), the per-tile loop otherwise.
        load_pad: x's and w's contiguous axes are zero-padded to a multiple of this many elements, with
        16-byte aligned rows (the launcher staged them; ``plan.stage_rows``); 1: as given.
        split_k: >1, the reduction in that many slices whose fp32 partials the kernel stores into out [split_k,
        M, N] (a workspace; ``split_k.reduce_kernel`` sums them): no TMA store, half-high tiles, flat loop or
        group offset then.
        gather: x's rows are read through an int32 index per out row (the expert block's token rows): x takes
        pointer loads (w may still take TMA loads), and no flat loop.
        epilogue: "" (none), "swiglu" (N = 2n columns of w: gate then up; out [M, n] = h, the kernel's act = z
        [M, 2n]) or "swiglu_bwd" (out [M, 2n] = dz; docs/design.md, 'Fused expert block'): masked stores of
        their own, so no TMA store, split-K or group offset.
        fill_tail: False leaves the rows past the last group untouched (no zero-fill; the per-tile loop only, no
        split-K or group offset).
        """
        if epilogue not in ("", "swiglu", "swiglu_bwd"):
            raise ValueError(f"unknown epilogue {epilogue!r}")
        if epilogue and (split_k > 1 or g_total is not None):
            raise ValueError(
                f"epilogue {epilogue!r} takes no split_k ({split_k}) or group offset ({g_total})"
            )
        if epilogue == "swiglu" and (N % 2 or config.block_n % 2):
            raise ValueError(f"the SwiGLU epilogue needs an even N and BLOCK_N, got N={N}, {config.block_n}")
        if not fill_tail and (split_k > 1 or g_total is not None):
            raise ValueError(f"fill_tail=False takes no split_k ({split_k}) or group offset ({g_total})")
        if gather or not fill_tail:
            flat = False  # the flat loop reads x through its descriptor and always fills the tail
        if epilogue == "swiglu":
            tma_load = (
                False  # a tile's w rows are two runs (gate, up: _swiglu_columns), not one descriptor block
            )
        if epilogue:
            tma_store = False
        if split_k > 1 and g_total is not None:
            raise ValueError(f"split_k={split_k} takes no group offset (g_total={g_total})")
        if split_k > 1:
            tma_store = mixed_m = tail_split = flat = False
        bm, bn = config.block_m, config.block_n
        in_itemsize = 4 if fp32_inputs else 2
        tma_load = tma_load and not fp32_inputs and tma_load_fits(K, config.block_k, w_k_contiguous)
        tma_store = tma_store and M + bm < 2**31 and tma_store_fits(config, in_itemsize)
        flat_whole_tiles = flat and flat_whole_tiles_fits(K, tma_load, tma_store, g_total is not None)
        flat = flat and flat_fits(config, K, in_itemsize, tma_load, g_total is not None)
        max_stride = max(K, N) if max_stride is None else max_stride
        # Each group adds at most one partial row tile, the unowned rows (tail; head with an offset) more.
        slots = G + 1 if g_total is None else G + 2
        max_tiles = (triton.cdiv(M, bm) + slots) * triton.cdiv(N, bn)
        # num_programs_cap is one wave at one program per SM; a config may ask for several per SM.
        num_programs = max(1, min(max_tiles * split_k, num_programs_cap * config.ctas_per_sm))
        meta = dict(
            NUM_PROGRAMS=num_programs,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
            BLOCK_G=max(16, triton.next_power_of_2(slots)),
            BLOCK_G_TOTAL=max(16, triton.next_power_of_2(G if g_total is None else g_total)),
            HAS_GROUP_OFFSET=g_total is not None,
            EVEN_K=K % config.block_k == 0,
            LOAD_PAD=load_pad,
            W_K_CONTIGUOUS=w_k_contiguous,
            HAS_BIAS=has_bias,
            WIDE_OFFSETS=2 * max(bm, bn, K + config.block_k) * max_stride >= 2**31,
            TMA_STORE=tma_store,  # where the staging tile fits; the view's row extent, M + BLOCK_M, is an int32
            TMA_LOAD=tma_load,
            MIXED_M=mixed_m and mixed_m_fits(bm, K, N, interpret) and not flat,
            TAIL_SPLIT=tail_split and half_tiles_fit(bm, K, N, interpret) and not flat,
            FLAT=flat,
            FLAT_WHOLE_TILES=flat_whole_tiles,
            SPLIT_K=split_k,
            UPCAST=interpret,
            PRECISION="ieee" if fp32_inputs or interpret else "tf32",
            GATHER=gather,
            EPILOGUE=epilogue,
            FILL_TAIL=fill_tail,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        return MGroupedLaunch(grid=(num_programs,), meta=meta)
