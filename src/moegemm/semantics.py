"""The grouping rule that every kernel and reference implements, in plain Python (no framework).

Group g owns rows [start_g, end_g): sizes are clamped to [0, M], offsets are the exclusive prefix sums
clamped at M, and rows at or past sum(group_sizes) belong to no group. Example, M=10:
group_sizes=[3, 0, 4] -> [(0, 3), (3, 3), (3, 7)], rows 7..9 unowned; [8, -2, 5] -> [(0, 8), (8, 8), (8, 10)].
"""

from __future__ import annotations

from collections.abc import Iterable


def group_bounds(group_sizes: Iterable[int], M: int) -> list[tuple[int, int]]:
    """[(start_g, end_g)] for host-side sizes under the kernels' clamping rules."""
    bounds, end = [], 0
    for size in group_sizes:
        size = min(max(int(size), 0), M)
        bounds.append((min(end, M), min(end + size, M)))
        end += size
    return bounds
