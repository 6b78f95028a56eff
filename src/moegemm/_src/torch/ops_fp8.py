"""The PyTorch glue of the FP8 ops: one forward definition each, registered as custom ops.

Ops (torch.library, with fake impls; inputs validated by ``moegemm.torch.fp8``)::

    moegemm::quantize_fp8        (x, group_sizes?, recipe, dtype, transpose, G, backend, data=True)
                                 -> (data, scale, data_t, scale_t)       storage tensors, see below
    moegemm::m_grouped_mm_fp8    (x, sx, w, sw, group_sizes, bias?, recipe, out_dtype, fast_accum, backend) -> out
    moegemm::k_grouped_mm_fp8    (a_t, sa, b_t, sb, group_sizes, M, recipe, out_dtype, fast_accum, backend) -> out
    moegemm::k_grouped_mm_fp8_out(a_t, sa, b_t, sb, group_sizes, M, out, accumulate, recipe, fast_accum, backend)

quantize_fp8 quantizes activations x [M, K] (G groups) or, when x is 3-D, a weight [G, N, K]. It
returns storage, which ``moegemm.torch.fp8`` turns into views (ops may not return aliases): data
with rows padded to 16 bytes, a blockwise activation scale as [cdiv(K, 128), M] (M-major), and an
empty scale_t where scale_t is scale itself (tensorwise) or its transpose (a blockwise weight).
``data=False`` (rowwise and blockwise activations, with ``transpose``) writes only the transposed copy
and its scales, data and scale coming back empty: GroupedLinear quantizes x's data for the forward
GEMM, frees it, then makes the copy the backward keeps, so both never coexist with the output.
The FP8 ops have no autograd of their own: their inputs are quantized data. GroupedLinear's FP8
recipes differentiate through the high-precision tensors (moegemm.torch.grouped_linear).
"""

from __future__ import annotations

import torch

from moegemm._src import fp8
from moegemm._src.torch import ops as _ops
from moegemm._src.torch.launch_fp8 import launch_k_grouped_fp8, launch_m_grouped_fp8, launch_quantize_fp8
from moegemm.torch import reference_fp8


def storage_shapes(shape, recipe: str, G: int, transpose: bool, data: bool = True) -> list[tuple[int, ...]]:
    """Shapes of the four storage tensors quantize_fp8 returns (0-sized for absent ones)."""
    if not data:
        if len(shape) != 2 or not transpose or recipe == "tensorwise":
            raise ValueError("data=False quantizes a rowwise or blockwise activation's transposed copy only")
        return [(0,), (0,), *storage_shapes(shape, recipe, G, transpose)[2:]]
    if len(shape) == 3:
        _, N, K = shape
        s_shape, _ = fp8.weight_scale_shapes(recipe, G, N, K)
        data = (G, N, fp8.padded(K))
        data_t = (G, K, fp8.padded(N)) if transpose else (0,)
        scale_t = fp8.weight_scale_shapes(recipe, G, N, K)[1] if transpose and recipe == "rowwise" else (0,)
        return [data, s_shape, data_t, scale_t]
    M, K = shape
    s_shape, st_shape = fp8.activation_scale_shapes(recipe, M, K, G)
    if recipe == "blockwise":
        s_shape = (s_shape[1], M)  # M-major: the GEMM loads a tile's row scales as one vector
    data_t = (K, fp8.transposed_columns(M, G)) if transpose else (0,)
    scale_t = st_shape if transpose and recipe != "tensorwise" else (0,)
    return [(M, fp8.padded(K)), s_shape, data_t, scale_t]


