"""Device-side group bookkeeping shared by the grouped kernels.

Group sizes live in device memory. Every program recomputes the row offsets from
them (a prefix sum over at most a few hundred ints, cheaper than a companion
launch and free of workspaces), so no host sync and no extra kernel is needed.

Clamping rules, which make any device-side ``group_sizes`` memory-safe:
``size_g -> min(max(size_g, 0), M)``, ``end_g = min(sum_{h<=g} size_h, M)``,
``start_g = min(end_g_unclamped - size_g, M)``. Rows past ``sum(group_sizes)``
belong to no group.
"""

import triton
import triton.language as tl

# Shared memory an SM gives its CTAs on sm90 (228 KB, 1 KB of it reserved per CTA), and the slack the
# kernels' estimates of their own allocation keep (the TMA-store checks; tests/test_sm90_compile.py
# compiles every candidate they admit and checks the estimate).
SM90_SHARED_PER_SM = 233472
SM90_SHARED_RESERVED_PER_CTA = 1024
SHARED_MARGIN = 2048


def sm90_shared_fits(shared_bytes: int, ctas_per_sm: int) -> bool:
    """Whether ``ctas_per_sm`` CTAs of ``shared_bytes`` each (plus SHARED_MARGIN) fit one sm90 SM."""
    return ctas_per_sm * (shared_bytes + SHARED_MARGIN + SM90_SHARED_RESERVED_PER_CTA) <= SM90_SHARED_PER_SM


@triton.jit
def group_row_bounds(group_sizes_ptr, G, M, BLOCK_G: tl.constexpr):
    """Returns (offs, starts, ends) int64 vectors of length BLOCK_G (slots >= G are empty).

    Example, M=10, group_sizes=[3, 0, 4]: starts=[0, 3, 3], ends=[3, 3, 7]; rows 7..9 are unowned.
    With group_sizes=[8, -2, 5]: sizes clamp to [8, 0, 5] and ends to [8, 8, 10] (sum 13 > M).
    """
    offs = tl.arange(0, BLOCK_G)
    starts, ends = clamped_group_bounds(group_sizes_ptr, offs, G, M)
    return offs, starts, ends


@triton.jit
def clamped_group_bounds(group_sizes_ptr, offs, G, M):
    """(starts, ends) int64 of the groups in slots ``offs`` (an arange over >= G slots) by the clamping
    rules above. The one copy of them: ``group_row_bounds`` passes a ``tl.arange``, the Gluon kernels
    one with their layout (Gluon's arange needs one)."""
    sizes = tl.load(group_sizes_ptr + offs, mask=offs < G, other=0).to(tl.int64)
    sizes = tl.minimum(tl.maximum(sizes, 0), M)
    ends_unclamped = tl.cumsum(sizes, 0)
    starts = tl.minimum(ends_unclamped - sizes, M)
    ends = tl.minimum(ends_unclamped, M)
    return starts, ends


@triton.jit
def clamped_group_offset(group_offset_ptr, G, G_TOTAL):
    """The first local group ``*group_offset_ptr``, taken as jax.lax.dynamic_slice takes a start index:
    negative counts from the end, then clamped to [0, G_TOTAL - G]."""
    offset = tl.load(group_offset_ptr).to(tl.int32)
    offset = tl.where(offset < 0, offset + G_TOTAL, offset)
    return tl.minimum(tl.maximum(offset, 0), G_TOTAL - G)


@triton.jit
def local_group_row_bounds(
    group_sizes_ptr, group_offset_ptr, G, G_TOTAL, M, BLOCK_G: tl.constexpr, BLOCK_G_TOTAL: tl.constexpr
):
    """Expert parallelism: (offs, starts, ends) of the G local groups, which are groups
    [offset, offset + G) of the G_TOTAL in ``group_sizes_ptr``, offset = ``*group_offset_ptr``.

    The bounds are those of the global rule (every group's rows where ``group_row_bounds`` over all
    G_TOTAL groups puts them), so a launch reads and writes the local rows in place. Slot G holds the
    rows before the first local group, [0, first_row); like the tail slot, nobody owns them. The
    offset is taken as jax.lax.dynamic_slice takes a start index (negative counts from the end, then
    clamped to [0, G_TOTAL - G]), so no device-side value reads outside group_sizes.
    Example, M=12, group_sizes=[3, 2, 4, 1], offset=1, G=2: starts=[3, 5, 0], ends=[5, 9, 3].
    """
    offset = clamped_group_offset(group_offset_ptr, G, G_TOTAL)
    before = tl.arange(0, BLOCK_G_TOTAL)
    skipped = tl.load(group_sizes_ptr + before, mask=before < offset, other=0).to(tl.int64)
    first_row = tl.minimum(tl.sum(tl.minimum(tl.maximum(skipped, 0), M), 0), M)
    offs = tl.arange(0, BLOCK_G)
    sizes = tl.load(group_sizes_ptr + offset + offs, mask=offs < G, other=0).to(tl.int64)
    sizes = tl.minimum(tl.maximum(sizes, 0), M)
    ends_unclamped = first_row + tl.cumsum(sizes, 0)
    starts = tl.where(offs == G, 0, tl.minimum(ends_unclamped - sizes, M))
    ends = tl.where(offs == G, first_row, tl.minimum(ends_unclamped, M))
    return offs, starts, ends


