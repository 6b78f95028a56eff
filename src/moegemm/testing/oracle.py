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


def moe_experts(x, topk_ids, topk_weights, w13, w2) -> np.ndarray:
    """The expert block, token by token: x [T, d], topk_ids [T, k], topk_weights [T, k], w13 [E, 2n, d], w2
    [E, d, n] -> [T, d]; out[t] = sum_j weight[t, j] * w2[e] @ (silu(g) * u), (g, u) = split(w13[e] @ x[t]),
    e = topk_ids[t, j] clamped into [0, E), a non-finite weight counted as 0."""
    x, w13, w2 = _f64(x), _f64(w13), _f64(w2)
    ids = np.asarray(topk_ids)
    weights = _f64(topk_weights)
    E, two_n, _ = w13.shape
    n = two_n // 2
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = min(max(int(ids[t, j]), 0), E - 1)
            weight = weights[t, j] if np.isfinite(weights[t, j]) else 0.0
            z = w13[e] @ x[t]
            g, u = z[:n], z[n:]
            out[t] += weight * (w2[e] @ (g / (1.0 + np.exp(-g)) * u))
    return out
