"""The public PyTorch ops: argument checks, group_sizes placement and backend dispatch.

Each op takes high-precision tensors or quantized ones (``Fp8Tensor`` from ``quantize_fp8``, both
operands quantized with one recipe); the quantized call runs the FP8 kernels. Backends: ``"triton"``
(the kernels: compiled for CUDA tensors, under the interpreter for CPU tensors when
``TRITON_INTERPRET=1`` was set before triton was imported), ``"reference"`` (the plain PyTorch twin in
``moegemm.torch.reference``) and ``"auto"`` (triton where it can run, else reference). An explicit
choice that cannot be served raises.

A training step in FP8 with y = x @ w[g]^T per group (w [G, N, K], the nn.Linear layout)::

    x_q = quantize_fp8(x, "blockwise", group_sizes=gs, transpose=True)    # data for fprop, data_t for wgrad
    w_q = quantize_fp8(w, "blockwise", transpose=True)                    # data_t for dgrad
    y = m_grouped_mm(x_q, w_q, gs)                                         # fprop
    dy_q = quantize_fp8(dy, "blockwise", group_sizes=gs, transpose=True)
    dx = m_grouped_mm(dy_q, w_q.t(), gs)                                   # dgrad: dy @ w[g]
    dw = k_grouped_mm(dy_q, x_q, gs)                                       # wgrad: dy_g^T x_g, [G, N, K]

``GroupedLinear(fp8_recipe=...)`` runs exactly this with autograd.
"""

from __future__ import annotations

import torch

from moegemm._src import fp8
from moegemm._src.torch import ops as _ops
from moegemm._src.torch.args import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    Backend,
    GroupSizes,
    as_group_sizes,
    check_float,
    check_group_sizes_values,
    check_out_buffer,
    check_same,
    checks_enabled,
    resolve_backend,
)
from moegemm._src.torch.fp8_tensor import Fp8Tensor, check_pair, from_storage

__all__ = ["k_grouped_mm", "m_grouped_mm", "quantize_fp8"]


def m_grouped_mm(
    x: torch.Tensor | Fp8Tensor,
    w: torch.Tensor | Fp8Tensor,
    group_sizes: GroupSizes,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    fast_accum: bool = False,
    check: bool | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """m-grouped GEMM (forward and dgrad): ``for g: out[rows(g)] = x[rows(g)] @ w[g] (+ bias[g])``.

    x [M, K] and w [G, K, N] in bf16/fp16/fp32 (one dtype), any strides: an nn.Linear-layout weight
    [G, N, K] is passed as ``w.mT``. group_sizes [G] int32/int64 (device tensor, CPU tensor or list);
    rows(g) = [offset_g, offset_g + size_g), offset = exclusive prefix sum. bias [G, N] in x's dtype,
    added to the fp32 accumulator before the one rounding. Returns out [M, N] in x's dtype, fp32
    accumulation; rows at or past sum(group_sizes) are 0 (no bias). Differentiable in x, w and bias.
    ``check=True`` (or MOEGEMM_CHECK=1) syncs to validate sizes >= 0 and sum <= M; without it, bad
    device-side sizes are clamped (negative -> 0, offsets -> M), never read or written out of bounds.

    Quantized operands: x an Fp8Tensor of activations [M, K] and w one of a weight [G, N, K] (quantized
    along K, the nn.Linear layout, so the product is ``x[rows(g)] @ w[g]^T``; ``w_q.t()`` for dgrad),
    one recipe. out in ``out_dtype`` (bf16 by default; fp16, fp32), fp32 accumulation; differentiable
    in bias only. ``fast_accum`` lets the tensor cores accumulate all of K (faster, less accurate, as
    torch's use_fast_accum); by default partial sums reach fp32 every 128 of K. Tensorwise x with
    per-group scales must have been quantized with G groups.
    """
    if x.dtype not in FLOAT_DTYPES or w.dtype not in FLOAT_DTYPES:  # quantized operands, or a bad dtype
        return _m_grouped_mm_fp8(x, w, group_sizes, bias, out_dtype, fast_accum, check, backend)
    check_same("x and w", x, w)
    if fast_accum or (out_dtype is not None and out_dtype != x.dtype):
        raise ValueError(
            f"m_grouped_mm: fast_accum and out_dtype (got {fast_accum}, {out_dtype}) are options of quantized "
            f"operands; high-precision x and w give out in their dtype ({x.dtype})"
        )
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"m_grouped_mm expects x [M, K] and w [G, K, N] with matching K; got x {tuple(x.shape)}, "
            f"w {tuple(w.shape)} (pass an nn.Linear-layout weight [G, N, K] as w.mT)"
        )
    if bias is not None:
        check_same("x, w and bias", x, w, bias)
        if tuple(bias.shape) != (w.shape[0], w.shape[2]):
            raise ValueError(
                f"bias must be [G, N] = {(w.shape[0], w.shape[2])} for w {tuple(w.shape)}, got {tuple(bias.shape)}"
            )
    group_sizes = as_group_sizes(group_sizes, w.shape[0], x.device)
    if checks_enabled(check):
        check_group_sizes_values(group_sizes, x.shape[0])
    return _ops.m_grouped(x, w, group_sizes, bias, resolve_backend(backend, x.device))


