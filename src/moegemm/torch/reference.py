"""Plain PyTorch twins of the kernels: the test oracle and the CPU fallback.

They implement the kernels' exact semantics, clamping included: sizes are clamped to [0, M],
offsets are prefix sums clamped at M, and rows past sum(group_sizes) belong to no group.
They sync (group_sizes.tolist()), which is fine for an oracle and for CPU tensors.
"""

from __future__ import annotations

import torch

from moegemm._src import layout


def group_bounds(group_sizes: torch.Tensor, M: int) -> list[tuple[int, int]]:
    """[(start_g, end_g)] of device or host sizes (one sync); see moegemm._src.layout for the rule."""
    return layout.group_bounds(group_sizes.tolist(), M)


def _exact_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 products of 16-bit inputs are exact (even as TF32 on a GPU); fp32 inputs need fp64 for that."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def m_grouped_mm_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    group_sizes: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K], w [G, K, N], bias [G, N] or None -> out [M, N];
    for g: out[rows(g)] = x[rows(g)] @ w[g] (+ bias[g]); unowned rows 0 (no bias)."""
    compute_dtype = compute_dtype or _exact_dtype(x.dtype)
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=compute_dtype, device=x.device)
    for g, (start, end) in enumerate(group_bounds(group_sizes, x.shape[0])):
        if end > start:
            out[start:end] = x[start:end].to(compute_dtype) @ w[g].to(compute_dtype)
            if bias is not None:
                out[start:end] += bias[g].to(compute_dtype)
    return out.to(out_dtype or x.dtype)


def grouped_column_sums(
    a: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """a [M, K] -> [G, K]; for g: out[g] = sum(a[rows(g)], 0) (the bias gradient when a is dy)."""
    compute_dtype = compute_dtype or _exact_dtype(a.dtype)
    out = torch.zeros(group_sizes.shape[0], a.shape[1], dtype=compute_dtype, device=a.device)
    for g, (start, end) in enumerate(group_bounds(group_sizes, a.shape[0])):
        out[g] = a[start:end].to(compute_dtype).sum(0)
    return out.to(out_dtype)


def k_grouped_mm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """a [M, K], b [M, N] -> out [G, K, N]; for g: out[g] (+)= a[rows(g)]^T @ b[rows(g)].

    Accumulating leaves an empty group's out[g] untouched, as the kernel does (0 + -0.0 would be +0.0)."""
    compute_dtype = compute_dtype or _exact_dtype(a.dtype)
    G = group_sizes.shape[0]
    bounds = group_bounds(group_sizes, a.shape[0])
    if accumulate:
        for g, (start, end) in enumerate(bounds):
            if end > start:
                product = a[start:end].to(compute_dtype).T @ b[start:end].to(compute_dtype)
                out[g] = out[g].to(compute_dtype) + product
        return out
    result = torch.zeros(G, a.shape[1], b.shape[1], dtype=compute_dtype, device=a.device)
    for g, (start, end) in enumerate(bounds):
        result[g] = a[start:end].to(compute_dtype).T @ b[start:end].to(compute_dtype)
    if out is None:
        return result.to(out_dtype)
    out.copy_(result)
    return out
