"""One registry of MoE GEMM shapes and group-size generators, shared by tests and benchmarks.

A case is one expert GEMM of a real model: G local experts, M routed tokens, K input features,
N output features. Weights are [G, N, K] (nn.Linear layout): fwd out = x @ w[g]^T, dgrad
dx = dy @ w[g], wgrad dw[g] = dy_g^T @ x_g. Cases tagged "ci" are small enough for the interpreter.
``EDGE``, ``empty_patterns`` and ``INVALID_SIZES`` are the tests' named MoE edge cases.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    G: int
    M: int
    K: int
    N: int
    tags: tuple[str, ...] = ()

    @property
    def flops(self) -> int:
        return 2 * self.M * self.K * self.N


SUITE: tuple[Case, ...] = (
    Case("dsv3-ep8-fc1", 32, 32768, 7168, 4096, ("suite",)),
    Case("dsv3-ep8-fc2", 32, 32768, 2048, 7168, ("suite",)),
    Case("qwen3-30b-fc1", 128, 16384, 2048, 1536, ("suite",)),
    Case("qwen3-30b-fc2", 128, 16384, 768, 2048, ("suite",)),
    Case("gptoss-120b-fc1", 128, 16384, 2880, 5760, ("suite",)),
    Case("mixtral-fc1", 8, 16384, 4096, 28672, ("suite",)),
    Case("finegrain-e64-fc1", 8, 8192, 2048, 1024, ("suite",)),
    Case("finegrain-e256-fc2", 32, 8192, 512, 2048, ("suite",)),
)

# Held out from tuning and from the cost model's calibration (moegemm/cost_model.py): real MoE layers
# the suite does not have, chosen to differ from it in G (4-256 local experts), K/N aspect (0.3-2.7,
# long-K fc2 up to 16384) and EP degree (1, 4, 8). Rows M = tokens per rank x top-k. fc1 is the fused
# gate+up projection (N = 2 x the expert's intermediate size), fc2 the down projection.
HELDOUT: tuple[Case, ...] = (
    # DeepSeek-V2-Lite: 64 experts, hidden 2048, intermediate 1408, top-6, 4096 tokens, no EP.
    Case("dsv2lite-fc1", 64, 24576, 2048, 2816, ("heldout",)),
    Case("dsv2lite-fc2", 64, 24576, 1408, 2048, ("heldout",)),
    # Qwen3-235B-A22B at EP 8: 128 / 8 = 16 local experts, hidden 4096, intermediate 1536, top-8.
    Case("qwen3-235b-ep8-fc1", 16, 32768, 4096, 3072, ("heldout",)),
    # Kimi-K2 at EP 8: 384 / 8 = 48 local experts, hidden 7168, intermediate 2048 (the 48-expert,
    # K=7168 shape an independent run measured at 0.88x torch on wgrad).
    Case("kimi-k2-ep8-fc1", 48, 32768, 7168, 4096, ("heldout",)),
    # Mixtral-8x22B: 8 experts, hidden 6144, intermediate 16384, top-2: the longest K.
    Case("mixtral-8x22b-fc2", 8, 16384, 16384, 6144, ("heldout",)),
    # gpt-oss-20b: 32 experts, hidden 2880, intermediate 2880 (square), top-4.
    Case("gptoss-20b-fc2", 32, 16384, 2880, 2880, ("heldout",)),
    # OLMoE-1B-7B: 64 experts, hidden 2048, intermediate 1024, top-8, 4096 tokens.
    Case("olmoe-fc1", 64, 32768, 2048, 2048, ("heldout",)),
    # GLM-4.5-Air at EP 4: 128 / 4 = 32 local experts, hidden 4096, intermediate 1408, top-8.
    Case("glm45air-ep4-fc2", 32, 16384, 1408, 4096, ("heldout",)),
    # Phi-3.5-MoE: 16 experts, hidden 4096, intermediate 6400, top-2.
    Case("phi35moe-fc2", 16, 16384, 6400, 4096, ("heldout",)),
    # DBRX at EP 4: 16 / 4 = 4 local experts, hidden 6144, intermediate 10752, top-4: few, wide experts.
    Case("dbrx-ep4-fc1", 4, 16384, 6144, 21504, ("heldout",)),
    # Qwen3-Next-80B-A3B at EP 2: 512 / 2 = 256 local experts, hidden 2048, intermediate 512, top-10:
    # 128 rows per expert, the many-small-experts end.
    Case("qwen3next-ep2-fc2", 256, 32768, 512, 2048, ("heldout",)),
)

# Miniatures with the same G and aspect as the suite, plus odd sizes; fast under the interpreter.
TINY: tuple[Case, ...] = (
    Case("tiny-dsv3-fc1", 8, 256, 112, 64, ("ci",)),
    Case("tiny-qwen3-fc2", 16, 128, 48, 64, ("ci",)),
    Case("tiny-odd", 5, 127, 33, 65, ("ci",)),
    Case("tiny-727-577-859", 3, 73, 58, 86, ("ci",)),
)

ALL: tuple[Case, ...] = SUITE + HELDOUT + TINY


def get(name: str) -> Case:
    for case in ALL:
        if case.name == name:
            return case
    raise KeyError(f"unknown case {name!r}; known: {[c.name for c in ALL]}")


def select(names: list[str]) -> list[Case]:
    """The cases ``names`` lists, in order: a whole set ("suite", "heldout", "tiny", "all") or one case by
    name. Raises KeyError naming an unknown case."""
    sets = {"suite": SUITE, "heldout": HELDOUT, "tiny": TINY, "all": ALL}
    return [case for name in names for case in (sets[name] if name in sets else (get(name),))]


def case_set(name: str) -> str:
    """The registry set a case name belongs to: "suite", "heldout", "tiny", or "custom" (TE-style or
    jagged cases built on the command line)."""
    for label, cases in (("suite", SUITE), ("heldout", HELDOUT), ("tiny", TINY)):
        if any(c.name == name for c in cases):
            return label
    return "custom"


def te_case(
    num_experts: int, ep_size: int, hidden_dim: int, expert_dim: int, tokens: int, fc: int = 1
) -> Case:
    """TransformerEngine-style parameterisation: local experts = num_experts / ep_size.

    fc1 maps hidden_dim -> expert_dim (K=hidden, N=expert), fc2 maps back (K=expert, N=hidden).
    """
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    K, N = (hidden_dim, expert_dim) if fc == 1 else (expert_dim, hidden_dim)
    return Case(
        f"te-e{num_experts}-ep{ep_size}-h{hidden_dim}-f{expert_dim}-fc{fc}",
        num_experts // ep_size,
        tokens,
        K,
        N,
    )


@dataclasses.dataclass(frozen=True)
class EdgeCase:
    """A named MoE edge case for the tests: M rows, K, N, and explicit group sizes (G = len(sizes))."""

    name: str
    M: int
    K: int
    N: int
    sizes: tuple[int, ...]


def _edge_cases() -> tuple[EdgeCase, ...]:
    cases = [
        ("dirichlet-skew-with-empty", 96, 40, 48, group_sizes(96, 6, seed=3, empty=2)),
        ("one-hot-expert", 70, 33, 20, group_sizes(70, 4, split="one-hot")),
        ("hot-last-expert", 50, 16, 24, [0, 0, 0, 50]),
        ("sum-below-M", 90, 24, 40, [10, 0, 25, 5]),
        ("all-empty", 20, 16, 16, [0, 0, 0]),
        ("single-group", 45, 31, 17, [45]),
        ("all-ones-dims", 1, 1, 1, [1]),
        ("odd-7-127-129", 7, 127, 129, [3, 0, 4]),
        ("odd-129-7-33", 129, 7, 33, [64, 1, 64]),
        ("tiny-727-577-859-scaled", 73, 58, 86, [17, 0, 56]),
        ("many-small-groups", 64, 16, 16, group_sizes(64, 40, seed=5, empty=5)),
        ("balanced", 96, 32, 32, group_sizes(96, 6, split="balanced")),
        ("zero-rows", 0, 16, 16, [0, 0]),
    ]
    return tuple(EdgeCase(name, M, K, N, tuple(sizes)) for name, M, K, N, sizes in cases)


def empty_patterns(G: int = 4, rows: int = 9) -> list[tuple[str, list[int]]]:
    """Every empty/non-empty pattern over G groups (2^G cases), each live group owning ``rows`` rows;
    named by pattern, e.g. "x0x0"."""
    return [
        ("".join("x" if live else "0" for live in mask), [rows if live else 0 for live in mask])
        for mask in itertools.product((0, 1), repeat=G)
    ]


# Device-side sizes that are wrong: (name, M, sizes). The kernels must clamp them as the rule says.
INVALID_SIZES: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("negative-size", 40, (10, -5, 20)),
    ("sum-above-M", 40, (30, 0, 25)),
    ("huge-size", 40, (2**31 - 1, 3)),
    ("all-negative", 40, (-1, -(2**31))),
)


def group_sizes(
    M: int, G: int, *, split: str = "dirichlet", seed: int = 0, empty: int | None = None
) -> list[int]:
    """Token counts per expert summing to M.

    split="dirichlet": Dirichlet(1)-skewed shares with ``empty`` experts (default G // 16) forced to 0,
    the realistic routing skew; "balanced": M // G each, remainder spread over the first experts;
    "one-hot": every token on expert 0.
    """
    rng = np.random.default_rng(seed)
    if split == "balanced":
        sizes = np.full(G, M // G, dtype=np.int64)
        sizes[: M % G] += 1
    elif split == "one-hot":
        sizes = np.zeros(G, dtype=np.int64)
        sizes[0] = M
    elif split == "dirichlet":
        empty = G // 16 if empty is None else empty
        shares = rng.dirichlet(np.ones(G))
        shares[rng.choice(G, size=empty, replace=False)] = 0.0
        shares /= shares.sum()
        sizes = np.floor(shares * M).astype(np.int64)
        live = np.flatnonzero(shares)
        # Hand out the rounding remainder one token at a time to random live experts.
        np.add.at(sizes, live[rng.integers(len(live), size=M - int(sizes.sum()))], 1)
    else:
        raise ValueError(f"split must be 'dirichlet', 'balanced' or 'one-hot', got {split!r}")
    assert sizes.sum() == M and (sizes >= 0).all()
    return sizes.tolist()


def parse_jagged(spec: str) -> list[int]:
    """'--jagged-splits 100,0,28' -> [100, 0, 28]."""
    return [int(v) for v in spec.split(",") if v.strip()]


# The named edge cases of the kernel tests (explicit group sizes; see EdgeCase).
EDGE: tuple[EdgeCase, ...] = _edge_cases()