def _quantize_forward(x, group_sizes, recipe, dtype, transpose, G, backend, data=True):
    shapes = storage_shapes(tuple(x.shape), recipe, G, transpose, data)
    weight = x.dim() == 3
    if backend == "reference":
        if weight:
            data, scale, data_t, scale_t = reference_fp8.quantize_weight(x, recipe, dtype, transpose)
        else:
            data, scale, data_t, scale_t = reference_fp8.quantize_activation(
                x, group_sizes, recipe, dtype, transpose
            )
        out = [_ops.empty(s, dtype=t, device=x.device) for s, t in zip(shapes, (dtype, torch.float32) * 2)]
        if out[0].numel():
            out[0][..., : data.shape[-1]].copy_(data)
            out[1].copy_(scale.T if recipe == "blockwise" and not weight else scale)
        if transpose:
            out[2][..., : data_t.shape[-1]].copy_(data_t)
            if out[3].numel():
                out[3].copy_(scale_t)
        return tuple(out)
    data_s = _ops.empty(shapes[0], dtype=dtype, device=x.device)
    scale_s = _ops.empty(shapes[1], dtype=torch.float32, device=x.device)
    data_t_s = _ops.empty(shapes[2], dtype=dtype, device=x.device)
    scale_t_s = _ops.empty(shapes[3], dtype=torch.float32, device=x.device)
    K = x.shape[-1]
    if weight:
        _, N, _ = x.shape
        rows = x.reshape(G * N, K)
        q = data_s.view(G * N, -1)[:, :K]
        s = scale_s.view(G * N) if recipe == "rowwise" else scale_s
        qt = data_t_s if transpose else None  # the whole padded storage (int16 words; see launcher)
        st = scale_t_s if recipe == "rowwise" else scale_s
        launch_quantize_fp8(rows, None, recipe, q, s, qt, st if transpose else None, rows_per_group=N, G=G)
    else:
        M = x.shape[0]
        q = data_s[:, :K] if data else None
        s = (scale_s.T if recipe == "blockwise" else scale_s) if data else None
        qt = data_t_s if transpose else None
        st = scale_s if recipe == "tensorwise" else scale_t_s
        launch_quantize_fp8(
            x, group_sizes, recipe, q, s, qt, st if transpose else None, rows_per_group=M, G=G
        )
    return data_s, scale_s, data_t_s, scale_t_s


