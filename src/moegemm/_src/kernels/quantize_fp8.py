"""FP8 quantize kernels (current scaling): ``data = cast(clamp(x * (1 / scale))), scale = amax / FP8_MAX``.

The input is a matrix x [R, C] whose rows form groups: activations [M, K] split by device-side
``group_sizes`` (HAS_SIZES), or a weight [G, N, K] seen as [G * N, K] with ``rows_per_group`` = N
(the experts), or one group of all rows. Scale layouts per recipe are in ``moegemm._src.fp8``.

Kernels (each reads x once, except where a scale needs the whole row or group before the first cast):

- ``fp8_quantize_pair_kernel`` (Gluon): data and its transposed copy from one read of x, for tensorwise
  (after ``fp8_group_amax_kernel``), rowwise (after its ROWWISE run and ``grouped_columns_kernel``'s
  column scales) and blockwise; where the plan admits it (``plan.quantize_pair``: the
  ptxas that compiles it was checked byte for byte on the H100), else the two tile launches below.
- ``fp8_quantize_tiles_kernel``: blockwise. Group-aligned row tiles give the 1x128 row scales and
  data (one launch, q_rows x 128 tiles), and the 128x1 column scales and data_t of the transposed copy
  (a second launch, 128 x t_cols tiles: one kernel storing both miscompiles, see the kernel), or the
  128x128 block scale (weights). ``tiles_geometry`` gives each launch's tiles and grid.
  Also the cast pass of tensorwise, whose per-group amax ``fp8_group_amax_kernel`` computed first:
  current scaling needs the amax of the whole group before the first element is cast. That pass can also
  (COLSUM) write its row tiles' column sums, which ``grouped_columns_kernel`` adds up per group: dy's bias
  gradient (docs/design.md, 'FP8 bias gradient'); or (ROWWISE) rowwise's partial row and column maxima.
- ``fp8_quantize_rows_kernel``: rowwise where the pair kernel does not run, one scale per row, in two sweeps over each row (amax,
  then cast); the second sweep reads the rows its program just read, from L2.
- ``fp8_quantize_cols_kernel``: rowwise transposed copy, one scale per (group, column), the same
  two sweeps over a group's rows; optionally (COLSUM) the group's column sums from the first sweep: dy's
  bias gradient (docs/design.md, 'FP8 bias gradient').
"""

from __future__ import annotations

import triton
import triton.language as tl

from moegemm._src.fp8 import SCALE_BLOCK
from moegemm._src.kernels.gluon_hopper import cp, cp_async_load, gl, gluon
from moegemm._src.kernels.schedule import (
    aligned_group_offsets,
    clamped_group_bounds,
    group_row_bounds,
    locate_row_tile,
    pick,
    row_tile_space,
    uniform_group_bounds,
    uniform_row_bounds,
)

# Each group's columns in an activation's data_t start at a multiple of this (16 bytes of fp8), so the
# wgrad kernel's loads along tokens are aligned; moegemm._src.fp8.transposed_columns sizes the storage.
T_ALIGN = tl.constexpr(16)
# The pair kernel's tile side: one 1x128 block wide, one group-aligned 128x1 block tall.
PAIR_BLOCK = tl.constexpr(SCALE_BLOCK)

# SCALING of fp8_quantize_tiles_kernel and fp8_quantize_pair_kernel (ROWWISE: the pair kernel only).
TENSOR, BLOCK_1X128, BLOCK_128X128, ROWWISE = 0, 1, 2, 3