def k_grouped_mm(
    a: torch.Tensor | Fp8Tensor,
    b: torch.Tensor | Fp8Tensor,
    group_sizes: GroupSizes | None = None,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
    fast_accum: bool = False,
    check: bool | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """k-grouped GEMM (weight gradient): ``for g: out[g] (+)= a[rows(g)]^T @ b[rows(g)]``.

    a [M, K] and b [M, N] in one float dtype, any strides; group_sizes [G] as in m_grouped_mm.
    Returns out [G, K, N] in ``out_dtype`` (fp32 default, bf16/fp16 allowed), fp32 accumulation.
    A group with no rows gives exact zeros. ``out=`` writes into a given [G, K, N] tensor (any
    strides; it must not share memory with a or b); ``accumulate=True`` adds into it instead (fp32
    only: the Megatron main_grad convention), and an empty group's out[g] is neither read nor
    written (its bits, -0.0 and NaN included, stay as they were). Differentiable in a and b when
    out is None; like torch's own out= variants, the ``out=`` form is not differentiable and
    raises if autograd would have to record it.

    Quantized operands: a [M, K] and b [M, N] Fp8Tensors of activations quantized with one recipe,
    ``transpose=True`` and the same ``group_sizes`` tensor (their transposed copies, which the kernel
    reads, are laid out by it); group_sizes is that tensor or None. For dW of y = x @ w^T:
    ``k_grouped_mm(dy_q, x_q, gs)`` gives [G, N, K]. ``fast_accum`` as in m_grouped_mm. Not differentiable.
    """
    if a.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES:  # quantized operands, or a bad dtype
        return _k_grouped_mm_fp8(a, b, group_sizes, out, accumulate, out_dtype, fast_accum, check, backend)
    check_same("a and b", a, b)
    if fast_accum:
        raise ValueError("k_grouped_mm: fast_accum is an option of quantized operands (Fp8Tensor)")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(
            f"k_grouped_mm expects a [M, K] and b [M, N] with the same M; got a {tuple(a.shape)}, "
            f"b {tuple(b.shape)}"
        )
    if group_sizes is None:
        raise ValueError("k_grouped_mm: group_sizes is required for high-precision operands")
    group_sizes = as_group_sizes(group_sizes, None, a.device)
    G, K, N = group_sizes.shape[0], a.shape[1], b.shape[1]
    if checks_enabled(check):
        check_group_sizes_values(group_sizes, a.shape[0])
    backend = resolve_backend(backend, a.device)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out=, the fp32 buffer to accumulate into")
        if out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
        return _ops.k_grouped(a, b, group_sizes, out_dtype, backend)[0]
    if tuple(out.shape) != (G, K, N):
        raise ValueError(f"out must have shape [G, K, N] = {(G, K, N)}, got {tuple(out.shape)}")
    if out.device != a.device:
        raise ValueError(f"out is on {out.device} but a and b are on {a.device}")
    if out.dtype not in FLOAT_DTYPES or (accumulate and out.dtype != torch.float32):
        raise TypeError(f"out must be float32 to accumulate (bf16/fp16 allowed otherwise), got {out.dtype}")
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or out.requires_grad):
        # Writing into out without recording it would drop these gradients silently; torch's own out=
        # variants refuse the same way.
        grads = [name for name, t in (("a", a), ("b", b), ("out", out)) if t.requires_grad]
        raise RuntimeError(
            f"k_grouped_mm(out=...) does not support automatic differentiation, but {', '.join(grads)} "
            f"require(s) grad; call it under torch.no_grad(), or without out= for a differentiable result"
        )
    check_out_buffer("k_grouped_mm", out, a=a, b=b, group_sizes=group_sizes)
    _ops.k_grouped_out(a, b, group_sizes, out, accumulate, backend)
    return out