@torch.library.custom_op("moegemm::quantize_fp8", mutates_args=())
def quantize_fp8_op(
    x: torch.Tensor,
    group_sizes: torch.Tensor | None,
    recipe: str,
    dtype: torch.dtype,
    transpose: bool,
    G: int,
    backend: str,
    data: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_forward(x, group_sizes, recipe, dtype, transpose, G, backend, data)


@quantize_fp8_op.register_fake
def _(x, group_sizes, recipe, dtype, transpose, G, backend, data=True):
    shapes = storage_shapes(tuple(x.shape), recipe, G, transpose, data)
    return tuple(x.new_empty(s, dtype=t) for s, t in zip(shapes, (dtype, torch.float32) * 2))


def quantize(x, group_sizes, recipe: str, dtype, transpose: bool, G: int, backend: str, data: bool = True):
    """The four storage tensors (see the module docstring)."""
    if _ops._eager(x, group_sizes):
        return _quantize_forward(x, group_sizes, recipe, dtype, transpose, G, backend, data)
    return quantize_fp8_op(x, group_sizes, recipe, dtype, transpose, G, backend, data)


def _m_forward(x, sx, w, sw, group_sizes, bias, recipe, out_dtype, fast_accum, backend, out=None):
    if backend == "reference":
        result = reference_fp8.m_grouped_mm_fp8_reference(x, sx, w, sw, group_sizes, bias, recipe, out_dtype)
        return result if out is None else out.copy_(result)
    if out is None:
        out = _ops.empty(x.shape[0], w.shape[1], dtype=out_dtype, device=x.device)
    launch_m_grouped_fp8(x, sx, w, sw, group_sizes, out, bias, recipe, fast_accum)
    return out


@torch.library.custom_op("moegemm::m_grouped_mm_fp8", mutates_args=())
def m_grouped_mm_fp8_op(
    x: torch.Tensor,
    sx: torch.Tensor,
    w: torch.Tensor,
    sw: torch.Tensor,
    group_sizes: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: str,
    out_dtype: torch.dtype,
    fast_accum: bool,
    backend: str,
) -> torch.Tensor:
    return _m_forward(x, sx, w, sw, group_sizes, bias, recipe, out_dtype, fast_accum, backend)


@m_grouped_mm_fp8_op.register_fake
def _(x, sx, w, sw, group_sizes, bias, recipe, out_dtype, fast_accum, backend):
    return x.new_empty(x.shape[0], w.shape[1], dtype=out_dtype)


def m_grouped(x, sx, w, sw, group_sizes, bias, recipe, out_dtype, fast_accum, backend) -> torch.Tensor:
    if _ops._eager(x, sx, w, sw, group_sizes, bias):
        return _m_forward(x, sx, w, sw, group_sizes, bias, recipe, out_dtype, fast_accum, backend)
    return m_grouped_mm_fp8_op(x, sx, w, sw, group_sizes, bias, recipe, out_dtype, fast_accum, backend)


def _k_forward(
    a_t, sa, b_t, sb, group_sizes, M, recipe, fast_accum, backend, out, accumulate=False, out_dtype=None
):
    if backend == "reference":
        return reference_fp8.k_grouped_mm_fp8_reference(
            M, a_t, sa, b_t, sb, group_sizes, recipe, out=out, accumulate=accumulate, out_dtype=out_dtype
        )
    if out is None:
        out = _ops.empty(group_sizes.shape[0], a_t.shape[0], b_t.shape[0], dtype=out_dtype, device=a_t.device)
    launch_k_grouped_fp8(M, a_t, sa, b_t, sb, group_sizes, out, accumulate, recipe, fast_accum)
    return out


@torch.library.custom_op("moegemm::k_grouped_mm_fp8", mutates_args=())
def k_grouped_mm_fp8_op(
    a_t: torch.Tensor,
    sa: torch.Tensor,
    b_t: torch.Tensor,
    sb: torch.Tensor,
    group_sizes: torch.Tensor,
    M: int,
    recipe: str,
    out_dtype: torch.dtype,
    fast_accum: bool,
    backend: str,
) -> torch.Tensor:
    return _k_forward(
        a_t, sa, b_t, sb, group_sizes, M, recipe, fast_accum, backend, None, out_dtype=out_dtype
    )


@k_grouped_mm_fp8_op.register_fake
def _(a_t, sa, b_t, sb, group_sizes, M, recipe, out_dtype, fast_accum, backend):
    return a_t.new_empty(group_sizes.shape[0], a_t.shape[0], b_t.shape[0], dtype=out_dtype)


@torch.library.custom_op("moegemm::k_grouped_mm_fp8_out", mutates_args=("out",))
def k_grouped_mm_fp8_out_op(
    a_t: torch.Tensor,
    sa: torch.Tensor,
    b_t: torch.Tensor,
    sb: torch.Tensor,
    group_sizes: torch.Tensor,
    M: int,
    out: torch.Tensor,
    accumulate: bool,
    recipe: str,
    fast_accum: bool,
    backend: str,
) -> None:
    _k_forward(a_t, sa, b_t, sb, group_sizes, M, recipe, fast_accum, backend, out, accumulate)


@k_grouped_mm_fp8_out_op.register_fake
def _(a_t, sa, b_t, sb, group_sizes, M, out, accumulate, recipe, fast_accum, backend):
    return None


def k_grouped(a_t, sa, b_t, sb, group_sizes, M, recipe, fast_accum, backend, out_dtype) -> torch.Tensor:
    if _ops._eager(a_t, sa, b_t, sb, group_sizes):
        return _k_forward(
            a_t, sa, b_t, sb, group_sizes, M, recipe, fast_accum, backend, None, out_dtype=out_dtype
        )
    return k_grouped_mm_fp8_op(a_t, sa, b_t, sb, group_sizes, M, recipe, out_dtype, fast_accum, backend)


def k_grouped_out(a_t, sa, b_t, sb, group_sizes, M, out, accumulate, recipe, fast_accum, backend) -> None:
    if _ops._eager(a_t, sa, b_t, sb, group_sizes, out):
        _k_forward(a_t, sa, b_t, sb, group_sizes, M, recipe, fast_accum, backend, out, accumulate)
    else:
        k_grouped_mm_fp8_out_op(
            a_t, sa, b_t, sb, group_sizes, M, out, accumulate, recipe, fast_accum, backend
        )