def tile_shape(scaling: int, write_q: bool, config) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of a fp8_quantize_tiles_kernel (or fp8_group_amax_kernel) launch for a
    ``configs.QuantizeConfig``: a 128x128 weight block, else a q_rows x 128 data tile (write_q) or a
    128 x t_cols transposed-copy tile."""
    if scaling == BLOCK_128X128:
        return SCALE_BLOCK, SCALE_BLOCK
    return (config.q_rows, SCALE_BLOCK) if write_q else (SCALE_BLOCK, config.t_cols)


def tiles_geometry(
    R: int, C: int, G: int, scaling: int, write_q: bool, config, sms: int, row_steps: int = 1
) -> tuple[int, int, int, int, tuple[int, int]]:
    """(BLOCK_R, BLOCK_C, CHUNKS, num_warps, grid) of a fp8_quantize_tiles_kernel (or, with write_q and TENSOR,
    fp8_group_amax_kernel) launch over x [R, C] in G groups, for a ``configs.QuantizeConfig``.

    A data tile is q_rows x 128 (its rows' 1x128 scales), a transposed-copy tile 128 x t_cols (its
    columns' group-aligned 128x1 scales), a 128x128 weight block one tile. Each program takes one row
    tile and CHUNKS column tiles of it: the config's q_chunks (t_chunks), halved while that leaves
    under 16 programs per SM (``sms``) so small problems still fill the GPU (a program's tiles run one
    after another). The grid holds every row tile any group sizes can produce (each group adds at
    most one partial tile, plus the tail slot's); the programs past the last one exit. ``row_steps``
    (fp8_group_amax_kernel's ROW_STEPS): a row tile is that many data tiles tall.
    """
    block_r, block_c = tile_shape(scaling, write_q, config)
    if write_q or scaling == BLOCK_128X128:
        chunks, warps = config.q_chunks, config.num_warps
    else:
        chunks, warps = config.t_chunks, config.t_warps
    row_tiles, col_tiles = triton.cdiv(R, block_r * row_steps) + G + 1, triton.cdiv(C, block_c)
    while chunks > 1 and row_tiles * triton.cdiv(col_tiles, chunks) < 16 * sms:
        chunks //= 2
    return block_r, block_c, chunks, warps, (row_tiles, triton.cdiv(col_tiles, chunks))


# Mean rows a group from which the rowwise transposed copy takes its long-group tile (QuantizeConfig.col_block,
# col_rows, col_warps). H100, 2026-11-27 (journal 43): the FP8 block's copies (2048 rows a group on average) ran
# 1.15-1.26x faster with it and dsv3-ep8-fc1's (1024) 1.08x; qwen3-30b-fc1's (128) read 0.155 ms against 0.140
# with the short-group tile (col_short), its 256-row steps mostly masked.
COL_LONG_MIN_ROWS = 256


def cols_geometry(R: int, C: int, G: int, config) -> tuple[int, int, int, tuple[int]]:
    """(BLOCK_R, BLOCK_C, num_warps, grid) of a fp8_quantize_cols_kernel launch over R rows of C columns in G
    groups: a program per (group, column block); groups averaging under ``COL_LONG_MIN_ROWS`` rows take
    ``config.col_short`` (columns, rows a step, warps)."""
    if R >= COL_LONG_MIN_ROWS * max(G, 1):
        block_c, block_r, warps = config.col_block, config.col_rows, config.col_warps
    else:
        block_c, block_r, warps = config.col_short
    return block_r, block_c, warps, (G * triton.cdiv(C, block_c),)


def rows_geometry(R: int, C: int, config) -> tuple[int, int, bool, int, tuple[int]]:
    """(BLOCK_R, BLOCK_C, ONE_SWEEP, num_warps, grid) of a fp8_quantize_rows_kernel launch over x [R, C]. Rows
    of at most ``config.one_sweep_cols`` columns are held whole (one read of x: BLOCK_C the next power of two of
    C, BLOCK_R rows making ``config.one_sweep_elems`` elements, a warp per 2048 columns and at least num_warps);
    wider rows take two sweeps of sweep_rows x sweep_cols steps (amax, then cast, reading x again)."""
    block_c = triton.next_power_of_2(max(C, 1))
    if block_c <= config.one_sweep_cols:
        block_r = max(1, config.one_sweep_elems // block_c)
        warps = max(config.num_warps, block_c // 2048)
        return block_r, block_c, True, warps, (triton.cdiv(R, block_r),)
    rows = config.sweep_rows
    return rows, config.sweep_cols, False, config.num_warps, (triton.cdiv(R, rows),)


@triton.jit
def _scale(amax, FP8_MAX: tl.constexpr):
    """The dequantization factor of a block with this amax; a block of zeros gets 1 (never 0 or inf)."""
    # div_rn: Triton's `/` on fp32 is div.full.f32 on NVIDIA GPUs (not correctly rounded), which made
    # scales and data differ from the twin's IEEE division by an ulp here and there.
    return tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)


@triton.jit
def _inv(scale):
    """The quantization multiplier: 1 / scale correctly rounded, at most the largest finite fp32 (a scale
    under 2^-128 would give inf, and 0 * inf a NaN). Per block, so an element costs a multiply, not a
    division (docs/design.md, 'Quantize')."""
    return tl.minimum(tl.math.div_rn(1.0, scale), 3.4028234663852886e38)


@triton.jit
def _cast(x, inv, FP8_MAX: tl.constexpr, dtype: tl.constexpr, EMULATE_CAST: tl.constexpr):
    """Round-to-nearest-even cast of x * inv (``_inv`` of the scale), clamped to the format's range (it
    may round just past FP8_MAX; float8_e4m3fn has no inf)."""
    q = tl.minimum(tl.maximum(x * inv, -FP8_MAX), FP8_MAX)
    if EMULATE_CAST:
        # The interpreter's float downcast rounds half up and drops the carry into the exponent
        # (1.94 -> 1.0 in e4m3; triton/runtime/interpreter.py, _convert_float), so round to the FP8
        # grid in fp32 first; the cast of a representable value is exact.
        if FP8_MAX == 448.0:
            q = _round_to_grid(q, 3, -6)  # float8_e4m3fn: 3 mantissa bits, min normal exponent -6
        else:
            q = _round_to_grid(q, 2, -14)  # float8_e5m2
    return q.to(dtype)


@triton.jit
def _round_to_grid(v, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """v rounded to the nearest (ties to even) value with MANTISSA bits, subnormals below 2^MIN_EXP."""
    exp = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp = ((tl.maximum(exp, MIN_EXP) - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    # Adding 1.5 * 2^23 leaves no fraction bits in fp32, so the add rounds |v / ulp| < 2^22 to an
    # integer (ties to even); v / ulp and the product are exact (ulp is a power of two).
    # On |v|, with the sign put back, so that a tiny negative value rounds to -0.0 as the hardware's does.
    # (The sign bit is copied: Triton's -x is 0 - x, which turns -0.0 into +0.0.)
    rounded = ((tl.abs(v) / ulp + 12582912.0) - 12582912.0) * ulp
    sign = v.to(tl.int32, bitcast=True) & -(2**31)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _bounds(group_sizes_ptr, G, R, rows_per_group, BLOCK_G: tl.constexpr, HAS_SIZES: tl.constexpr):
    if HAS_SIZES:
        offs, starts, ends = group_row_bounds(group_sizes_ptr, G, R, BLOCK_G)
        return offs.to(tl.int64), starts, ends
    else:
        return uniform_row_bounds(G, R, rows_per_group, BLOCK_G)


@triton.jit
def fp8_group_amax_kernel(
    x_ptr,
    group_sizes_ptr,
    partial_ptr,  # COLSUM: fp32 [row tiles, C]; partial[t] = sum(x[rows of row tile t], 0)
    pmax_ptr,  # ROWWISE: fp32 [row tiles, C]; pmax[t] = max(|x[rows of row tile t]|, 0)
    rmax_ptr,  # ROWWISE: fp32 [column tiles, R]; rmax[j, r] = max |x[r, 128 j : 128 (j + 1)]|
    amax_ptr,  # [G] float32, zero-initialized; amax_ptr[g] = max |x[rows(g)]| (not ROWWISE)
    R,
    C,
    G,
    rows_per_group,
    stride_xr,
    stride_xc,
    stride_pr,  # partial's and pmax's row-tile stride
    stride_rj,  # rmax's column-tile stride
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_SIZES: tl.constexpr,
    # cp.async stages where C and strides are 16-divisible (docs/design.md, 'Quantize')
    NUM_STAGES: tl.constexpr,
    # The column sums of each group-aligned row tile, which ``grouped_columns_kernel`` adds up per group: dy's
    # bias gradient from the read its amax takes anyway (docs/design.md, 'FP8 bias gradient'). A row tile is then
    # ROW_STEPS blocks of BLOCK_R rows, summed elementwise, so the sum crosses warps once a tile and column block.
    COLSUM: tl.constexpr = False,
    ROW_STEPS: tl.constexpr = 1,
    # Rowwise's scales instead of the group amax: each row tile's column maxima (pmax, which
    # grouped_columns_kernel turns into the group's column scales) and each row's maximum per column tile
    # (rmax, which fp8_quantize_pair_kernel reduces into the row's scale), so the pair kernel's one read of x
    # writes both copies (docs/design.md, 'Quantize').
    ROWWISE: tl.constexpr = False,
):
    # Program (row tile, column segment), as fp8_quantize_tiles_kernel; one atomic per program (not ROWWISE).
    TILE_R: tl.constexpr = BLOCK_R * ROW_STEPS
    row_tile = tl.program_id(0)
    offs, starts, ends = _bounds(group_sizes_ptr, G, R, rows_per_group, BLOCK_G, HAS_SIZES)
    starts, ends, m_tiles, tile_ends, total = row_tile_space(offs, starts, ends, G, R, 1, TILE_R)
    g, _, _, row0, row_end, _ = locate_row_tile(
        row_tile, offs, starts, ends, m_tiles, tile_ends, 1, TILE_R, 1
    )
    if row_tile < total and g < G:  # the tail slot's rows belong to no group
        offs_r = tl.arange(0, BLOCK_R)
        offs_c = tl.arange(0, BLOCK_C)
        amax = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        first = tl.program_id(1) * CHUNKS
        if COLSUM or ROWWISE:
            # A plain loop: this nest under tl.range's cp.async pipelining asked the H100 for 264 KB of shared
            # memory on some shapes (2026-11-28).
            for c in range(0, tl.minimum(CHUNKS, tl.cdiv(C, BLOCK_C) - first)):
                col0 = (first + c) * BLOCK_C
                col_mask = offs_c < C - col0
                base = x_ptr + row0 * stride_xr + col0.to(tl.int64) * stride_xc
                colsum = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
                colmax = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
                for r in tl.static_range(ROW_STEPS):  # masked past row_end: a short tile's loads read nothing
                    row_mask = offs_r < row_end - row0 - r * BLOCK_R
                    rows = (r * BLOCK_R + offs_r).to(tl.int64)  # up to 255 rows' stride: past int32
                    x = tl.load(
                        base + rows[:, None] * stride_xr + offs_c[None, :] * stride_xc,
                        mask=row_mask[:, None] & col_mask[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    if ROWWISE:
                        colmax = tl.maximum(colmax, tl.abs(x))
                        r_ptrs = rmax_ptr + (first + c).to(tl.int64) * stride_rj + row0 + rows
                        tl.store(r_ptrs, tl.max(tl.abs(x), 1), mask=row_mask)
                    else:
                        amax = tl.maximum(amax, tl.abs(x))
                    if COLSUM:
                        colsum += x
                p_offs = row_tile.to(tl.int64) * stride_pr + col0 + offs_c
                if COLSUM:
                    tl.store(partial_ptr + p_offs, tl.sum(colsum, 0), mask=col_mask)
                if ROWWISE:
                    tl.store(pmax_ptr + p_offs, tl.max(colmax, 0), mask=col_mask)
        else:
            row_mask = offs_r < row_end - row0
            for c in tl.range(0, tl.minimum(CHUNKS, tl.cdiv(C, BLOCK_C) - first), num_stages=NUM_STAGES):
                col0 = (first + c) * BLOCK_C
                mask = row_mask[:, None] & (offs_c < C - col0)[None, :]
                base = x_ptr + row0 * stride_xr + col0.to(tl.int64) * stride_xc
                x = tl.load(
                    base + offs_r[:, None] * stride_xr + offs_c[None, :] * stride_xc, mask=mask, other=0.0
                )
                amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        if not ROWWISE:
            # max is exact and order-free: the atomics leave a deterministic result.
            tl.atomic_max(amax_ptr + g, tl.max(tl.max(amax, 1), 0))


@triton.jit
def grouped_columns_kernel(
    partial_ptr,  # SUMS: fp32 [row tiles, C] from fp8_group_amax_kernel (COLSUM) with the same TILE_R
    pmax_ptr,  # SCALES: fp32 [row tiles, C] from fp8_group_amax_kernel (ROWWISE) with the same TILE_R
    group_sizes_ptr,
    out_ptr,  # SUMS: [G, C]
    st_ptr,  # SCALES: fp32 [G, C]
    R,
    C,
    G,
    rows_per_group,
    stride_pr,
    stride_og,
    stride_oc,
    stride_sg,
    stride_sc,
    TILE_R: tl.constexpr,  # the partials' row tile
    BLOCK_C: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_SIZES: tl.constexpr,
    SUMS: tl.constexpr,
    SCALES: tl.constexpr,
    FP8_MAX: tl.constexpr = 448.0,
):
    """The per-group column reductions of fp8_group_amax_kernel's row-tile partials, in tile order
    (deterministic); an empty group gets a sum of 0 and a scale of 1. A program per (group, column block).

        out[g] = sum(partial[tiles(g)], 0);  st[g] = scale(max(pmax[tiles(g)], 0))"""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(C, BLOCK_C)
    g = pid // n_blocks
    col0 = (pid % n_blocks) * BLOCK_C
    offs, starts, ends = _bounds(group_sizes_ptr, G, R, rows_per_group, BLOCK_G, HAS_SIZES)
    starts, ends, m_tiles, tile_ends, _ = row_tile_space(offs, starts, ends, G, R, 1, TILE_R)
    n = pick(m_tiles, offs, g)
    offs_c = tl.arange(0, BLOCK_C)
    col_mask = offs_c < C - col0
    p_offs = (pick(tile_ends, offs, g) - n).to(tl.int64) * stride_pr + col0 + offs_c
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for _ in range(0, n):
        if SUMS:
            acc += tl.load(partial_ptr + p_offs, mask=col_mask, other=0.0)
        if SCALES:
            amax = tl.maximum(amax, tl.load(pmax_ptr + p_offs, mask=col_mask, other=0.0))
        p_offs += stride_pr
    if SUMS:
        tl.store(
            out_ptr + g.to(tl.int64) * stride_og + (col0 + offs_c) * stride_oc,
            acc.to(out_ptr.dtype.element_ty),
            mask=col_mask,
        )
    if SCALES:
        tl.store(
            st_ptr + g.to(tl.int64) * stride_sg + (col0 + offs_c) * stride_sc,
            _scale(amax, FP8_MAX),
            mask=col_mask,
        )


@triton.jit
def fp8_quantize_tiles_kernel(
    x_ptr,
    group_sizes_ptr,
    amax_ptr,  # TENSOR: the [G] group amax from fp8_group_amax_kernel
    gather_ptr,  # GATHER: int32 [R], the x row each row quantizes
    q_ptr,
    s_ptr,
    qt_ptr,  # data_t as uint8
    st_ptr,
    R,
    C,
    G,
    rows_per_group,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_qc,
    stride_tg,  # data_t of a weight: [G, C, N] (T_GROUP_LOCAL); activations: [C, >= R + 16 G], unused
    stride_tc,
    stride_tr,
    stride_sg,  # TENSOR: scale[g]; BLOCK_128X128: scale[g, row block, col block]
    stride_sr,  # BLOCK_1X128: scale[row, col block]
    stride_sc,
    stride_stb,  # BLOCK_1X128 transposed: scale_t[group-aligned row block, col]
    stride_stc,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CHUNKS: tl.constexpr,  # BLOCK_C-wide column tiles per program
    BLOCK_G: tl.constexpr,
    HAS_SIZES: tl.constexpr,
    # cp.async stages where C and strides are 16-divisible (docs/design.md, 'Quantize')
    NUM_STAGES: tl.constexpr,
    SCALING: tl.constexpr,
    WRITE_Q: tl.constexpr,  # data and scale
    WRITE_T: tl.constexpr,  # data_t and scale_t; never both in one launch (see below)
    T_GROUP_LOCAL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EMULATE_CAST: tl.constexpr,  # interpreter only
    WIDE_OFFSETS: tl.constexpr,
    # Rows by index (the expert block's wgrad copies of x[gather] and dy[gather]: docs/design.md, 'FP8 expert
    # block'): row r of the groups is x[gather[r]]; R counts gathered rows.
    GATHER: tl.constexpr = False,
    # x is FP8 already, read as bytes (uint8), at the copy's scale: data_t takes its bytes, no cast (tensorwise's
    # wgrad copies of the block's FP8 rows; docs/design.md, 'FP8 expert block'). WRITE_T only.
    BYTES: tl.constexpr = False,
):
    # Program (row tile, column segment): one group-aligned BLOCK_R-row tile and CHUNKS column tiles,
    # so the group bookkeeping (a few reductions over BLOCK_G lanes) is paid once per CHUNKS tiles,
    # and a grid of every tile's program (an upper bound; the extra ones exit) keeps many small tiles
    # in flight per SM: this kernel is bandwidth-bound, and a persistent loop of 128 x 128 tiles left
    # it at 10-30% of HBM (docs/design.md, 'Quantize').
    row_tile = tl.program_id(0)
    offs, starts, ends = _bounds(group_sizes_ptr, G, R, rows_per_group, BLOCK_G, HAS_SIZES)
    t_units = aligned_group_offsets(offs, starts, ends, G, T_ALIGN)
    starts, ends, m_tiles, tile_ends, total = row_tile_space(offs, starts, ends, G, R, 1, BLOCK_R)
    dtype = q_ptr.dtype.element_ty
    # One launch stores data and scale (WRITE_Q), a second one the transposed copy (WRITE_T), each
    # from its own read of x. In one launch the bundled ptxas (12.9) miscompiles the transposed store
    # of FP8 values that are also stored untransposed: on the H100 a tensorwise data_t came out as
    # foreign bytes, silently (three rewrites that kept both stores in one kernel each failed on other
    # widths or input dtypes). https://github.com/triton-lang/triton/issues/11111: "needs both stores
    # present", fixed by ptxas 13.3. The price is a second read of x (2 of 6 bytes per element).
    if SCALING == 0 and WRITE_Q:
        # Every group's scale, empty groups included (they have no tiles to write it).
        if row_tile == 0 and tl.program_id(1) == 0:
            amax = tl.load(amax_ptr + offs, mask=offs < G, other=0.0)
            tl.store(s_ptr + offs * stride_sg, _scale(amax, FP8_MAX), mask=offs < G)
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    if WIDE_OFFSETS:
        offs_r = offs_r.to(tl.int64)
        offs_c = offs_c.to(tl.int64)
    g, m_tile, _, row0, row_end, block_base = locate_row_tile(
        row_tile, offs, starts, ends, m_tiles, tile_ends, 1, BLOCK_R, 1
    )
    first = tl.program_id(1) * CHUNKS
    # Programs past the last row tile run no iteration.
    last = tl.where(row_tile < total, tl.minimum(first + CHUNKS, tl.cdiv(C, BLOCK_C)), first)
    rows = row_end - row0
    row_mask = offs_r < rows
    # The tail slot (g == G) reads nothing and writes zeros: rows past the last group are 0.
    load_mask = offs_r < tl.where(g < G, rows, 0)
    if GATHER:
        src = tl.load(gather_ptr + row0 + offs_r, mask=load_mask, other=0).to(tl.int64)
        x_base = x_ptr + src[:, None] * stride_xr
    else:
        x_base = x_ptr + row0 * stride_xr + offs_r[:, None] * stride_xr
    if SCALING == 0 and not BYTES:
        # Scalar masks are refused by triton 3.9's interpreter: load in bounds, then select.
        inv = _inv(_scale(tl.where(g < G, tl.load(amax_ptr + tl.minimum(g, G - 1)), 0.0), FP8_MAX))
    if WRITE_T:
        # Group g's rows go to its own columns of data_t (group-local for a weight, from a
        # T_ALIGN-aligned offset for activations); rows past the last group have no columns there.
        t_col0 = (m_tile * BLOCK_R).to(tl.int64)
        if T_GROUP_LOCAL:
            t_base = qt_ptr + g.to(tl.int64) * stride_tg
        else:
            t_base = qt_ptr
            t_col0 += pick(t_units, offs, g) * T_ALIGN
        t_base += (t_col0 + offs_r[None, :]) * stride_tr
        # Through the group's 16-aligned end: the padding columns get zeros (x was loaded as 0
        # past the group), which the wgrad kernel's 16-wide loads read.
        # (g < G folds into the bound: triton 3.9's interpreter refuses a scalar and-ed into a mask.)
        t_row_mask = offs_r < tl.where(g < G, tl.cdiv(rows, T_ALIGN) * T_ALIGN, 0)
    for c in tl.range(0, last - first, num_stages=NUM_STAGES):
        n_tile = first + c  # a tensor in both modes (the interpreter's loop variable is an int)
        col0 = (n_tile * BLOCK_C).to(tl.int64)
        col_mask = offs_c < C - col0
        x_ptrs = x_base + (col0 + offs_c[None, :]) * stride_xc
        x_mask = load_mask[:, None] & col_mask[None, :]
        if BYTES:
            q = tl.load(x_ptrs, mask=x_mask, other=0)
        else:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
            if SCALING == 0:
                q = _cast(x, inv, FP8_MAX, dtype, EMULATE_CAST)
            elif SCALING == 1:
                if WRITE_Q:
                    row_scale = _scale(tl.max(tl.abs(x), 1), FP8_MAX)  # [BLOCK_R]: 1x128 along C
                    q = _cast(x, _inv(row_scale)[:, None], FP8_MAX, dtype, EMULATE_CAST)
                    s_ptrs = s_ptr + (row0 + offs_r) * stride_sr + n_tile.to(tl.int64) * stride_sc
                    tl.store(s_ptrs, row_scale, mask=row_mask)
                else:
                    col_scale = _scale(tl.max(tl.abs(x), 0), FP8_MAX)  # [BLOCK_C]: 128x1 along R
                    q = _cast(x, _inv(col_scale)[None, :], FP8_MAX, dtype, EMULATE_CAST)
                    st_ptrs = (
                        st_ptr
                        + (block_base + m_tile).to(tl.int64) * stride_stb
                        + (col0 + offs_c) * stride_stc
                    )
                    tl.store(st_ptrs, col_scale, mask=offs_c < tl.where(g < G, C - col0, 0))
            else:
                block_scale = _scale(tl.max(tl.max(tl.abs(x), 1), 0), FP8_MAX)  # one per 128x128 block
                q = _cast(x, _inv(block_scale), FP8_MAX, dtype, EMULATE_CAST)
                s_off = (
                    g.to(tl.int64) * stride_sg
                    + m_tile.to(tl.int64) * stride_sr
                    + n_tile.to(tl.int64) * stride_sc
                )
                if WRITE_Q and g < G:
                    tl.store(s_ptr + s_off, block_scale)
        if WRITE_Q:
            q_ptrs = q_ptr + (row0 + offs_r[:, None]) * stride_qr + (col0 + offs_c[None, :]) * stride_qc
            tl.store(q_ptrs, q, mask=row_mask[:, None] & col_mask[None, :])
        if WRITE_T:
            qt = tl.trans(q.to(tl.uint8, bitcast=True))
            tl.store(
                t_base + (col0 + offs_c[:, None]) * stride_tc,
                qt,
                mask=col_mask[:, None] & t_row_mask[None, :],
            )


def pair_geometry(R: int, C: int, G: int, config, sms: int) -> tuple[int, tuple[int, int]]:
    """(CHUNKS, grid) of a fp8_quantize_pair_kernel launch over x [R, C] in G groups: a program per
    (group-aligned 128-row tile, CHUNKS 128-column tiles), CHUNKS the config's pair_chunks halved while
    that leaves under 4 programs per SM; every row tile any group sizes can produce (each group adds at
    most one partial tile, plus the tail slot's), the extra programs exit."""
    row_tiles, col_tiles = triton.cdiv(R, SCALE_BLOCK) + G + 1, triton.cdiv(C, SCALE_BLOCK)
    chunks = config.pair_chunks
    while chunks > 1 and row_tiles * triton.cdiv(col_tiles, chunks) < 4 * sms:
        chunks //= 2
    return chunks, (row_tiles, triton.cdiv(col_tiles, chunks))


@gluon.constexpr_function
def _pair_layout(num_warps, rows_first):
    """The 128 x 128 tile of fp8_quantize_pair_kernel: a thread holds 4 rows x 8 columns (twice, 64
    columns apart, at 8 warps); lanes 4 along columns and 8 along rows, warps along both, so both amax
    reductions cross warps. ``rows_first`` orders a thread's registers along rows (4 consecutive tokens
    of a column: one 4-byte store into data_t) instead of columns (8 bytes of a data row); the elements
    stay in the same threads, so converting between the two orders moves no data."""
    if num_warps not in (8, 16):
        raise ValueError(f"fp8_quantize_pair_kernel holds a tile with 8 or 16 warps, not {num_warps}")
    cols, rows = [[0, 1], [0, 2], [0, 4]], [[1, 0], [2, 0]]
    if num_warps == 16:
        extra, warps = [], [[0, 32], [0, 64], [32, 0], [64, 0]]
    else:
        extra, warps = [[0, 64]], [[0, 32], [32, 0], [64, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=(rows + cols if rows_first else cols + rows) + extra,
        lane_bases=[[0, 8], [0, 16], [4, 0], [8, 0], [16, 0]],
        warp_bases=warps,
        block_bases=[],
        shape=[SCALE_BLOCK, SCALE_BLOCK],
    )


@gluon.jit
def _pair_copy(bufs, step, x_base, n_tile, last, offs_c, load_mask, C, stride_xc):
    """cp.async of column tile ``n_tile`` into ring slot step % NUM_STAGES (masked off past ``last``, so
    the commit counts stay uniform). Each thread copies the elements it later reads, so no barrier is
    needed between the copy, the read and the slot's reuse."""
    col0 = (n_tile * PAIR_BLOCK).to(gl.int64)
    mask = load_mask[:, None] & (offs_c < gl.where(n_tile < last, C - col0, 0))[None, :]
    cp_async_load(bufs.index(step % bufs.shape[0]), x_base + (col0 + offs_c[None, :]) * stride_xc, mask=mask)
    cp.commit_group()


@gluon.jit
def _pair_cast_t(x, inv, t_layout: gl.constexpr, FP8_MAX: gl.constexpr, dtype: gl.constexpr):
    """data_t's bytes of a tile whose data_t values equal its data values (one multiplier): x's registers
    reordered along tokens (in place: assert_trivial), then cast, so each conversion packs consecutive tokens.
    Reordering data's own FP8 bytes instead is what ptxas before 13.3 miscompiles, silently
    (https://github.com/triton-lang/triton/issues/11111; on the H100 with the bundled 12.8 a third of a
    tensorwise data_t came out wrong)."""
    xt = gl.convert_layout(x, t_layout, assert_trivial=True)
    return _cast(xt, inv, FP8_MAX, dtype, False).to(gl.uint8, bitcast=True)


@gluon.jit
def fp8_quantize_pair_kernel(
    x_ptr,
    group_sizes_ptr,
    amax_ptr,  # TENSOR: the [G] group amax from fp8_group_amax_kernel; ROWWISE: its rmax [column tiles, R]
    q_ptr,
    s_ptr,
    qt_ptr,  # data_t as uint8
    st_ptr,
    R,
    C,
    G,
    rows_per_group,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_qc,
    stride_tg,  # as fp8_quantize_tiles_kernel
    stride_tc,
    stride_tr,
    stride_sg,
    stride_sr,
    stride_sc,
    stride_stb,
    stride_stc,
    stride_aj,  # ROWWISE: amax_ptr's column-tile stride
    CHUNKS: gl.constexpr,  # 128-wide column tiles per program
    BLOCK_G: gl.constexpr,
    HAS_SIZES: gl.constexpr,
    NUM_STAGES: gl.constexpr,  # tiles in the cp.async ring
    SCALING: gl.constexpr,
    T_GROUP_LOCAL: gl.constexpr,
    FP8_MAX: gl.constexpr,
    WIDE_OFFSETS: gl.constexpr,
    AMAX_COLS: gl.constexpr = 1,  # ROWWISE: amax_ptr's rows (C's 128-wide tiles) or more, a power of two
):
    """x [R, C] in groups -> data q [R, C] and scale s, and data_t qt and scale_t st, from one read:
    ``fp8_quantize_tiles_kernel``'s two launches (WRITE_Q, then WRITE_T) in one, byte for byte; for ROWWISE,
    ``fp8_quantize_rows_kernel``'s and ``fp8_quantize_cols_kernel``'s.

        for each group-aligned 128 x 128 tile t of x:  q[t], qt[t^T] = cast(t * inv), cast(t * inv_t)

    inv and inv_t are the same multiplier (TENSOR: the group's; BLOCK_128X128: the tile's), or the 1x128
    row scales' and the 128x1 column scales' (BLOCK_1X128), or (ROWWISE) the rows' scales, from their
    maxima per column tile (amax_ptr: fp8_group_amax_kernel's rmax), and the group's column scales st
    [G, C], given (grouped_columns_kernel). Programs, tail slot and data_t columns as
    fp8_quantize_tiles_kernel; 8 or 16 warps hold a tile (``_pair_layout``)."""
    BLOCK: gl.constexpr = PAIR_BLOCK
    layout: gl.constexpr = _pair_layout(gl.num_warps(), False)
    t_layout: gl.constexpr = _pair_layout(gl.num_warps(), True)
    sched: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    row_tile = gl.program_id(0)
    offs = gl.arange(0, BLOCK_G, layout=sched).to(gl.int64)
    if HAS_SIZES:
        starts, ends = clamped_group_bounds(group_sizes_ptr, offs, G, R)
    else:
        starts, ends = uniform_group_bounds(offs, G, R, rows_per_group)
    t_units = aligned_group_offsets(offs, starts, ends, G, T_ALIGN)
    starts, ends, m_tiles, tile_ends, total = row_tile_space(offs, starts, ends, G, R, 1, BLOCK)
    if SCALING == 0:
        # Every group's scale, empty groups included (they have no tiles to write it).
        if row_tile == 0 and gl.program_id(1) == 0:
            amax = gl.load(amax_ptr + offs, mask=offs < G, other=0.0)
            gl.store(s_ptr + offs * stride_sg, _scale(amax, FP8_MAX), mask=offs < G)
    g, m_tile, _, row0, row_end, block_base = locate_row_tile(
        row_tile, offs, starts, ends, m_tiles, tile_ends, 1, BLOCK, 1
    )
    first = gl.program_id(1) * CHUNKS
    # Programs past the last row tile run no iteration.
    last = gl.where(row_tile < total, gl.minimum(first + CHUNKS, gl.cdiv(C, BLOCK)), first)
    rows = row_end - row0
    in_group = g < G  # the tail slot (g == G) reads nothing and writes zero rows, no data_t

    offs_r = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout))
    t_r = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, t_layout))
    t_c = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, t_layout))
    if WIDE_OFFSETS:
        offs_r = offs_r.to(gl.int64)
        offs_c = offs_c.to(gl.int64)
        t_r = t_r.to(gl.int64)
        t_c = t_c.to(gl.int64)
    row_mask = offs_r < rows
    load_mask = offs_r < gl.where(in_group, rows, 0)
    x_base = x_ptr + row0 * stride_xr + offs_r[:, None] * stride_xr
    q_base = q_ptr + row0 * stride_qr + offs_r[:, None] * stride_qr
    # Group g's rows go to its own columns of data_t (group-local for a weight, from a T_ALIGN-aligned
    # offset for activations), through the group's 16-aligned end (zeros past the group: x loads as 0
    # there), which the wgrad's 16-wide loads read.
    t_col0 = (m_tile * BLOCK).to(gl.int64)
    if T_GROUP_LOCAL:
        t_base = qt_ptr + g.to(gl.int64) * stride_tg
    else:
        t_base = qt_ptr
        t_col0 += pick(t_units, offs, g) * T_ALIGN
    t_base += (t_col0 + t_r[:, None]) * stride_tr
    t_row_mask = t_r < gl.where(in_group, gl.cdiv(rows, T_ALIGN) * T_ALIGN, 0)
    if SCALING == 0:
        inv = _inv(_scale(gl.where(in_group, gl.load(amax_ptr + gl.minimum(g, G - 1)), 0.0), FP8_MAX))
    elif SCALING == 1:
        s_base = s_ptr + (row0 + offs_r) * stride_sr
        st_base = st_ptr + (block_base + m_tile).to(gl.int64) * stride_stb
    elif SCALING == 3:
        # The rows' scales from their maxima over every column tile (one load of 128 x AMAX_COLS, lanes along
        # the rows: amax_ptr is [column tiles, R]), written by the first column segment's program; the tail
        # slot's rows get 1 (x is 0 there).
        a_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, gl.num_warps()], [0, 1])
        a_r = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, a_layout))
        a_c = gl.arange(0, AMAX_COLS, layout=gl.SliceLayout(0, a_layout))
        a_mask = (a_r < gl.where(in_group, rows, 0))[:, None] & (a_c < gl.cdiv(C, BLOCK))[None, :]
        row_amax = gl.load(
            amax_ptr + a_c.to(gl.int64)[None, :] * stride_aj + (row0 + a_r)[:, None], mask=a_mask, other=0.0
        )
        row_scale = _scale(gl.convert_layout(gl.max(row_amax, 1), gl.SliceLayout(1, layout)), FP8_MAX)
        if gl.program_id(1) == 0:
            gl.store(s_ptr + (row0 + offs_r) * stride_sr, row_scale, mask=row_mask)
        row_inv = _inv(row_scale)
        st_base = st_ptr + gl.minimum(g, G - 1).to(gl.int64) * stride_stb
    else:
        s_base = s_ptr + g.to(gl.int64) * stride_sg + m_tile.to(gl.int64) * stride_sr

    bufs = gl.allocate_shared_memory(
        x_ptr.dtype.element_ty,
        [NUM_STAGES, BLOCK, BLOCK],
        gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]),
    )
    for i in gl.static_range(NUM_STAGES - 1):  # the ring's first tiles in flight
        _pair_copy(bufs, i, x_base, first + i, last, offs_c, load_mask, C, stride_xc)
    for n_tile in range(first, last):
        step = n_tile - first
        _pair_copy(
            bufs,
            step + NUM_STAGES - 1,
            x_base,
            n_tile + NUM_STAGES - 1,
            last,
            offs_c,
            load_mask,
            C,
            stride_xc,
        )
        cp.wait_group(NUM_STAGES - 1)  # this tile's copies (this thread's own) landed
        x = bufs.index(step % NUM_STAGES).load(layout).to(gl.float32)
        col0 = (n_tile * BLOCK).to(gl.int64)
        col_mask = offs_c < C - col0
        if SCALING == 0:
            q = _cast(x, inv, FP8_MAX, dtype, False)
            qt = _pair_cast_t(x, inv, t_layout, FP8_MAX, dtype)
        elif SCALING == 1:
            a = gl.abs(x)
            row_scale = _scale(gl.max(a, 1), FP8_MAX)  # 1x128 along C
            col_scale = _scale(gl.max(a, 0), FP8_MAX)  # 128x1 along R (group-aligned)
            q = _cast(x, _inv(row_scale)[:, None], FP8_MAX, dtype, False)
            # Other values than data's: the byte reorder below is safe (checked byte for byte, 'Quantize').
            qt = _cast(x, _inv(col_scale)[None, :], FP8_MAX, dtype, False)
            qt = gl.convert_layout(qt.to(gl.uint8, bitcast=True), t_layout, assert_trivial=True)
            gl.store(s_base + n_tile.to(gl.int64) * stride_sc, row_scale, mask=row_mask)
            gl.store(
                st_base + (col0 + offs_c) * stride_stc,
                col_scale,
                mask=offs_c < gl.where(in_group, C - col0, 0),
            )
        elif SCALING == 3:
            col_scale = gl.load(
                st_base + (col0 + offs_c) * stride_stc,
                mask=offs_c < gl.where(in_group, C - col0, 0),
                other=1.0,
            )
            q = _cast(x, row_inv[:, None], FP8_MAX, dtype, False)
            # Other values than data's, as BLOCK_1X128's (checked byte for byte, 'Quantize').
            qt = _cast(x, _inv(col_scale)[None, :], FP8_MAX, dtype, False)
            qt = gl.convert_layout(qt.to(gl.uint8, bitcast=True), t_layout, assert_trivial=True)
        else:
            block_scale = _scale(gl.max(gl.max(gl.abs(x), 1), 0), FP8_MAX)  # one per 128x128 block
            q = _cast(x, _inv(block_scale), FP8_MAX, dtype, False)
            qt = _pair_cast_t(x, _inv(block_scale), t_layout, FP8_MAX, dtype)
            if in_group:
                gl.store(s_base + n_tile.to(gl.int64) * stride_sc, block_scale)
        gl.store(q_base + (col0 + offs_c[None, :]) * stride_qc, q, mask=row_mask[:, None] & col_mask[None, :])
        gl.store(
            t_base + (col0 + t_c[None, :]) * stride_tc,
            qt,
            mask=t_row_mask[:, None] & (t_c < C - col0)[None, :],
        )
    cp.wait_group(0)