def _check_high(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32 to quantize, got {t.dtype}")


def quantize_fp8(
    x: torch.Tensor,
    recipe: fp8.Recipe,
    *,
    group_sizes: GroupSizes | None = None,
    dtype: torch.dtype = torch.float8_e4m3fn,
    transpose: bool = False,
    check: bool | None = None,
    backend: Backend = "auto",
) -> Fp8Tensor:
    """Quantizes activations x [M, K] (rows grouped by ``group_sizes``) or a weight x [G, N, K].

    One scale per block of the recipe, ``scale = amax / max(dtype)`` (current scaling; an all-zero
    block gets scale 1), data = round-to-nearest-even(x * (1 / scale)), the reciprocal rounded once
    per scale. ``transpose`` also writes the transposed copy the other GEMM needs (wgrad for
    activations, dgrad for a weight). No host sync; ``check=True`` (or MOEGEMM_CHECK=1) syncs to refuse inf/NaN inputs and
    bad sizes. Tensorwise activations get one scale per group when ``group_sizes`` is given.
    """
    fp8.check_recipe(recipe)
    _check_high("x", x)
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if x.dim() == 3:
        if group_sizes is not None:
            raise ValueError(
                "a weight [G, N, K] is grouped by its first dimension; group_sizes is for activations"
            )
        G = x.shape[0]
        sizes = None
    elif x.dim() == 2:
        sizes = None if group_sizes is None else as_group_sizes(group_sizes, None, x.device)
        G = 1 if sizes is None else sizes.shape[0]
    else:
        raise ValueError(
            f"quantize_fp8 takes activations [M, K] or a weight [G, N, K], got shape {tuple(x.shape)}"
        )
    if checks_enabled(check):
        if sizes is not None:
            check_group_sizes_values(sizes, x.shape[0])
        bad = int((~torch.isfinite(x)).sum())
        if bad:
            raise ValueError(
                f"quantize_fp8: x {tuple(x.shape)} has {bad} inf/NaN values; its scale would be inf/NaN"
            )
    backend = resolve_backend(backend, x.device)
    if x.dim() == 3 and x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()  # the kernels see a weight as [G * N, K] rows
    data_s, scale_s, data_t_s, scale_t_s, _ = _ops.quantize(x, sizes, recipe, dtype, transpose, G, backend)
    return from_storage(x, sizes, recipe, transpose, data_s, scale_s, data_t_s, scale_t_s)


def _check_quantized_pair(op: str, a: tuple[str, object], b: tuple[str, object]) -> None:
    if not isinstance(a[1], Fp8Tensor) and not isinstance(b[1], Fp8Tensor):  # high precision, a bad dtype
        check_float(*a)
        check_float(*b)
    check_pair(op, a, b)


def _m_grouped_mm_fp8(x_q, w_q, group_sizes, bias, out_dtype, fast_accum, check, backend) -> torch.Tensor:
    """m_grouped_mm of quantized operands (see its docstring)."""
    _check_quantized_pair("m_grouped_mm", ("x", x_q), ("w", w_q))
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if x_q.is_weight or not w_q.is_weight or x_q.shape[1] != w_q.shape[2]:
        raise ValueError(
            f"m_grouped_mm expects quantized activations [M, K] and a weight [G, N, K] with matching K; got "
            f"{x_q.shape} and {w_q.shape}"
        )
    G, N, _ = w_q.shape
    if x_q.recipe == "tensorwise" and x_q.scale.numel() not in (1, G):
        raise ValueError(
            f"tensorwise x_q has {x_q.scale.numel()} group scales but the weight has G={G} groups"
        )
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if bias is not None and (tuple(bias.shape) != (G, N) or bias.device != x_q.data.device):
        raise ValueError(
            f"bias must be [G, N] = {(G, N)} on {x_q.data.device}, got {tuple(bias.shape)} on {bias.device}"
        )
    sizes = as_group_sizes(group_sizes, G, x_q.data.device)
    if checks_enabled(check):
        check_group_sizes_values(sizes, x_q.shape[0])
    backend = resolve_backend(backend, x_q.data.device)
    return _ops.m_grouped_fp8(
        x_q.data, x_q.scale, w_q.data, w_q.scale, sizes, bias, x_q.recipe, out_dtype, fast_accum, backend
    )


def _k_grouped_mm_fp8(
    a_q, b_q, group_sizes, out, accumulate, out_dtype, fast_accum, check, backend
) -> torch.Tensor:
    """k_grouped_mm of quantized operands (see its docstring)."""
    _check_quantized_pair("k_grouped_mm", ("a", a_q), ("b", b_q))
    if a_q.is_weight or b_q.is_weight or a_q.shape[0] != b_q.shape[0]:
        raise ValueError(
            f"k_grouped_mm expects activations [M, Ka] and [M, Nb]; got {a_q.shape} and {b_q.shape}"
        )
    if a_q.data_t is None or b_q.data_t is None:
        raise ValueError(
            "k_grouped_mm reads the transposed copies: quantize both operands with transpose=True"
        )
    if a_q.group_sizes is None or a_q.group_sizes is not b_q.group_sizes:
        raise ValueError(
            "k_grouped_mm: quantize a and b with the same group_sizes tensor (their transposed copies are "
            "laid out group by group)"
        )
    sizes = a_q.group_sizes
    if group_sizes is not None and group_sizes is not sizes:
        raise ValueError(
            "k_grouped_mm: group_sizes must be the tensor the operands were quantized with "
            "(Fp8Tensor.group_sizes), or None"
        )
    M = a_q.shape[0]
    G, K, N = sizes.shape[0], a_q.shape[1], b_q.shape[1]
    if checks_enabled(check):
        check_group_sizes_values(sizes, M)
    backend = resolve_backend(backend, a_q.data.device)
    args = (a_q.data_t, a_q.scale_t, b_q.data_t, b_q.scale_t, sizes, M, a_q.recipe, fast_accum, backend)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out=, the fp32 buffer to accumulate into")
        if out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
        return _ops.k_grouped_fp8(*args, out_dtype)
    if tuple(out.shape) != (G, K, N) or out.device != a_q.data.device:
        raise ValueError(
            f"out must be [G, Ka, Nb] = {(G, K, N)} on {a_q.data.device}, got {tuple(out.shape)} on {out.device}"
        )
    if out.dtype not in FLOAT_DTYPES or (accumulate and out.dtype != torch.float32):
        raise TypeError(f"out must be float32 to accumulate (bf16/fp16 allowed otherwise), got {out.dtype}")
    check_out_buffer("k_grouped_mm", out, a=a_q.data_t, b=b_q.data_t)
    _ops.k_grouped_fp8_out(*args[:6], out, accumulate, *args[6:])
    return out
