"""Plain PyTorch twins of the ops: the test oracle and the CPU fallback (``backend="reference"``).

They implement the kernels' exact semantics, clamping included: sizes are clamped to [0, M],
offsets are prefix sums clamped at M, and rows past sum(group_sizes) belong to no group.
Quantized operands (``Fp8Tensor``) are dequantized first: the twin of an FP8 GEMM is the GEMM of
the dequantized operands. They sync (group_sizes.tolist()), which is fine for an oracle and for CPU
tensors.
"""

from __future__ import annotations

import torch

from moegemm._src.torch import reference as _ref
from moegemm._src.torch.fp8_tensor import Fp8Tensor, check_pair

__all__ = ["k_grouped_mm_reference", "m_grouped_mm_reference", "moe_experts_reference"]


def m_grouped_mm_reference(
    x: torch.Tensor | Fp8Tensor,
    w: torch.Tensor | Fp8Tensor,
    group_sizes: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K], w [G, K, N], bias [G, N] or None -> out [M, N];
    for g: out[rows(g)] = x[rows(g)] @ w[g] (+ bias[g]); unowned rows 0 (no bias).

    Quantized x and w (both Fp8Tensor): x [M, K] and a weight [G, N, K] are dequantized and
    out[rows(g)] = x[rows(g)] @ w[g]^T (+ bias[g]), computed in fp32 unless ``compute_dtype`` says
    otherwise; out_dtype defaults to x's dtype, bfloat16 for quantized operands (as m_grouped_mm)."""
    if isinstance(x, Fp8Tensor) or isinstance(w, Fp8Tensor):
        check_pair("m_grouped_mm_reference", ("x", x), ("w", w))
        compute_dtype = compute_dtype or torch.float32
        x, w = x.dequantize(compute_dtype), w.dequantize(compute_dtype).mT
        out_dtype = out_dtype or torch.bfloat16
    compute_dtype = compute_dtype or _ref.exact_dtype(x.dtype)
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=compute_dtype, device=x.device)
    for g, (start, end) in enumerate(_ref.group_bounds(group_sizes, x.shape[0])):
        if end > start:
            out[start:end] = x[start:end].to(compute_dtype) @ w[g].to(compute_dtype)
            if bias is not None:
                out[start:end] += bias[g].to(compute_dtype)
    return out.to(out_dtype or x.dtype)


def k_grouped_mm_reference(
    a: torch.Tensor | Fp8Tensor,
    b: torch.Tensor | Fp8Tensor,
    group_sizes: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """a [M, K], b [M, N] -> out [G, K, N]; for g: out[g] (+)= a[rows(g)]^T @ b[rows(g)].

    Quantized a and b (both Fp8Tensor, quantized with ``transpose=True``): their transposed copies,
    which the wgrad kernel reads, are dequantized (fp32 unless ``compute_dtype`` says otherwise).
    Accumulating leaves an empty group's out[g] untouched, as the kernel does (0 + -0.0 would be +0.0)."""
    if isinstance(a, Fp8Tensor) or isinstance(b, Fp8Tensor):
        check_pair("k_grouped_mm_reference", ("a", a), ("b", b))
        compute_dtype = compute_dtype or torch.float32
        a, b = a.dequantize_t(compute_dtype), b.dequantize_t(compute_dtype)
    compute_dtype = compute_dtype or _ref.exact_dtype(a.dtype)
    G = group_sizes.shape[0]
    bounds = _ref.group_bounds(group_sizes, a.shape[0])
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


def moe_experts_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: str = "swiglu",
    compute_dtype: torch.dtype = torch.float32,
    expert_base: int | None = None,
) -> torch.Tensor:
    """The expert block, per expert in plain PyTorch (differentiable by autograd):
    ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u)``, ``(g, u) = split(w13[e] @ x[t])``,
    ``e = topk_ids[t, j]``.

    x [T, d]; topk_ids [T, k]; topk_weights [T, k]; w13 [E, 2n, d] (rows [0, n) gate, [n, 2n) up); w2 [E, d, n]
    -> out [T, d] in x's dtype. The kernels' clamps, defined here too: an id outside [0, E) is clamped into it,
    a non-finite weight counts as 0. Computed in ``compute_dtype`` without the kernels' bf16 roundings of the
    fc1 output and the activation. Syncs (per-expert row lists).

    ``expert_base`` (expert parallelism, docs/design.md, 'Expert parallelism'): w13 and w2 hold the E experts
    [expert_base, expert_base + E) of a larger set; topk_ids are global ids, and a choice of any other expert is
    absent: it adds nothing, and its weight's gradient is 0."""
    if activation != "swiglu":
        raise ValueError(f"moe_experts_reference: activation {activation!r}; supported: 'swiglu'")
    T, d = x.shape
    E, two_n, _ = w13.shape
    n = two_n // 2
    k = topk_ids.shape[1]
    weights = topk_weights.reshape(-1).to(compute_dtype)
    weights = torch.where(torch.isfinite(weights), weights, torch.zeros_like(weights))
    if expert_base is None:
        ids = topk_ids.reshape(-1).long().clamp(0, max(E - 1, 0))
    else:
        ids = topk_ids.reshape(-1).long() - expert_base
        absent = (ids < 0) | (ids >= E)
        ids = ids.masked_fill(absent, -1)
        weights = weights.masked_fill(absent, 0.0)
    rows_x = x.to(compute_dtype).repeat_interleave(k, 0)  # row t * k + j is token t's j-th choice
    out_rows = torch.zeros(T * k, d, dtype=compute_dtype, device=x.device)
    for e in range(E):
        rows = (ids == e).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        z = rows_x[rows] @ w13[e].to(compute_dtype).T
        h = torch.nn.functional.silu(z[:, :n]) * z[:, n:]
        y = h @ w2[e].to(compute_dtype).T
        out_rows = out_rows.index_add(0, rows, y * weights[rows, None])
    # Sums over empty slices (exactly 0) keep out differentiable in every input when no choice reaches these
    # experts (an expert-parallel rank with no local choice), as the kernels' autograd is.
    anchor = sum(t.reshape(-1)[:0].sum() for t in (x, topk_weights, w13, w2))
    return (out_rows.view(T, k, d).sum(1) + anchor).to(x.dtype)
