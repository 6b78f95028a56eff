"""k-grouped GEMM kernel (weight gradient): ``for g: out[g] (+)= a[rows(g)]^T @ b[rows(g)]``.

Shapes: a [M, K], b [M, N] (any strides), group_sizes [G] on the device, out [G, K, N] fp32 or
bf16/fp16. A group with no rows writes exact zeros, or, when accumulating, leaves out[g] untouched
(neither read nor written).
Optionally also ``a_colsum[g] = sum(a[rows(g)], 0)`` [G, K]: with a = dy that is the bias gradient,
from G x cdiv(K, BLOCK_K) extra memory-bound tiles of the same persistent launch (no second launch).

Expert parallelism (``HAS_GROUP_OFFSET``): group_sizes holds G_TOTAL groups and out the G local ones,
groups [offset, offset + G) with offset = ``*group_offset_ptr`` on the device, whose rows are read
where they are (no row copies).

Persistent kernel over the static tile space G x cdiv(K, BLOCK_K) x cdiv(N, BLOCK_N), group-major
so that the programs running together share one group's rows of a and b in L2. The reduction runs
over that group's rows in steps of BLOCK_R. With ``TMA_STORE`` (a 2-byte out, PyTorch on sm90) a finished
tile leaves through shared memory and a bulk tensor copy that runs under the next tile's reduction, through a
descriptor over out the kernel makes (``_out_desc``).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from moegemm._src.kernels.schedule import (
    group_row_bounds,
    local_group_row_bounds,
    pick,
    sm90_shared_fits,
    strided_share,
    swizzle_tile,
)


@triton.jit
def _k_step(
    a_ptrs,
    b_ptrs,
    r_mask,
    k_mask,
    col_mask,
    acc,
    A_K_CONTIGUOUS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc += a_step^T @ b_step for one BLOCK_R step of rows (rows past the group's end masked)."""
    if A_K_CONTIGUOUS:  # row-major a: loaded [BLOCK_R, BLOCK_K] as stored, transposed in smem
        a = tl.trans(tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0))
    else:
        a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
    b = tl.load(b_ptrs, mask=r_mask[:, None] & col_mask[None, :], other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _gathered(base, gather_ptr, r, offs_r, r_mask, offs_c, stride_m, stride_c, C_CONTIGUOUS: tl.constexpr):
    """Pointers to one BLOCK_R step of an operand whose rows r.. are read through an int32 index (the expert
    block's token rows; docs/design.md, 'Fused expert block'): [BLOCK_R, C] where C_CONTIGUOUS (rows as stored),
    else [C, BLOCK_R]."""
    src = tl.load(gather_ptr + r + offs_r, mask=r_mask, other=0).to(tl.int64) * stride_m
    if C_CONTIGUOUS:
        ptrs = base + (src[:, None] + offs_c[None, :] * stride_c)
    else:  # one return: Triton 3.6 types every return of a function alike, constexpr branches included
        ptrs = base + (offs_c[:, None] * stride_c + src[None, :])
    return ptrs


@triton.jit
def _k_epilogue(
    c_ptr,
    out_ptr,
    out_desc,
    acc,
    g,
    k_tile,
    n_tile,
    has_rows,
    offs_k,
    offs_n,
    k_mask,
    col_mask,
    stride_og: tl.constexpr,
    stride_ok: tl.constexpr,
    stride_on: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """Stores one finished out[g] tile (adding c's tile when accumulating)."""
    if TMA_STORE:
        # The tile goes to shared memory and one bulk copy writes it: the warps go on to the next tile's
        # reduction while the copy engine stores (and clips at out[g]'s K and N edges). Never accumulating.
        out_desc.store(
            [g.to(tl.int32), (k_tile * BLOCK_K).to(tl.int32), (n_tile * BLOCK_N).to(tl.int32)],
            # reshape, not acc[None]: it keeps the wgmma layout (stmatrix into the staging tile), where
            # [None] converted through 32 KB of shared scratch first (8 warps; seen in the sm_90a TTGIR).
            tl.reshape(acc.to(out_desc.dtype), [1, BLOCK_K, BLOCK_N]),
        )
    else:
        out_offs = (
            g.to(tl.int64) * stride_og
            + (k_tile * BLOCK_K).to(tl.int64) * stride_ok
            + (n_tile * BLOCK_N).to(tl.int64) * stride_on
            + (offs_k[:, None] * stride_ok + offs_n[None, :] * stride_on)
        )
        out_mask = k_mask[:, None] & col_mask[None, :]
        if ACCUMULATE:
            # An empty group leaves out[g] as it was: no read and no write (storing 0 + old would turn
            # -0.0 into +0.0). c shares out's strides; it is out itself in PyTorch, and in JAX the input
            # aliased to out (input_output_aliases), so skipped elements keep c's values either way.
            if has_rows:
                acc += tl.load(c_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
                tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _out_desc(out_ptr, G, K, N, stride_og, stride_ok, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A TMA descriptor over out [G, K, N] (N contiguous), block [1, BLOCK_K, BLOCK_N]: the copy engine clips
    each tile at out[g]'s K and N edges. Made once per program on the device (Triton's global scratch), so the
    launch encodes no host descriptor: 18.9 us of host time a call against 22.6 with one
    (docs/design.md, 'TMA stores')."""
    return tl.make_tensor_descriptor(out_ptr, [G, K, N], [stride_og, stride_ok, 1], [1, BLOCK_K, BLOCK_N])


@triton.jit
def k_grouped_mm_kernel(
    # Pointer order as in m_grouped_mm_kernel. The strides, N and K are constexprs for every caller: fixed
    # per layer, and compiled in the strides took compute-bound wgrad from 488 to 572 TF/s (dsv3 fc1) and
    # 519 to 650 (mixtral) on the H100; a runtime N or K off a multiple of 16 leaves the K and N masks
    # without a known constancy, so the loads they guard went element by element (docs/design.md,
    # 'Compiled-in sizes'). M and G stay runtime ints (both front ends).
    a_ptr,
    b_ptr,
    group_sizes_ptr,
    group_offset_ptr,  # int32 [1]: the first local group (read only with HAS_GROUP_OFFSET)
    c_ptr,
    a_colsum_ptr,
    gather_a_ptr,  # GATHER_A: int32 [M], the a row each reduction row reads
    gather_b_ptr,  # GATHER_B: the same for b
    out_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    G,
    G_TOTAL,  # entries of group_sizes (G without a group offset)
    stride_am: tl.constexpr,
    stride_ak: tl.constexpr,
    stride_bm: tl.constexpr,
    stride_bn: tl.constexpr,
    stride_og: tl.constexpr,
    stride_ok: tl.constexpr,
    stride_on: tl.constexpr,
    stride_sg: tl.constexpr,
    stride_sk: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_G_TOTAL: tl.constexpr,
    HAS_GROUP_OFFSET: tl.constexpr,
    A_K_CONTIGUOUS: tl.constexpr,  # stride_ak == 1: a is row-major
    # Elements the launcher zero-padded a's K and b's N to (1: none; 16 bytes' worth where it staged rows
    # that were not 16-byte aligned: docs/design.md, 'Unaligned rows').
    LOAD_PAD: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # out = c + a^T b instead of a^T b
    A_COLSUM: tl.constexpr,  # also write a_colsum[g] = sum(a[rows(g)], 0) (fresh, never accumulated)
    FLAT: tl.constexpr,  # one flat loop over all steps of all tiles (next tile's loads overlap the store)
    TMA_STORE: tl.constexpr,  # store finished tiles through _out_desc (bulk async copies), 2-byte out only
    TMA_LOAD: tl.constexpr,  # FLAT only: load a and b through TMA descriptors made on the device per group
    # >1 (nested loop, no accumulation, column sums or TMA store): each tile's rows in SPLIT_R slices, each one
    # work item storing its fp32 partial into out, then [SPLIT_R, G, K, N] (split_k.reduce_kernel sums them)
    SPLIT_R: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot is wrong on bf16 operands
    PRECISION: tl.constexpr,
    # a's or b's rows by index (the expert block's token rows; no TMA loads: KGroupedLaunch.make)
    GATHER_A: tl.constexpr = False,
    GATHER_B: tl.constexpr = False,
):
    pid = tl.program_id(0)
    out_desc = out_ptr  # a placeholder without TMA_STORE
    if TMA_STORE:
        out_desc = _out_desc(out_ptr, G, K, N, stride_og, stride_ok, BLOCK_K, BLOCK_N)
    if HAS_GROUP_OFFSET:
        offs, starts, ends = local_group_row_bounds(
            group_sizes_ptr, group_offset_ptr, G, G_TOTAL, M, BLOCK_G, BLOCK_G_TOTAL
        )
    else:
        offs, starts, ends = group_row_bounds(group_sizes_ptr, G, M, BLOCK_G)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_group = k_tiles * n_tiles
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    if WIDE_OFFSETS:  # a stride times a block size may not fit in int32
        offs_k = offs_k.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        offs_r = offs_r.to(tl.int64)
    # The operand loads' masks along a's K and b's N stop at the padded extents (LOAD_PAD: the launcher staged
    # a and b into zero-padded, 16-byte aligned rows), which Triton can prove constant over whole vectors;
    # the stores' stop at K and N (docs/design.md, 'Unaligned rows'). a read K-major (A_K_CONTIGUOUS off) is
    # never staged: its K masks run along rows.
    K_COLS: tl.constexpr = (K + LOAD_PAD - 1) // LOAD_PAD * LOAD_PAD if A_K_CONTIGUOUS else K
    N_COLS: tl.constexpr = (N + LOAD_PAD - 1) // LOAD_PAD * LOAD_PAD
    if A_K_CONTIGUOUS:  # row-major a: load [BLOCK_R, BLOCK_K] as stored, transpose in smem
        a_offs = offs_r[:, None] * stride_am + offs_k[None, :] * stride_ak
    else:
        a_offs = offs_k[:, None] * stride_ak + offs_r[None, :] * stride_am
    b_offs = offs_r[:, None] * stride_bm + offs_n[None, :] * stride_bn
    # N = 0 (column sums only) has no GEMM tile: its compiled-in tile count is 0, which the flat loop divides by
    # (a launch on the H100 read out of bounds); the nested loop runs no iteration.
    if FLAT and N > 0:
        # One flat loop over every reduction step of every tile this program owns, with the tile's
        # epilogue under an `if` at its last step: the software pipeliner then prefetches the next
        # tile's first rows while this tile is stored, instead of filling and draining the pipeline per
        # tile (Triton's own nest flattening, tl.range(flatten=True), needs inner-loop bounds that do
        # not depend on the tile, and ours are the group's rows). A tile of group g takes
        # max(1, cdiv(rows_g, BLOCK_R)) steps: an empty group's tile still stores its zeros, from one
        # all-masked step. Programs own tiles pid, pid + NUM_PROGRAMS, ...; `mine` counts them per group.
        # (Runs of consecutive tiles per program, which make a TMA-load program's descriptors less
        # often, ran slower on the H100: up to 0.62x on 128-expert wgrad.)
        first_tile = offs * tiles_per_group
        mine = strided_share(first_tile + tiles_per_group, pid, NUM_PROGRAMS)
        mine -= strided_share(first_tile, pid, NUM_PROGRAMS)
        steps_of = tl.maximum(tl.cdiv(ends - starts, BLOCK_R), 1)
        # int32 (KGroupedLaunch.make bounds a program's steps below 2**31): a 64-bit count costs a step 3-5
        # instructions of compares (sm_90a SASS; docs/design.md, 'Persistent schedule').
        total = tl.sum(tl.where(offs < G, mine * steps_of, 0), 0).to(tl.int32)
        tile = pid - NUM_PROGRAMS
        step = -1
        num_steps = 0
        g = 0
        k_tile = 0
        n_tile = 0
        row_start = tl.zeros((), dtype=tl.int64)
        row_end = tl.zeros((), dtype=tl.int64)
        rows_left = 0
        a_base = a_ptr
        b_base = b_ptr
        k_mask = offs_k < 0
        col_mask = offs_n < 0
        k_cols = k_mask
        n_cols = col_mask
        if TMA_LOAD:
            # Descriptors over a [rows, K] and b [rows, N] that end at the group's last row: the copy engine
            # zero-fills the rows past it, so the last step needs no mask (the reduction must not see the
            # next group's rows). Made on the device when a program's tile changes group (Triton keeps a
            # ring of them in global scratch for the pipelined loads).
            desc_g = -1
            row0 = 0
            a_desc = tl.make_tensor_descriptor(a_ptr, [1, K], [stride_am, 1], [BLOCK_R, BLOCK_K])
            b_desc = tl.make_tensor_descriptor(b_ptr, [1, N], [stride_bm, 1], [BLOCK_R, BLOCK_N])
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for _ in range(0, total):
            step = tl.where(step == num_steps - 1, 0, step + 1)
            if step == 0:
                tile += NUM_PROGRAMS
                g = tile // tiles_per_group
                k_tile, n_tile = swizzle_tile(tile % tiles_per_group, k_tiles, n_tiles, GROUP_M)
                row_start = pick(starts, offs, g)
                row_end = pick(ends, offs, g)
                num_steps = tl.maximum(tl.cdiv(row_end - row_start, BLOCK_R), 1).to(tl.int32)
                # The row counts in int32 (M < 2**31, KGroupedLaunch.make): their 64-bit
                # compares cost 16 of the 212 instructions a step takes
                # (sm_90a SASS; docs/design.md, 'Persistent schedule').
                rows_left = (row_end - row_start).to(tl.int32)
                k_mask = offs_k < K - k_tile * BLOCK_K
                col_mask = offs_n < N - n_tile * BLOCK_N
                k_cols = offs_k < K_COLS - k_tile * BLOCK_K
                n_cols = offs_n < N_COLS - n_tile * BLOCK_N
                if TMA_LOAD:
                    if g != desc_g:
                        desc_g = g
                        # A descriptor needs a nonzero extent: an empty group's one step starts at row
                        # `rows`, past the extent, so it reads only zeros.
                        rows = tl.maximum(row_end, 1).to(tl.int32)
                        row0 = tl.where(row_end > row_start, row_start, rows).to(tl.int32)
                        a_desc = tl.make_tensor_descriptor(
                            a_ptr, [rows, K], [stride_am, 1], [BLOCK_R, BLOCK_K]
                        )
                        b_desc = tl.make_tensor_descriptor(
                            b_ptr, [rows, N], [stride_bm, 1], [BLOCK_R, BLOCK_N]
                        )
                else:
                    a_base = a_ptr + (k_tile * BLOCK_K).to(tl.int64) * stride_ak
                    b_base = b_ptr + (n_tile * BLOCK_N).to(tl.int64) * stride_bn
                    if not GATHER_A:
                        a_base += row_start * stride_am
                    if not GATHER_B:
                        b_base += row_start * stride_bm
            if TMA_LOAD:
                r = row0 + step * BLOCK_R
                a = tl.trans(a_desc.load([r, k_tile * BLOCK_K]))
                b = b_desc.load([r, n_tile * BLOCK_N])
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            else:
                rows_done = step.to(tl.int64) * BLOCK_R
                r_mask = offs_r < rows_left - step * BLOCK_R
                a_ptrs = a_base + rows_done * stride_am + a_offs
                b_ptrs = b_base + rows_done * stride_bm + b_offs
                if GATHER_A:
                    a_ptrs = _gathered(
                        a_base, gather_a_ptr, row_start + rows_done, offs_r, r_mask, offs_k, stride_am, stride_ak,
                        A_K_CONTIGUOUS,
                    )  # fmt: skip
                if GATHER_B:
                    b_ptrs = _gathered(
                        b_base,
                        gather_b_ptr,
                        row_start + rows_done,
                        offs_r,
                        r_mask,
                        offs_n,
                        stride_bm,
                        stride_bn,
                        True,
                    )
                acc = _k_step(
                    a_ptrs,
                    b_ptrs,
                    r_mask,
                    k_cols,
                    n_cols,
                    acc,
                    A_K_CONTIGUOUS,
                    UPCAST,
                    PRECISION,
                )
            if step == num_steps - 1:
                _k_epilogue(
                    c_ptr,
                    out_ptr,
                    out_desc,
                    acc,
                    g,
                    k_tile,
                    n_tile,
                    row_end > row_start,
                    offs_k,
                    offs_n,
                    k_mask,
                    col_mask,
                    stride_og,
                    stride_ok,
                    stride_on,
                    BLOCK_K,
                    BLOCK_N,
                    ACCUMULATE,
                    TMA_STORE,
                )
                acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    else:
        for item in range(pid, G * tiles_per_group * SPLIT_R, NUM_PROGRAMS):
            tile = item
            part_ptr = out_ptr
            if SPLIT_R > 1:
                # The slices of one tile are consecutive items (docs/design.md, 'Split reduction').
                tile = item // SPLIT_R
                split = item % SPLIT_R
                part_ptr = out_ptr + split.to(tl.int64) * G * stride_og
            g = tile // tiles_per_group
            k_tile, n_tile = swizzle_tile(tile % tiles_per_group, k_tiles, n_tiles, GROUP_M)
            row_start = pick(starts, offs, g)
            row_end = pick(ends, offs, g)
            rows_lo = row_start
            rows_hi = row_end
            if SPLIT_R > 1:  # this slice's rows: whole BLOCK_R steps of the group's, in order
                chunk = tl.cdiv(tl.cdiv(row_end - row_start, SPLIT_R), BLOCK_R) * BLOCK_R
                rows_lo = tl.minimum(row_start + split * chunk, row_end)
                rows_hi = tl.minimum(rows_lo + chunk, row_end)
            k_mask = offs_k < K - k_tile * BLOCK_K
            col_mask = offs_n < N - n_tile * BLOCK_N
            k_cols = offs_k < K_COLS - k_tile * BLOCK_K
            n_cols = offs_n < N_COLS - n_tile * BLOCK_N
            # 64-bit scalar bases advanced from the loop variable (not loop-carried, so alignment facts
            # survive for cp.async pipelining); per-element offsets inside a tile stay 32-bit.
            a_base = a_ptr + row_start * stride_am + (k_tile * BLOCK_K).to(tl.int64) * stride_ak
            b_base = b_ptr + row_start * stride_bm + (n_tile * BLOCK_N).to(tl.int64) * stride_bn
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
            for r in range(rows_lo, rows_hi, BLOCK_R):
                step = r - row_start
                r_mask = offs_r < (rows_hi - r).to(tl.int32)  # int32 (M < 2**31, KGroupedLaunch.make)
                a_ptrs = a_base + step * stride_am + a_offs
                b_ptrs = b_base + step * stride_bm + b_offs
                if GATHER_A:
                    a_ptrs = _gathered(
                        a_ptr + (k_tile * BLOCK_K).to(tl.int64) * stride_ak, gather_a_ptr, r, offs_r, r_mask, offs_k,
                        stride_am, stride_ak, A_K_CONTIGUOUS,
                    )  # fmt: skip
                if GATHER_B:
                    b_ptrs = _gathered(
                        b_ptr + (n_tile * BLOCK_N).to(tl.int64) * stride_bn, gather_b_ptr, r, offs_r, r_mask, offs_n,
                        stride_bm, stride_bn, True,
                    )  # fmt: skip
                acc = _k_step(
                    a_ptrs,
                    b_ptrs,
                    r_mask,
                    k_cols,
                    n_cols,
                    acc,
                    A_K_CONTIGUOUS,
                    UPCAST,
                    PRECISION,
                )
            _k_epilogue(
                c_ptr,
                part_ptr,
                out_desc,
                acc,
                g,
                k_tile,
                n_tile,
                row_end > row_start,
                offs_k,
                offs_n,
                k_mask,
                col_mask,
                stride_og,
                stride_ok,
                stride_on,
                BLOCK_K,
                BLOCK_N,
                ACCUMULATE,
                TMA_STORE,
            )

    if A_COLSUM:
        # Column sums of a (the bias gradient when a = dy): G x k_tiles memory-bound tiles after the GEMM
        # tiles, kept out of the MMA loop: summing the dot's operand there slowed wgrad by ~20% on an H100
        # and gave a wrong bf16 dW on the GPU (right under the interpreter). An empty group stores exact 0.
        sum_offs = offs_r[:, None] * stride_am + offs_k[None, :] * stride_ak
        # The round-robin continues past the GEMM tiles, so programs that got one GEMM tile fewer go first.
        first = (pid + NUM_PROGRAMS - (G * tiles_per_group) % NUM_PROGRAMS) % NUM_PROGRAMS
        for tile in range(first, G * k_tiles, NUM_PROGRAMS):
            g = tile // k_tiles
            k_tile = tile % k_tiles
            row_start = pick(starts, offs, g)
            row_end = pick(ends, offs, g)
            k_mask = offs_k < K - k_tile * BLOCK_K
            a_base = a_ptr + row_start * stride_am + (k_tile * BLOCK_K).to(tl.int64) * stride_ak
            partial = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)  # reduced across rows once, at the end
            for r in range(row_start, row_end, BLOCK_R):
                r_mask = offs_r < row_end - r
                a = tl.load(
                    a_base + (r - row_start) * stride_am + sum_offs,
                    mask=r_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                partial += a.to(tl.float32)
            colsum_base = (
                a_colsum_ptr + g.to(tl.int64) * stride_sg + (k_tile * BLOCK_K).to(tl.int64) * stride_sk
            )
            tl.store(
                colsum_base + offs_k * stride_sk,
                tl.sum(partial, 0).to(a_colsum_ptr.dtype.element_ty),
                mask=k_mask,
            )


def tma_store_fits(config, in_itemsize: int) -> bool:
    """Whether the TMA store's bf16 staging tile (BLOCK_K x BLOCK_N) fits next to the operand ring at
    the config's CTAs per SM. The estimate matches what Triton 3.6 allocated for every k_grouped
    candidate compiled for sm_90a, nested and flat, cp.async or TMA loads (their mbarriers take a few
    bytes of SHARED_MARGIN): the ring and the staging tile, nothing else, since the tile reaches it
    in the wgmma layout (a register store in the flat loop converts through 8-32 KB of scratch
    instead). tests/test_sm90_compile.py compiles every candidate it admits, both loops."""
    ring = config.num_stages * config.block_r * (config.block_k + config.block_n) * in_itemsize
    return sm90_shared_fits(ring + config.block_k * config.block_n * 2, config.ctas_per_sm)


@dataclasses.dataclass(frozen=True)
class KGroupedLaunch:
    """Grid and meta-parameters of one k_grouped_mm_kernel launch, derived from static shapes only."""

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
        accumulate: bool,
        interpret: bool,
        max_stride: int | None = None,
        a_k_contiguous: bool = True,
        a_colsum: bool = False,
        g_total: int | None = None,
        out_itemsize: int = 4,
        tma_store: bool = False,
        tma_load: bool = False,
        load_pad: int = 1,
        split_r: int = 1,
        gather_a: bool = False,
        gather_b: bool = False,
    ) -> KGroupedLaunch:
        """max_stride: the largest row/column stride of a, b and out[g] (default: contiguous, max(K, N)).
        a_k_contiguous: a's K stride is 1 (row-major a, the default for contiguous inputs).
        a_colsum: also write the per-group column sums of a (the bias gradient when a is dy).
        g_total: expert parallelism: group_sizes has g_total entries, out the G local groups from a
        device-side group offset (None: no offset, g_total = G).
        out_itemsize: bytes per element of out. The flat loop (config.flat) keeps the pipeline's
        shared buffers live through the epilogue, so the store's layout conversion takes shared memory
        of its own: 128 KB for a 128 x 256 fp32 tile (over the H100's 227 KB with the operands, seen
        on the H100), 64 KB for 128 x 128 (two CTAs no longer fit an SM). 4-byte outputs (fp32
        main_grad) keep the loop per tile.
        tma_store: out can take a TMA descriptor (2-byte out, not accumulating; N contiguous, 16-byte aligned
        base and strides) and Triton has an allocator for the kernel's global scratch.
        tma_load: a and b may be read through TMA descriptors the kernel makes (row-major a, b with
        unit column stride, 16-byte aligned bases and row strides, an allocator for Triton's global
        scratch); used where the config asks for them (config.tma_load), with 2-byte inputs and the
        flat loop.
        load_pad: a's K (row-major a) and b's N are zero-padded to a multiple of this many elements, with
        16-byte aligned rows (the launcher staged them; ``plan.stage_rows``); 1: as given.
        split_r: >1, each tile's rows in that many slices whose fp32 partials the kernel stores into out
        [split_r, G, K, N] (a workspace; ``split_k.reduce_kernel`` sums them): the nested loop, without
        accumulation, column sums, TMA store or group offset.
        gather_a, gather_b: a's (b's) rows are read through an int32 index per reduction row (the expert block's
        token rows): no TMA loads, and no column sums of a gathered a.
        """
        if gather_a and a_colsum:
            raise ValueError("k_grouped: a gathered a takes no column sums")
        if gather_a or gather_b:
            tma_load = False
        if split_r > 1 and (accumulate or a_colsum or g_total is not None):
            raise ValueError(f"split_r={split_r} takes no accumulation, column sums or group offset")
        if M >= 2**31:  # the kernel's row counts (masks, steps) are int32
            raise ValueError(f"k_grouped: a and b have M = {M} rows; the kernel takes fewer than 2**31")
        if tma_store and (accumulate or out_itemsize != 2):
            raise ValueError(
                f"tma_store needs a 2-byte out without accumulation, got {out_itemsize=} {accumulate=}"
            )
        flat = config.flat and out_itemsize <= 2 and split_r == 1
        tma_store = tma_store and split_r == 1
        tma_load = tma_load and config.tma_load and flat and a_k_contiguous and not fp32_inputs
        # The store's staging tile takes shared memory next to the operand ring; where that would cost
        # the config its CTAs per SM, the tile is stored from registers as before.
        tma_store = tma_store and tma_store_fits(config, 4 if fp32_inputs else 2)
        max_stride = max(K, N) if max_stride is None else max_stride
        k_tiles = triton.cdiv(K, config.block_k)
        tiles = G * k_tiles * (triton.cdiv(N, config.block_n) + (1 if a_colsum else 0))
        # num_programs_cap is one wave at one program per SM; a config may ask for several per SM.
        num_programs = max(1, min(tiles * split_r, num_programs_cap * config.ctas_per_sm))
        # The flat loop counts a program's steps in int32: at most cdiv(tiles of a group, programs) tiles of
        # each group, whose steps add up to cdiv(M, BLOCK_R) + G over the groups.
        tiles_per_group = k_tiles * triton.cdiv(N, config.block_n)
        if (
            flat
            and triton.cdiv(tiles_per_group, num_programs) * (triton.cdiv(M, config.block_r) + G) >= 2**31
        ):
            raise ValueError(f"k_grouped: M={M} N={N} K={K} G={G} takes 2**31 or more steps per program")
        meta = dict(
            NUM_PROGRAMS=num_programs,
            BLOCK_K=config.block_k,
            BLOCK_N=config.block_n,
            BLOCK_R=config.block_r,
            GROUP_M=config.group_m,
            # One slot more with an offset: local_group_row_bounds puts the rows before the first group there.
            BLOCK_G=max(16, triton.next_power_of_2(G if g_total is None else G + 1)),
            BLOCK_G_TOTAL=max(16, triton.next_power_of_2(G if g_total is None else g_total)),
            HAS_GROUP_OFFSET=g_total is not None,
            A_K_CONTIGUOUS=a_k_contiguous,
            LOAD_PAD=load_pad,
            WIDE_OFFSETS=2 * max(config.block_k, config.block_n, config.block_r) * max_stride >= 2**31,
            ACCUMULATE=accumulate,
            A_COLSUM=a_colsum,
            FLAT=flat,
            TMA_STORE=tma_store,
            TMA_LOAD=tma_load,
            SPLIT_R=split_r,
            GATHER_A=gather_a,
            GATHER_B=gather_b,
            UPCAST=interpret,
            PRECISION="ieee" if fp32_inputs or interpret else "tf32",
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        return KGroupedLaunch(grid=(num_programs,), meta=meta)
