"""Named MoE edge cases for the grouped-GEMM tests: (name, M, K, N, group_sizes)."""

from __future__ import annotations

import itertools

from moegemm import shapes


def edge_cases() -> list[tuple[str, int, int, int, list[int]]]:
    return [
        ("dirichlet-skew-with-empty", 96, 40, 48, shapes.group_sizes(96, 6, seed=3, empty=2)),
        ("one-hot-expert", 70, 33, 20, shapes.group_sizes(70, 4, split="one-hot")),
        ("hot-last-expert", 50, 16, 24, [0, 0, 0, 50]),
        ("sum-below-M", 90, 24, 40, [10, 0, 25, 5]),
        ("all-empty", 20, 16, 16, [0, 0, 0]),
        ("single-group", 45, 31, 17, [45]),
        ("all-ones-dims", 1, 1, 1, [1]),
        ("odd-7-127-129", 7, 127, 129, [3, 0, 4]),
        ("odd-129-7-33", 129, 7, 33, [64, 1, 64]),
        ("tiny-727-577-859-scaled", 73, 58, 86, [17, 0, 56]),
        ("many-small-groups", 64, 16, 16, shapes.group_sizes(64, 40, seed=5, empty=5)),
        ("balanced", 96, 32, 32, shapes.group_sizes(96, 6, split="balanced")),
        ("zero-rows", 0, 16, 16, [0, 0]),
    ]


def empty_patterns(G: int = 4, rows: int = 9) -> list[tuple[str, list[int]]]:
    """Every empty/non-empty pattern over G groups (2^G cases), each live group owning `rows` rows."""
    return [
        ("".join("x" if live else "0" for live in mask), [rows if live else 0 for live in mask])
        for mask in itertools.product((0, 1), repeat=G)
    ]


def invalid_sizes() -> list[tuple[str, int, list[int]]]:
    """Device-side sizes that are wrong; the kernels must clamp them exactly as the reference does."""
    return [
        ("negative-size", 40, [10, -5, 20]),
        ("sum-above-M", 40, [30, 0, 25]),
        ("huge-size", 40, [2**31 - 1, 3]),
        ("all-negative", 40, [-1, -2**31]),
    ]
