"""One registry of MoE GEMM shapes and group-size generators, shared by tests and benchmarks.

A case is one expert GEMM of a real model: G local experts, M routed tokens, K input features,
N output features. Weights are [G, N, K] (nn.Linear layout): fwd out = x @ w[g]^T, dgrad
dx = dy @ w[g], wgrad dw[g] = dy_g^T @ x_g. Cases tagged "ci" are small enough for the interpreter.
"""

from __future__ import annotations

import dataclasses

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

# Miniatures with the same G and aspect as the suite, plus odd sizes; fast under the interpreter.
TINY: tuple[Case, ...] = (
    Case("tiny-dsv3-fc1", 8, 256, 112, 64, ("ci",)),
    Case("tiny-qwen3-fc2", 16, 128, 48, 64, ("ci",)),
    Case("tiny-odd", 5, 127, 33, 65, ("ci",)),
    Case("tiny-727-577-859", 3, 73, 58, 86, ("ci",)),
)

ALL: tuple[Case, ...] = SUITE + TINY


def get(name: str) -> Case:
    for case in ALL:
        if case.name == name:
            return case
    raise KeyError(f"unknown case {name!r}; known: {[c.name for c in ALL]}")


def te_case(num_experts: int, ep_size: int, hidden_dim: int, expert_dim: int, tokens: int, fc: int = 1) -> Case:
    """TransformerEngine-style parameterisation: local experts = num_experts / ep_size.

    fc1 maps hidden_dim -> expert_dim (K=hidden, N=expert), fc2 maps back (K=expert, N=hidden).
    """
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    K, N = (hidden_dim, expert_dim) if fc == 1 else (expert_dim, hidden_dim)
    return Case(f"te-e{num_experts}-ep{ep_size}-h{hidden_dim}-f{expert_dim}-fc{fc}", num_experts // ep_size,
                tokens, K, N)  # fmt: skip


def group_sizes(M: int, G: int, *, split: str = "dirichlet", seed: int = 0, empty: int | None = None) -> list[int]:
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