@triton.jit
def pick(values, offs, index):
    """values[index] for a register vector (a masked reduction; Triton has no dynamic register indexing)."""
    return tl.sum(tl.where(offs == index, values, 0), 0)


@triton.jit
def strided_share(end, pid, NUM_PROGRAMS: tl.constexpr):
    """How many of the indices pid, pid + NUM_PROGRAMS, pid + 2 * NUM_PROGRAMS, ... lie below ``end`` (a scalar
    or a vector; ends <= pid count 0): a persistent program's share of the work items [0, end)."""
    return tl.maximum(end - pid + NUM_PROGRAMS - 1, 0) // NUM_PROGRAMS


@triton.jit
def swizzle_tile(local, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """Maps a tile index inside one group to (m_tile, n_tile), GROUP_M m-tiles per band.

    A band of GROUP_M row tiles sweeps all column tiles before the next band starts, so
    consecutive programs share weight columns (memory-bound MoE shapes, where a group has
    <= GROUP_M row tiles, read each weight byte from HBM once) and activation rows stay in L2.
    """
    band_width = GROUP_M * n_tiles
    band = local // band_width
    first_m = band * GROUP_M
    band_m = tl.minimum(m_tiles - first_m, GROUP_M)
    in_band = local % band_width
    return first_m + in_band % band_m, in_band // band_m


@triton.jit
def uniform_row_bounds(G, M, rows_per_group, BLOCK_G: tl.constexpr):
    """(offs, starts, ends) of G groups of ``rows_per_group`` consecutive rows each, cut at M: the
    experts of a [G, N, K] weight seen as [G * N, K] rows, or one group over all M rows (G=1)."""
    offs = tl.arange(0, BLOCK_G).to(tl.int64)
    starts, ends = uniform_group_bounds(offs, G, M, rows_per_group)
    return offs, starts, ends


@triton.jit
def uniform_group_bounds(offs, G, M, rows_per_group):
    """(starts, ends) of ``uniform_row_bounds``'s groups in slots ``offs`` (int64; Gluon kernels pass an
    arange with their layout, as to ``clamped_group_bounds``)."""
    starts = tl.minimum(offs * rows_per_group, M)
    ends = tl.where(offs < G, tl.minimum(starts + rows_per_group, M), starts)
    return starts, ends


@triton.jit
def row_tile_space(offs, starts, ends, G, M, n_tiles, BLOCK_M: tl.constexpr):
    """The tile space of groups of rows: group g owns ``cdiv(rows_g, BLOCK_M) * n_tiles`` consecutive
    tiles, and slot G owns the rows past the last group (zero-filled by the kernels).

    Returns (starts, ends, m_tiles, tile_ends, total_tiles), with slot G's bounds filled in.
    """
    owned = tl.max(tl.where(offs < G, ends, 0), 0)
    starts = tl.where(offs == G, owned, starts)
    ends = tl.where(offs == G, M, ends)
    m_tiles = tl.where(offs <= G, tl.cdiv(ends - starts, BLOCK_M), 0)
    tile_ends = tl.cumsum(m_tiles * n_tiles, 0)
    return starts, ends, m_tiles, tile_ends, tl.max(tile_ends, 0)


@triton.jit
def locate_row_tile(tile, offs, starts, ends, m_tiles, tile_ends, n_tiles, BLOCK_M: tl.constexpr, GROUP_M):
    """Tile index -> (g, m_tile, n_tile, row0, row_end, first_m_tile): its group (G for the tail slot),
    its place in that group, its first row and the group's end row (int64), and the number of row tiles
    of the groups before g (a group-aligned block index base)."""
    g = tl.sum((tile_ends <= tile).to(tl.int32), 0)
    g_m_tiles = pick(m_tiles, offs, g)
    group_first_tile = pick(tile_ends, offs, g) - g_m_tiles * n_tiles
    m_tile, n_tile = swizzle_tile(tile - group_first_tile, g_m_tiles, n_tiles, GROUP_M)
    row0 = pick(starts, offs, g) + m_tile * BLOCK_M
    return g, m_tile, n_tile, row0, pick(ends, offs, g), group_first_tile // n_tiles


@triton.jit
def aligned_group_offsets(offs, starts, ends, G, ALIGN: tl.constexpr):
    """Exclusive prefix sum of cdiv(rows_g, ALIGN): group g's first column in a transposed copy whose
    groups each start at a multiple of ALIGN, counted in units of ALIGN (with ALIGN = 128, group g's
    first 128-row scale block). Callers pick a group's entry
    and multiply by ALIGN themselves, so Triton sees the product's divisibility (vectorized loads
    along the token dimension)."""
    units = tl.where(offs < G, tl.cdiv(ends - starts, ALIGN), 0)
    return tl.cumsum(units, 0) - units


@triton.jit
def m_grouped_tile_space(
    group_sizes_ptr, group_offset_ptr, G, G_TOTAL, M, n_tiles, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_G_TOTAL: tl.constexpr, HAS_GROUP_OFFSET: tl.constexpr,
    FILL_TAIL: tl.constexpr = True,
):  # fmt: skip
    """The tile space of an m-grouped launch (``row_tile_space``) and, with a group offset, its zero tiles.

    Returns (offs, starts, ends, m_tiles, tile_ends, total_tiles, first_row, local_end, head_tiles,
    zero_tiles, zero_per_tile). With HAS_GROUP_OFFSET the tile space holds the local groups only (its
    tail slot is cut to nothing at local_end); the unowned rows before them ([0, first_row)) and after
    them ([local_end, M)) are ``zero_tiles`` tiles, of which every GEMM tile stores ``zero_per_tile``
    (``store_zero_tiles``), so their stores drain while tensor cores work instead of forming a
    store-only tail wave. Without an offset the tail slot G zero-fills the rows past the last group and
    the zero-tile values are 0; without FILL_TAIL the tail slot is empty and those rows are left as they are.
    """
    if HAS_GROUP_OFFSET:
        offs, starts, ends = local_group_row_bounds(
            group_sizes_ptr, group_offset_ptr, G, G_TOTAL, M, BLOCK_G, BLOCK_G_TOTAL
        )
        first_row = pick(ends, offs, G)
        local_end = tl.maximum(tl.max(tl.where(offs < G, ends, 0), 0), first_row)
        starts, ends, m_tiles, tile_ends, total_tiles = row_tile_space(
            offs, starts, ends, G, local_end, n_tiles, BLOCK_M
        )
        head_tiles = tl.cdiv(first_row, BLOCK_M)
        zero_tiles = (head_tiles + tl.cdiv(M - local_end, BLOCK_M)) * n_tiles
        zero_per_tile = tl.cdiv(zero_tiles, tl.maximum(total_tiles, NUM_PROGRAMS))
    else:
        offs, starts, ends = group_row_bounds(group_sizes_ptr, G, M, BLOCK_G)
        fill_end = M
        if not FILL_TAIL:
            fill_end = tl.max(tl.where(offs < G, ends, 0), 0)
        starts, ends, m_tiles, tile_ends, total_tiles = row_tile_space(
            offs, starts, ends, G, fill_end, n_tiles, BLOCK_M
        )
        first_row = 0
        local_end = M
        head_tiles = 0
        zero_tiles = 0
        zero_per_tile = 0
    return (
        offs, starts, ends, m_tiles, tile_ends, total_tiles, first_row, local_end, head_tiles, zero_tiles,
        zero_per_tile,
    )  # fmt: skip


@triton.jit
def store_zero_tiles(
    out_ptr, z_begin, z_end, first_row, local_end, head_tiles, M, N, n_tiles, stride_om, stride_on,
    offs_m, offs_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Zero tiles [z_begin, z_end) of the unowned rows [0, first_row) and [local_end, M): row tile
    z // n_tiles (the head's row tiles first, then the tail's), column tile z % n_tiles."""
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    for z in range(z_begin, z_end):
        row_tile = z // n_tiles
        in_head = row_tile < head_tiles
        row0 = tl.where(in_head, row_tile * BLOCK_M, local_end + (row_tile - head_tiles) * BLOCK_M).to(
            tl.int64
        )
        row_end = tl.where(in_head, first_row, M)
        col0 = (z % n_tiles) * BLOCK_N
        mask = (offs_m < row_end - row0)[:, None] & (offs_n < N - col0)[None, :]
        base = out_ptr + row0 * stride_om + col0.to(tl.int64) * stride_on
        tl.store(base + (offs_m[:, None] * stride_om + offs_n[None, :] * stride_on), zero, mask=mask)