@triton.jit
def fp8_quantize_rows_kernel(
    x_ptr,
    group_sizes_ptr,
    q_ptr,
    s_ptr,  # [R]: one scale per row
    R,
    C,
    G,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_qc,
    stride_s,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_SIZES: tl.constexpr,
    # cp.async stages where C and strides are 16-divisible (docs/design.md, 'Quantize')
    NUM_STAGES: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EMULATE_CAST: tl.constexpr,  # interpreter only
    ONE_SWEEP: tl.constexpr = False,  # BLOCK_C >= C: a row is read once and held (rows_geometry)
):
    pid = tl.program_id(0)
    owned = R
    if HAS_SIZES:
        offs, starts, ends = group_row_bounds(group_sizes_ptr, G, R, BLOCK_G)
        owned = tl.max(tl.where(offs < G, ends, 0), 0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    load_mask = rows < owned  # rows past the last group quantize to 0 (scale 1)
    offs_c = tl.arange(0, BLOCK_C)
    x_base = x_ptr + rows[:, None] * stride_xr
    q_base = q_ptr + rows[:, None] * stride_qr
    if ONE_SWEEP:
        # The whole row in registers: x is read once; the two sweeps below ran up to 1.8x slower where both
        # apply (docs/design.md, 'Quantize').
        full_mask = (offs_c < C)[None, :]
        row = tl.load(x_base + offs_c[None, :] * stride_xc, mask=load_mask[:, None] & full_mask, other=0.0)
        row = row.to(tl.float32)
        row_scale = _scale(tl.max(tl.abs(row), 1), FP8_MAX)
        tl.store(s_ptr + rows * stride_s, row_scale, mask=row_mask)
        row_q = _cast(row, _inv(row_scale)[:, None], FP8_MAX, q_ptr.dtype.element_ty, EMULATE_CAST)
        tl.store(q_base + offs_c[None, :] * stride_qc, row_q, mask=row_mask[:, None] & full_mask)
    else:
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c in tl.range(0, C, BLOCK_C, num_stages=NUM_STAGES):
            mask = load_mask[:, None] & (offs_c < C - c)[None, :]
            x = tl.load(x_base + (c + offs_c)[None, :] * stride_xc, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
        scale = _scale(amax, FP8_MAX)
        tl.store(s_ptr + rows * stride_s, scale, mask=row_mask)
        inv = _inv(scale)
        for c in tl.range(0, C, BLOCK_C, num_stages=NUM_STAGES):
            col_mask = (offs_c < C - c)[None, :]
            x = tl.load(
                x_base + (c + offs_c)[None, :] * stride_xc, mask=load_mask[:, None] & col_mask, other=0.0
            )
            q = _cast(x.to(tl.float32), inv[:, None], FP8_MAX, q_ptr.dtype.element_ty, EMULATE_CAST)
            tl.store(q_base + (c + offs_c)[None, :] * stride_qc, q, mask=row_mask[:, None] & col_mask)


@triton.jit
def _source_rows(gather_ptr, r, offs_r, end, GATHER: tl.constexpr):
    """The x rows that rows r + offs_r read: themselves, or (GATHER) gather[r + offs_r], 0 past end."""
    if GATHER:
        return tl.load(gather_ptr + r + offs_r, mask=offs_r < end - r, other=0).to(tl.int64)
    return r + offs_r


@triton.jit
def fp8_quantize_cols_kernel(
    x_ptr,
    group_sizes_ptr,
    gather_ptr,  # GATHER: int32 [R], the x row each row quantizes
    colsum_ptr,  # COLSUM: [G, C], colsum[g] = sum(x[rows(g)], 0)
    qt_ptr,
    st_ptr,  # [G, C]: one scale per (group, column)
    R,
    C,
    G,
    rows_per_group,
    stride_xr,
    stride_xc,
    stride_tg,
    stride_tc,
    stride_tr,
    stride_stg,
    stride_stc,
    stride_bg,
    stride_bc,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HAS_SIZES: tl.constexpr,
    # cp.async stages where C and strides are 16-divisible (docs/design.md, 'Quantize')
    NUM_STAGES: tl.constexpr,
    T_GROUP_LOCAL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EMULATE_CAST: tl.constexpr,  # interpreter only
    GATHER: tl.constexpr = False,  # row r is x[gather[r]] (fp8_quantize_tiles_kernel's GATHER)
    # The group's column sums from the amax sweep (the bias gradient; docs/design.md, 'FP8 bias gradient')
    COLSUM: tl.constexpr = False,
):
    # One program per (group, column tile).
    fp8_type: tl.constexpr = tl.float8e4nv if FP8_MAX == 448.0 else tl.float8e5  # qt_ptr is uint8
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(C, BLOCK_C)
    g = pid // n_tiles
    col0 = (pid % n_tiles).to(tl.int64) * BLOCK_C
    offs, starts, ends = _bounds(group_sizes_ptr, G, R, rows_per_group, BLOCK_G, HAS_SIZES)
    start = pick(starts, offs, g)
    end = pick(ends, offs, g)
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    col_mask = offs_c < C - col0
    x_base = x_ptr + col0 * stride_xc + offs_c[None, :] * stride_xc
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    colsum = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r in tl.range(start, end, BLOCK_R, num_stages=NUM_STAGES):
        mask = (offs_r < end - r)[:, None] & col_mask[None, :]
        x = tl.load(
            x_base + _source_rows(gather_ptr, r, offs_r, end, GATHER)[:, None] * stride_xr,
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
        if COLSUM:
            colsum += tl.sum(x, 0)
    if COLSUM:
        tl.store(
            colsum_ptr + g.to(tl.int64) * stride_bg + (col0 + offs_c) * stride_bc,
            colsum.to(colsum_ptr.dtype.element_ty),
            mask=col_mask,
        )
    scale = _scale(amax, FP8_MAX)
    tl.store(st_ptr + g.to(tl.int64) * stride_stg + (col0 + offs_c) * stride_stc, scale, mask=col_mask)
    # data_t as bytes (uint8): this kernel's transposed FP8 values are the only ones it stores, and its
    # bytes came out right on the H100 for every width checked (tools/check_quantize_bytes.py),
    # whereas packing token pairs into 16-bit words did not (fp32 inputs, C a multiple of 16).
    if T_GROUP_LOCAL:
        t_base = qt_ptr + g.to(tl.int64) * stride_tg
    else:
        t_units = pick(aligned_group_offsets(offs, starts, ends, G, T_ALIGN), offs, g)
        t_base = qt_ptr + t_units * T_ALIGN * stride_tr
    t_base += (col0 + offs_c[:, None]) * stride_tc
    # Through the group's 16-aligned end, zeros past it (see fp8_quantize_tiles_kernel).
    t_end = start + tl.cdiv(end - start, T_ALIGN) * T_ALIGN
    inv = _inv(scale)
    for r in tl.range(start, t_end, BLOCK_R, num_stages=NUM_STAGES):
        x = tl.load(
            x_base + _source_rows(gather_ptr, r, offs_r, end, GATHER)[:, None] * stride_xr,
            mask=(offs_r < end - r)[:, None] & col_mask[None, :],
            other=0.0,
        )
        qt = _cast(x.to(tl.float32), inv[None, :], FP8_MAX, fp8_type, EMULATE_CAST)
        tl.store(
            t_base + (r - start + offs_r)[None, :] * stride_tr,
            tl.trans(qt.to(tl.uint8, bitcast=True)),
            mask=col_mask[:, None] & (offs_r < t_end - r)[None, :],
        )
