"""Accuracy helpers (torch) shared by the tests and the benchmark's pre-timing check."""

from __future__ import annotations

import numpy as np
import torch

# Relative Frobenius error vs an fp64 reference, by output dtype. The products are exact in fp32,
# so the error is dominated by rounding the output: bf16 keeps 8 mantissa bits (2^-9 ~ 2e-3 per
# element), fp16 keeps 11 (2^-12 ~ 2.4e-4), fp32 accumulation order adds ~1e-7 per step.
REL_TOL = {torch.bfloat16: 8e-3, torch.float16: 1.5e-3, torch.float32: 2e-5}


def relerr(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp64 (0 when both are all zero; inf on any NaN). out, ref: torch tensors or
    array-likes (numpy, JAX arrays), so the JAX tests and benchmarks measure error the same way."""
    out, ref = (
        t.double() if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t, np.float64))
        for t in (out, ref)
    )
    if torch.isnan(out).any():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_rel_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, what: str = ""
) -> float:
    """Asserts relerr(out, ref) <= REL_TOL[dtype or out.dtype]; the message names the worst element."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    tol = REL_TOL[dtype or out.dtype]
    err = relerr(out, ref)
    if not err <= tol:
        diff = (out.double() - ref.double()).abs().nan_to_num(float("inf"))
        idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        nans = int(torch.isnan(out).sum())
        raise AssertionError(
            f"{what}: relerr {err:.3e} > tol {tol:.1e}; worst at {idx}: got {out[idx].item()}, "
            f"want {ref[idx].item()}; {nans} NaN elements (unwritten outputs are NaN-poisoned)"
        )
    return err


def linear_loop_reference(weight, bias, x, sizes, dy):
    """fp64 oracle on the CPU for GroupedLinear: one nn.Linear per expert over its rows, zeros past sum(sizes).

    weight [G, N, K], bias [G, N] or None, x [M, K], dy [M, N], sizes a list of ints summing to <= M.
    Returns y [M, N], dx [M, K], dW [G, N, K] and db [G, N] (None without bias), all fp64.
    """
    G, N, K = weight.shape
    experts = []
    for g in range(G):
        lin = torch.nn.Linear(K, N, bias=bias is not None, dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(weight[g].detach().cpu())
            if bias is not None:
                lin.bias.copy_(bias[g].detach().cpu())
        experts.append(lin)
    xr = x.detach().cpu().double().requires_grad_()
    outs, start = [], 0
    for lin, size in zip(experts, sizes):
        outs.append(lin(xr[start : start + size]))
        start += size
    outs.append(xr.new_zeros(xr.shape[0] - start, N))
    y = torch.cat(outs)
    y.backward(dy.detach().cpu().double())
    db = torch.stack([lin.bias.grad for lin in experts]) if bias is not None else None
    return y.detach(), xr.grad, torch.stack([lin.weight.grad for lin in experts]), db
