"""The test oracle: plain numpy fp64 loops over host-side group sizes, independent of the library.

It shares no code with the kernels, the launchers, the reference twins or ``moegemm._src.layout``: a
grouping bug in any of them cannot hide by being repeated here. Inputs are anything ``np.asarray``
takes (a torch CPU tensor in fp32/fp64, a numpy or JAX array); bf16 inputs should be upcast first
(``tensor.double()``), since numpy has no bfloat16.

The grouping rule, spelled out once more on purpose: sizes clamp to [0, M], each group starts where
the previous one ended, a group is cut at row M, and rows past the last group are unowned (0).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def rows(group_sizes: Iterable[int], M: int) -> list[range]:
    """rows(g) for each group: sizes=[3, 0, 4], M=10 -> [range(0, 3), range(3, 3), range(3, 7)]."""
    out, start = [], 0
    for size in group_sizes:
        end = min(start + min(max(int(size), 0), M), M)
        out.append(range(start, end))
        start = end
    return out


def _f64(t) -> np.ndarray:
    return np.asarray(t, dtype=np.float64)


def m_grouped_mm(x, w, group_sizes, bias=None) -> np.ndarray:
    """x [M, K], w [G, K, N], bias [G, N] or None -> [M, N]: for g: out[rows(g)] = x[rows(g)] @ w[g] (+ bias[g])."""
    x, w = _f64(x), _f64(w)
    out = np.zeros((x.shape[0], w.shape[2]))
    for g, r in enumerate(rows(group_sizes, x.shape[0])):
        out[r.start : r.stop] = x[r.start : r.stop] @ w[g] + (0.0 if bias is None else _f64(bias[g]))
    return out


def k_grouped_mm(a, b, group_sizes, c=None) -> np.ndarray:
    """a [M, K], b [M, N] -> [G, K, N]: for g: out[g] = a[rows(g)]^T @ b[rows(g)] (+ c[g], live groups only)."""
    a, b = _f64(a), _f64(b)
    groups = rows(group_sizes, a.shape[0])
    out = np.zeros((len(groups), a.shape[1], b.shape[1])) if c is None else _f64(c).copy()
    for g, r in enumerate(groups):
        if len(r):
            out[g] += a[r.start : r.stop].T @ b[r.start : r.stop]
    return out


def column_sums(a, group_sizes) -> np.ndarray:
    """a [M, K] -> [G, K]: for g: sum(a[rows(g)], 0)."""
    a = _f64(a)
    return np.stack([a[r.start : r.stop].sum(0) for r in rows(group_sizes, a.shape[0])])
