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


@triton.jit
def group_row_bounds(group_sizes_ptr, G, M, BLOCK_G: tl.constexpr):
    """Returns (offs, starts, ends) int64 vectors of length BLOCK_G (slots >= G are empty).

    Example, M=10, group_sizes=[3, 0, 4]: starts=[0, 3, 3], ends=[3, 3, 7]; rows 7..9 are unowned.
    With group_sizes=[8, -2, 5]: sizes clamp to [8, 0, 5] and ends to [8, 8, 10] (sum 13 > M).
    """
    offs = tl.arange(0, BLOCK_G)
    sizes = tl.load(group_sizes_ptr + offs, mask=offs < G, other=0).to(tl.int64)
    sizes = tl.minimum(tl.maximum(sizes, 0), M)
    ends_unclamped = tl.cumsum(sizes, 0)
    starts = tl.minimum(ends_unclamped - sizes, M)
    ends = tl.minimum(ends_unclamped, M)
    return offs, starts, ends


@triton.jit
def pick(values, offs, index):
    """values[index] for a register vector (a masked reduction; Triton has no dynamic register indexing)."""
    return tl.sum(tl.where(offs == index, values, 0), 0)


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
