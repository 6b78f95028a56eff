"""Which rows each group owns: the one grouping rule of every kernel, reference and sharding rule.

Group g of an M-row operand owns rows [start_g, end_g), under the kernels' clamping rules::

    size_g  = clip(group_sizes[g], 0, M)
    end_g   = min(size_0 + ... + size_g, M)
    start_g = end_{g-1}   (start_0 = 0)

Rows at or past end_{G-1} belong to no group. Example, M=10, group_sizes=[3, 0, 4]: starts=[0, 3, 3],
ends=[3, 3, 7]; group 1 is empty (start = end = 3) and rows 7..9 are unowned. group_sizes=[8, -2, 5]:
sizes [8, 0, 5], starts=[0, 8, 8], ends=[8, 8, 10] (group 2 is cut at M).

No framework: :func:`group_layout` and :func:`local_groups` take the array namespace ``xp``
(numpy, or jax.numpy, which mirrors it; then the sizes stay on the device and everything runs under
jit), and :func:`group_bounds` is the plain-Python version for sizes already on the host.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple


class GroupLayout(NamedTuple):
    """The rows of G groups: group g owns rows [starts[g], ends[g]) (module docstring for the rule).

    starts, ends: int32 [G] arrays of the namespace that built them, with
    0 <= starts[g] <= ends[g] <= M and starts[g + 1] = ends[g]; ``sizes`` = ends - starts, the
    clamped sizes (0 for an empty group). M=10, group_sizes=[3, 0, 4] -> starts=[0, 3, 3],
    ends=[3, 3, 7], sizes=[3, 0, 4].
    """

    starts: Any
    ends: Any

    @property
    def sizes(self) -> Any:
        return self.ends - self.starts


def _saturating_cumsum(sizes, M: int, xp):
    """Inclusive prefix sums min(sizes[0] + ... + sizes[g], M) of int32 sizes in [0, M].

    A Hillis-Steele scan of the saturating add min(a + b, M), which is associative on [0, M]. It is
    written b + min(a, M - b) so that no intermediate exceeds M: a plain int32 cumsum wraps negative
    for M near 2^31.
    """
    ends, shift = sizes, 1
    while shift < sizes.shape[0]:
        before = xp.concatenate([xp.zeros(shift, sizes.dtype), ends[:-shift]])
        ends = ends + xp.minimum(before, M - ends)
        shift *= 2
    return ends


def group_layout(group_sizes, M: int, xp) -> GroupLayout:
    """The GroupLayout of integer group_sizes [G] over M rows (M < 2^31), in namespace xp."""
    sizes = xp.clip(xp.asarray(group_sizes).astype(xp.int32), 0, M)
    ends = _saturating_cumsum(sizes, M, xp)
    starts = xp.concatenate([xp.zeros(1, xp.int32), ends])[:-1]
    return GroupLayout(starts, ends)


def local_groups(group_sizes, group_offset, G_local: int, M: int, xp) -> tuple[Any, Any]:
    """Expert parallelism: (first_row, local_sizes) of the G_local groups starting at group_offset.

    group_sizes covers all G_total groups and the bounds follow the rule over all of them, so the
    local rows [first_row, first_row + sum(local_sizes)) lie inside [0, M). An offset out of
    range is taken as jax.lax.dynamic_slice takes a start index: a negative one counts from the
    end, then it is clamped to [0, G_total - G_local]. Example, M=10, group_sizes=[3, 2, 4, 1],
    group_offset=1, G_local=2 -> first_row=3, local_sizes=[2, 4] (rows 3..8).
    """
    layout = group_layout(group_sizes, M, xp)
    G_total = layout.starts.shape[0]
    offset = xp.asarray(group_offset, xp.int32).reshape(())
    offset = xp.clip(xp.where(offset < 0, offset + G_total, offset), 0, G_total - G_local)
    local = offset + xp.arange(G_local, dtype=xp.int32)
    starts, ends = xp.take(layout.starts, local), xp.take(layout.ends, local)
    first_row = starts[0] if G_local else xp.int32(0)
    return first_row, ends - starts


def group_bounds(group_sizes: Iterable[int], M: int) -> list[tuple[int, int]]:
    """[(start_g, end_g)] of host-side sizes (plain Python ints, any M). M=10, [3, 0, 4] -> [(0, 3), (3, 3), (3, 7)]."""
    bounds, end = [], 0
    for size in group_sizes:
        size = min(max(int(size), 0), M)
        bounds.append((min(end, M), min(end + size, M)))
        end += size
    return bounds
