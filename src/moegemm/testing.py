"""Accuracy helpers shared by the tests, the GPU check script and the benchmark's pre-timing check."""

from __future__ import annotations

import torch

# Relative Frobenius error vs an fp64 reference, by output dtype. The products are exact in fp32,
# so the error is dominated by rounding the output: bf16 keeps 8 mantissa bits (2^-9 ~ 2e-3 per
# element), fp16 keeps 11 (2^-12 ~ 2.4e-4), fp32 accumulation order adds ~1e-7 per step.
REL_TOL = {torch.bfloat16: 8e-3, torch.float16: 1.5e-3, torch.float32: 2e-5}


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (0 when both are all zero; inf on any NaN)."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, what: str = "") -> float:
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
