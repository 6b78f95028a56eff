"""The PyTorch glue of the ops: one forward and one backward definition per op, FP8 an option of each.

Ops (torch.library, with fake impls; inputs are validated by ``moegemm.torch.api``)::

    moegemm::m_grouped_mm      (x, w, group_sizes, bias?, backend, x_scale?, w_scale?, recipe, out_dtype?,
                                fast_accum) -> out                                        grads: x, w, bias
    moegemm::m_grouped_mm_out  (x, w, group_sizes, bias?, out, backend) -> ()            writes out
    moegemm::k_grouped_mm      (a, b, group_sizes, out_dtype, colsum_dtype?, backend, a_scale?, b_scale?, M,
                                recipe, fast_accum) -> (out, colsum)                      grads: a, b
    moegemm::k_grouped_mm_out  (a, b, group_sizes, out, accumulate, colsum_dtype?, backend, a_scale?,
                                b_scale?, M, recipe, fast_accum) -> colsum                writes out
    moegemm::quantize_fp8      (x, group_sizes?, recipe, dtype, transpose, G, backend, data=True,
                                colsum_dtype?) -> (data, scale, data_t, scale_t, colsum)  storage, see below

m-grouped: ``out[rows(g)] = x[rows(g)] @ w[g] (+ bias[g])``, w [G, K, N]. k-grouped: ``out[g] (+)= a_g^T b_g``
and, when colsum_dtype is given, ``colsum[g] = sum(a_g, 0)`` [G, K] from the same launch (with a = dy,
the bias gradient); without it colsum is an empty tensor. colsum is never differentiable.

FP8: given scales, the same ops run the scaled kernels on quantized data (``moegemm._src.fp8`` layouts).
m-grouped reads x [M, K] and the weight's data as stored, w [G, N, K] (out = x @ w[g]^T, in
``out_dtype``); ``fast_accum`` skips the fp32 promotion every 128 of K. k-grouped reads the transposed
copies a [Ka, M_t] and b [Nb, M_t] of M-row activations (out [G, Ka, Nb]); it has no colsum. Quantized
data has no gradient: of an FP8 call only the bias is differentiable (its gradient, the column sums of
dy, is the high-precision one).

quantize_fp8 quantizes activations x [M, K] (G groups) or, when x is 3-D, a weight [G, N, K]. It
returns storage, which ``moegemm._src.torch.fp8_tensor.from_storage`` turns into views (ops may not
return aliases): data with rows padded to 16 bytes, a blockwise activation scale as [cdiv(K, 128), M]
(M-major), and an empty scale_t where scale_t is scale itself (tensorwise) or its transpose (a
blockwise weight). ``data=False`` (rowwise and blockwise activations, with ``transpose``) writes only the
transposed copy and its scales, data and scale coming back empty: GroupedLinear quantizes x's data for
the forward GEMM, frees it, then makes the copy the backward keeps, so both never coexist with the output.
``colsum_dtype`` (activations) also returns colsum [G, K] = for g: sum(x[rows(g)], 0) in that dtype, the FP8
bias gradient when x is dy, from the quantize's own read of x where it has one (docs/design.md, 'FP8 bias
gradient'); else colsum is an empty tensor. Like the k-grouped colsum it is never differentiable.

How a call runs. Tracing (torch.compile, export, fake tensors) records the custom ops. Plain eager
calls skip the dispatcher, whose Python cost (~55 us per call, ~125 us with autograd, on the CI CPU)
is more than a small grouped GEMM takes on an H100: they call the forward definition directly, inside
an autograd.Function when a gradient is needed. That Function and the op's registered autograd share
one ``setup_context`` and one ``backward``, so the two routes cannot drift apart.
"""

from __future__ import annotations

import torch

from moegemm._src import fp8, plan
from moegemm._src.torch import reference as _ref
from moegemm._src.torch.launch import launch_k_grouped, launch_m_grouped
from moegemm._src.torch.launch_fp8 import launch_k_grouped_fp8, launch_m_grouped_fp8, launch_quantize_fp8
from moegemm.torch import reference

# Every output buffer comes from here, so tests can poison it with NaN (tests/conftest.py).
empty = torch.empty

# Plain tensors, and nn.Parameter (it adds no __torch_function__ behaviour): GroupedLinear passes its
# weight and bias as they are. Subclasses (DTensor, FakeTensor, ...) take the custom-op path, whose
# Python dispatch cost ~240 us per call on the H100 host when parameters went through it.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _eager(*tensors: torch.Tensor | None) -> bool:
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    for t in tensors:  # a loop, not all(<generator>): this runs several times per layer call
        if t is not None and type(t) not in _PLAIN_TENSOR_TYPES:
            return False
    return True


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------- forward definitions


def _m_grouped_forward(x, w, group_sizes, bias, backend, transpose_w=False, out=None):
    """out [M, N] = for g: x[rows(g)] @ W[g] (+ bias[g]), W = w [G, K, N], or with ``transpose_w`` w
    [G, N, K] read transposed (an nn.Linear weight as stored: its .mT view costs host time). Into
    ``out`` when given."""
    if backend == "reference":
        result = reference.m_grouped_mm_reference(x, w.mT if transpose_w else w, group_sizes, bias)
        return result if out is None else out.copy_(result)
    if out is None:
        out = empty(x.shape[0], w.shape[1 if transpose_w else 2], dtype=x.dtype, device=x.device)
    launch_m_grouped(x, w, group_sizes, out, bias, transpose_w)
    return out


def _no_colsum(a: torch.Tensor) -> torch.Tensor:
    """What the ops return for colsum when none was asked for (their schema has no optional outputs)."""
    return a.new_empty(0)


def _colsum_output(a: torch.Tensor, colsum: torch.Tensor | None) -> torch.Tensor:
    return _no_colsum(a) if colsum is None else colsum


def _k_grouped_forward(a, b, group_sizes, out, accumulate, colsum_dtype, backend, out_dtype=None):
    """(out [G, K, N], colsum): out (+)= a_g^T b_g (a new ``out_dtype`` tensor when out is None),
    colsum [G, K] = sum(a_g, 0) when colsum_dtype is given (else None)."""
    G, K = group_sizes.shape[0], a.shape[1]
    if backend == "reference":
        if out is None:
            out = reference.k_grouped_mm_reference(a, b, group_sizes, out_dtype=out_dtype)
        else:
            reference.k_grouped_mm_reference(a, b, group_sizes, out=out, accumulate=accumulate)
        if colsum_dtype is None:
            return out, None
        return out, _ref.grouped_column_sums(a, group_sizes, out_dtype=colsum_dtype)
    if out is None:
        out = empty(G, K, b.shape[1], dtype=out_dtype, device=a.device)
    colsum = None if colsum_dtype is None else empty(G, K, dtype=colsum_dtype, device=a.device)
    launch_k_grouped(a, b, group_sizes, out, accumulate, a_colsum=colsum)
    return out, colsum


def _m_grouped_fp8_forward(x, sx, w, sw, group_sizes, bias, recipe, out_dtype, fast_accum, backend):
    """out [M, N] in out_dtype = for g: (x * sx)[rows(g)] @ ((w * sw)[g])^T (+ bias[g]), w [G, N, K]."""
    if backend == "reference":
        # Tensorwise x with one scale per group was quantized with these groups.
        xd = _ref.dequantize_activation(x, sx, recipe, group_sizes if sx.numel() > 1 else None)
        wd = _ref.dequantize_weight(w, sw, recipe)
        return reference.m_grouped_mm_reference(
            xd, wd.mT, group_sizes, bias, out_dtype=out_dtype, compute_dtype=torch.float32
        )
    out = empty(x.shape[0], w.shape[1], dtype=out_dtype, device=x.device)
    launch_m_grouped_fp8(x, sx, w, sw, group_sizes, out, bias, recipe, fast_accum)
    return out


def _k_grouped_fp8_forward(
    a_t, sa, b_t, sb, group_sizes, M, recipe, fast_accum, backend, out, accumulate, out_dtype
):
    """out [G, Ka, Nb] (+)= (a * sa)_g^T (b * sb)_g from the transposed copies a_t [Ka, M_t], b_t [Nb, M_t]."""
    if backend == "reference":
        ad = _ref.dequantize_activation_t(a_t, sa, recipe, group_sizes, M)
        bd = _ref.dequantize_activation_t(b_t, sb, recipe, group_sizes, M)
        return reference.k_grouped_mm_reference(
            ad,
            bd,
            group_sizes,
            out=out,
            accumulate=accumulate,
            out_dtype=out_dtype,
            compute_dtype=torch.float32,
        )
    if out is None:
        out = empty(group_sizes.shape[0], a_t.shape[0], b_t.shape[0], dtype=out_dtype, device=a_t.device)
    launch_k_grouped_fp8(M, a_t, sa, b_t, sb, group_sizes, out, accumulate, recipe, fast_accum)
    return out


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


def _quantize_forward(
    x, group_sizes, recipe, dtype, transpose, G, backend, data=True, amax=None, colsum_dtype=None
):
    """The four storage tensors and, with ``colsum_dtype`` (activations), x's [G, K] column sums per group in that
    dtype (the bias gradient when x is dy), else an empty placeholder."""
    shapes = storage_shapes(tuple(x.shape), recipe, G, transpose, data)
    weight = x.dim() == 3
    if colsum_dtype is not None and weight:
        raise ValueError("colsum_dtype: the column sums of activations [M, K], not of a weight")
    # The column sums come from the quantize's own read of x where it has one (docs/design.md, 'FP8 bias
    # gradient'), else from a launch of their own.
    fused = (
        colsum_dtype is not None
        and backend != "reference"
        and not weight
        and plan.colsum_fused(recipe, transpose, amax is not None)
    )
    if colsum_dtype is None:
        colsum = x.new_empty(0, dtype=torch.float32)
    elif fused:
        colsum = empty((G, x.shape[-1]), dtype=colsum_dtype, device=x.device)
    elif group_sizes is None:  # one group: no sizes tensor made on the host (a copy to the device)
        colsum = torch.sum(x, 0, keepdim=True, dtype=torch.float32).to(colsum_dtype)
    else:
        colsum = grouped_column_sums(x, group_sizes, colsum_dtype, backend)
    if backend == "reference":
        if weight:
            data, scale, data_t, scale_t = _ref.quantize_weight(x, recipe, dtype, transpose)
        else:
            data, scale, data_t, scale_t = _ref.quantize_activation(
                x, group_sizes, recipe, dtype, transpose, amax
            )
        out = [empty(s, dtype=t, device=x.device) for s, t in zip(shapes, (dtype, torch.float32) * 2)]
        if out[0].numel():
            out[0][..., : data.shape[-1]].copy_(data)
        if out[1].numel():  # tensorwise group scales exist without rows (1: an empty group's)
            out[1].copy_(scale.T if recipe == "blockwise" and not weight else scale)
        if transpose:
            out[2][..., : data_t.shape[-1]].copy_(data_t)
            if out[3].numel():
                out[3].copy_(scale_t)
        return (*out, colsum)
    data_s = empty(shapes[0], dtype=dtype, device=x.device)
    scale_s = empty(shapes[1], dtype=torch.float32, device=x.device)
    data_t_s = empty(shapes[2], dtype=dtype, device=x.device)
    scale_t_s = empty(shapes[3], dtype=torch.float32, device=x.device)
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
            x, group_sizes, recipe, q, s, qt, st if transpose else None, rows_per_group=M, G=G, amax=amax,
            colsum=colsum if fused else None,
        )  # fmt: skip
    return data_s, scale_s, data_t_s, scale_t_s, colsum


# ---------------------------------------------------------------- custom ops (what tracing records)


@torch.library.custom_op("moegemm::m_grouped_mm", mutates_args=())
def m_grouped_mm_op(
    x: torch.Tensor,
    w: torch.Tensor,
    group_sizes: torch.Tensor,
    bias: torch.Tensor | None,
    backend: str,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    recipe: str = "",
    out_dtype: torch.dtype | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    if x_scale is None:
        return _m_grouped_forward(x, w, group_sizes, bias, backend)
    return _m_grouped_fp8_forward(
        x, x_scale, w, w_scale, group_sizes, bias, recipe, out_dtype, fast_accum, backend
    )


@m_grouped_mm_op.register_fake
def _(
    x, w, group_sizes, bias, backend, x_scale=None, w_scale=None, recipe="", out_dtype=None, fast_accum=False
):
    if x_scale is None:
        return x.new_empty(x.shape[0], w.shape[2])
    return x.new_empty(x.shape[0], w.shape[1], dtype=out_dtype)


@torch.library.custom_op("moegemm::m_grouped_mm_out", mutates_args=("out",))
def m_grouped_mm_out_op(
    x: torch.Tensor,
    w: torch.Tensor,
    group_sizes: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    backend: str,
) -> None:
    _m_grouped_forward(x, w, group_sizes, bias, backend, out=out)


@m_grouped_mm_out_op.register_fake
def _(x, w, group_sizes, bias, out, backend):
    return None


@torch.library.custom_op("moegemm::k_grouped_mm", mutates_args=())
def k_grouped_mm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    group_sizes: torch.Tensor,
    out_dtype: torch.dtype,
    colsum_dtype: torch.dtype | None,
    backend: str,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    M: int = 0,
    recipe: str = "",
    fast_accum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    if a_scale is not None:
        out = _k_grouped_fp8_forward(
            a, a_scale, b, b_scale, group_sizes, M, recipe, fast_accum, backend, None, False, out_dtype
        )
        return out, _no_colsum(a)
    out, colsum = _k_grouped_forward(a, b, group_sizes, None, False, colsum_dtype, backend, out_dtype)
    return out, _colsum_output(a, colsum)


def _fake_colsum(a, group_sizes, colsum_dtype):
    return (
        _no_colsum(a)
        if colsum_dtype is None
        else a.new_empty(group_sizes.shape[0], a.shape[1], dtype=colsum_dtype)
    )


@k_grouped_mm_op.register_fake
def _(
    a,
    b,
    group_sizes,
    out_dtype,
    colsum_dtype,
    backend,
    a_scale=None,
    b_scale=None,
    M=0,
    recipe="",
    fast_accum=False,
):
    if a_scale is not None:  # the transposed copies: a [Ka, M_t], b [Nb, M_t]
        return a.new_empty(group_sizes.shape[0], a.shape[0], b.shape[0], dtype=out_dtype), _no_colsum(a)
    out = a.new_empty(group_sizes.shape[0], a.shape[1], b.shape[1], dtype=out_dtype)
    return out, _fake_colsum(a, group_sizes, colsum_dtype)


@torch.library.custom_op("moegemm::k_grouped_mm_out", mutates_args=("out",))
def k_grouped_mm_out_op(
    a: torch.Tensor,
    b: torch.Tensor,
    group_sizes: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    colsum_dtype: torch.dtype | None,
    backend: str,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    M: int = 0,
    recipe: str = "",
    fast_accum: bool = False,
) -> torch.Tensor:
    if a_scale is not None:
        _k_grouped_fp8_forward(
            a, a_scale, b, b_scale, group_sizes, M, recipe, fast_accum, backend, out, accumulate, None
        )
        return _no_colsum(a)
    return _colsum_output(a, _k_grouped_forward(a, b, group_sizes, out, accumulate, colsum_dtype, backend)[1])


@k_grouped_mm_out_op.register_fake
def _(
    a,
    b,
    group_sizes,
    out,
    accumulate,
    colsum_dtype,
    backend,
    a_scale=None,
    b_scale=None,
    M=0,
    recipe="",
    fast_accum=False,
):
    return _no_colsum(a) if a_scale is not None else _fake_colsum(a, group_sizes, colsum_dtype)


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
    colsum_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_forward(x, group_sizes, recipe, dtype, transpose, G, backend, data, None, colsum_dtype)


@quantize_fp8_op.register_fake
def _(x, group_sizes, recipe, dtype, transpose, G, backend, data=True, colsum_dtype=None):
    shapes = storage_shapes(tuple(x.shape), recipe, G, transpose, data)
    colsum = (
        x.new_empty(0, dtype=torch.float32)
        if colsum_dtype is None
        else x.new_empty(G, x.shape[-1], dtype=colsum_dtype)
    )
    return (*(x.new_empty(s, dtype=t) for s, t in zip(shapes, (dtype, torch.float32) * 2)), colsum)


# ---------------------------------------------------------------- backward definitions


def _m_grouped_setup(ctx, inputs, output):
    x, w, group_sizes, bias, backend = inputs[:5]
    ctx.quantized = len(inputs) > 5 and inputs[5] is not None
    # A quantized call is differentiable in bias only: keep its FP8 data out of the saved tensors.
    ctx.save_for_backward(*((None, None) if ctx.quantized else (x, w)), group_sizes)
    ctx.backend = backend
    ctx.bias_dtype = None if bias is None else bias.dtype


def _m_grouped_backward(ctx, grad_out):
    """dx = dy @ w[g]^T, and dw, dbias from weight_grads (of an FP8 call, dbias alone)."""
    x, w, group_sizes = ctx.saved_tensors
    need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
    options = (None,) * (len(ctx.needs_input_grad) - 4)  # backend, and the FP8 options when given
    if ctx.quantized:
        grad_b = grouped_column_sums(grad_out, group_sizes, ctx.bias_dtype, ctx.backend) if need_b else None
        return None, None, None, grad_b, *options
    grad_x = m_grouped(grad_out, w, group_sizes, None, ctx.backend, transpose_w=True) if need_x else None
    # An nn.Linear weight [G, N, K] passed as w.mT: its gradient is produced in that storage layout (no
    # transposed copy reaches the weight), and the bias gradient comes from the same launch.
    linear_layout = w.stride(1) == 1 and w.stride(2) != 1
    grad_w, grad_b = weight_grads(
        x,
        grad_out,
        group_sizes,
        ctx.backend,
        w_dtype=w.dtype,
        need_w=need_w,
        bias_dtype=ctx.bias_dtype if need_b else None,
        linear_layout=linear_layout,
    )
    if grad_w is not None and linear_layout:
        grad_w = grad_w.mT
    return grad_x, grad_w, None, grad_b, *options


def _k_grouped_setup(ctx, inputs, output):
    a, b, group_sizes = inputs[:3]
    ctx.save_for_backward(a, b, group_sizes)
    ctx.backend = inputs[5]
    ctx.mark_non_differentiable(output[1])


def _k_grouped_backward(ctx, grad_out, _grad_colsum):
    """out[g] = a_g^T b_g  =>  da_g = b_g dout[g]^T,  db_g = a_g dout[g] (quantized a and b have none)."""
    a, b, group_sizes = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a = (
        m_grouped(b, grad_out.to(b.dtype), group_sizes, None, ctx.backend, transpose_w=True)
        if need_a
        else None
    )
    grad_b = m_grouped(a, grad_out.to(a.dtype), group_sizes, None, ctx.backend) if need_b else None
    return grad_a, grad_b, *(None,) * (len(ctx.needs_input_grad) - 2)


m_grouped_mm_op.register_autograd(_m_grouped_backward, setup_context=_m_grouped_setup)
k_grouped_mm_op.register_autograd(_k_grouped_backward, setup_context=_k_grouped_setup)


class _MGroupedFunction(torch.autograd.Function):
    """Eager twin of moegemm::m_grouped_mm's autograd: the same setup_context and backward."""

    @staticmethod
    def forward(
        x,
        w,
        group_sizes,
        bias,
        backend,
        x_scale=None,
        w_scale=None,
        recipe="",
        out_dtype=None,
        fast_accum=False,
    ):
        if x_scale is None:
            return _m_grouped_forward(x, w, group_sizes, bias, backend)
        return _m_grouped_fp8_forward(
            x, x_scale, w, w_scale, group_sizes, bias, recipe, out_dtype, fast_accum, backend
        )

    setup_context = staticmethod(_m_grouped_setup)
    backward = staticmethod(_m_grouped_backward)


class _KGroupedFunction(torch.autograd.Function):
    """Eager twin of moegemm::k_grouped_mm's autograd: the same setup_context and backward."""

    @staticmethod
    def forward(a, b, group_sizes, out_dtype, colsum_dtype, backend):
        out, colsum = _k_grouped_forward(a, b, group_sizes, None, False, colsum_dtype, backend, out_dtype)
        return out, _colsum_output(a, colsum)

    setup_context = staticmethod(_k_grouped_setup)
    backward = staticmethod(_k_grouped_backward)


# ---------------------------------------------------------------- entry points (api.py, GroupedLinear)


def m_grouped(x, w, group_sizes, bias, backend: str, transpose_w: bool = False) -> torch.Tensor:
    """out [M, N] = for g: x[rows(g)] @ W[g] (+ bias[g]); W = w, or w.mT with ``transpose_w``
    (differentiable in x, w and bias)."""
    if not _eager(x, w, group_sizes, bias):
        return m_grouped_mm_op(x, w.mT if transpose_w else w, group_sizes, bias, backend)
    if _needs_grad(x, w, bias):
        return _MGroupedFunction.apply(x, w.mT if transpose_w else w, group_sizes, bias, backend)
    return _m_grouped_forward(x, w, group_sizes, bias, backend, transpose_w)


def m_grouped_out(x, w, group_sizes, bias, out, backend: str, transpose_w: bool = False) -> None:
    """m_grouped into ``out`` [M, N] (not differentiable: GroupedLinear records its own autograd)."""
    if not _eager(x, w, group_sizes, bias, out):
        m_grouped_mm_out_op(x, w.mT if transpose_w else w, group_sizes, bias, out, backend)
    else:
        _m_grouped_forward(x, w, group_sizes, bias, backend, transpose_w, out=out)


def k_grouped(
    a, b, group_sizes, out_dtype: torch.dtype, backend: str, colsum_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [G, K, N] = for g: a_g^T b_g, differentiable in a and b; colsum [G, K] = sum(a_g, 0) or None)."""
    if not _eager(a, b, group_sizes):
        out, colsum = k_grouped_mm_op(a, b, group_sizes, out_dtype, colsum_dtype, backend)
    elif _needs_grad(a, b):
        out, colsum = _KGroupedFunction.apply(a, b, group_sizes, out_dtype, colsum_dtype, backend)
    else:
        out, colsum = _k_grouped_forward(a, b, group_sizes, None, False, colsum_dtype, backend, out_dtype)
    return out, None if colsum_dtype is None else colsum


def k_grouped_out(
    a, b, group_sizes, out, accumulate: bool, backend: str, colsum_dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """out[g] (+)= a_g^T b_g in place (not differentiable); returns colsum [G, K] = sum(a_g, 0) or None."""
    if not _eager(a, b, group_sizes, out):
        colsum = k_grouped_mm_out_op(a, b, group_sizes, out, accumulate, colsum_dtype, backend)
    else:
        colsum = _k_grouped_forward(a, b, group_sizes, out, accumulate, colsum_dtype, backend)[1]
    return None if colsum_dtype is None else colsum


def m_grouped_fp8(x, sx, w, sw, group_sizes, bias, recipe, out_dtype, fast_accum, backend) -> torch.Tensor:
    """out [M, N] = for g: (x * sx)[rows(g)] @ ((w * sw)[g])^T (+ bias[g]), w the weight's [G, N, K] data
    (differentiable in bias only)."""
    if not _eager(x, sx, w, sw, group_sizes, bias):
        return m_grouped_mm_op(x, w, group_sizes, bias, backend, sx, sw, recipe, out_dtype, fast_accum)
    if bias is not None and _needs_grad(bias):
        return _MGroupedFunction.apply(
            x, w, group_sizes, bias, backend, sx, sw, recipe, out_dtype, fast_accum
        )
    return _m_grouped_fp8_forward(x, sx, w, sw, group_sizes, bias, recipe, out_dtype, fast_accum, backend)


def k_grouped_fp8(a_t, sa, b_t, sb, group_sizes, M, recipe, fast_accum, backend, out_dtype) -> torch.Tensor:
    """out [G, Ka, Nb] = for g: (a * sa)_g^T (b * sb)_g from the transposed copies (not differentiable)."""
    if _eager(a_t, sa, b_t, sb, group_sizes):
        return _k_grouped_fp8_forward(
            a_t, sa, b_t, sb, group_sizes, M, recipe, fast_accum, backend, None, False, out_dtype
        )
    return k_grouped_mm_op(a_t, b_t, group_sizes, out_dtype, None, backend, sa, sb, M, recipe, fast_accum)[0]


def k_grouped_fp8_out(a_t, sa, b_t, sb, group_sizes, M, out, accumulate, recipe, fast_accum, backend) -> None:
    """k_grouped_fp8 into ``out`` (+= with ``accumulate``; an empty group's out[g] untouched)."""
    if _eager(a_t, sa, b_t, sb, group_sizes, out):
        _k_grouped_fp8_forward(
            a_t, sa, b_t, sb, group_sizes, M, recipe, fast_accum, backend, out, accumulate, None
        )
    else:
        k_grouped_mm_out_op(
            a_t, b_t, group_sizes, out, accumulate, None, backend, sa, sb, M, recipe, fast_accum
        )


def quantize(
    x,
    group_sizes,
    recipe: str,
    dtype,
    transpose: bool,
    G: int,
    backend: str,
    data: bool = True,
    colsum_dtype=None,
):
    """The four storage tensors (see the module docstring) and the column sums (``_quantize_forward``)."""
    if _eager(x, group_sizes):
        return _quantize_forward(
            x, group_sizes, recipe, dtype, transpose, G, backend, data, None, colsum_dtype
        )
    return quantize_fp8_op(x, group_sizes, recipe, dtype, transpose, G, backend, data, colsum_dtype)


def quantize_weight_views(weight: torch.Tensor, recipe: str, backend: str):
    """(data, scale, data_t, scale_t) of a [G, N, K] weight in e4m3 with its dgrad copy, as views of the
    storage (``moegemm._src.fp8``): data [G, N, K], data_t [G, K, N], scale_t the scale data_t's GEMM reads."""
    with torch.no_grad():
        G, N, K = weight.shape
        data_s, scale_s, data_t_s, scale_t_s, _ = quantize(
            weight.detach(), None, recipe, torch.float8_e4m3fn, True, G, backend
        )
    scale_t = (
        scale_t_s if recipe == "rowwise" else scale_s if recipe == "tensorwise" else scale_s.transpose(1, 2)
    )
    return data_s[..., :K], scale_s, data_t_s[..., :N], scale_t


def quantize_gathered_t(x, gather, group_sizes, recipe: str, dtype, backend: str, amax=None):
    """(data_t [C, M_t], scale_t) of the rows x[gather] [R, C] in group_sizes' groups, the wgrad's operand,
    without a gathered copy of x (docs/design.md, 'FP8 expert block'). Tensorwise scales every group by
    ``amax`` (a [1] fp32 tensor), so no pass over the gathered rows finds one; x may then be FP8 itself."""
    R, C = gather.shape[0], x.shape[1]
    G = group_sizes.shape[0]
    if recipe == "tensorwise":
        if amax is None:
            raise ValueError("quantize_gathered_t: tensorwise takes the rows' amax")
        amax = amax.float().reshape(1).expand(G).contiguous()
    if backend == "reference":
        rows = (
            x.view(torch.uint8).index_select(0, gather.long()).view(x.dtype)
            if x.element_size() == 1
            else None
        )
        rows = x.index_select(0, gather.long()) if rows is None else rows
        return _ref.quantize_activation(rows, group_sizes, recipe, dtype, True, amax)[2:]
    st_shape = fp8.activation_scale_shapes(recipe, R, C, G)[1]
    data_t = empty(C, fp8.transposed_columns(R, G), dtype=dtype, device=x.device)
    scale_t = _ref.scale_of(amax, dtype) if recipe == "tensorwise" else empty(st_shape, device=x.device)
    launch_quantize_fp8(
        x, group_sizes, recipe, None, None, data_t, scale_t, rows_per_group=R, G=G, gather=gather, amax=amax
    )
    return data_t, scale_t


def gathered_t_bytes(x_q, gather, group_sizes, backend: str):
    """data_t [C, M_t] of the FP8 rows x_q[gather] [R, C] in group_sizes' groups, their bytes unchanged: a
    tensorwise wgrad operand at x_q's own scale (docs/design.md, 'FP8 expert block').
    ``data_t[:, t_g + i] = x_q[gather[start_g + i]]``."""
    R, C, G = gather.shape[0], x_q.shape[1], group_sizes.shape[0]
    if backend == "reference":
        return _ref.gathered_t_bytes(x_q, gather, group_sizes)
    data_t = empty(C, fp8.transposed_columns(R, G), dtype=x_q.dtype, device=x_q.device)
    launch_quantize_fp8(
        x_q, group_sizes, "tensorwise", None, None, data_t, None, rows_per_group=R, G=G, gather=gather,
        move_bytes=True,
    )  # fmt: skip
    return data_t


def quantize_activation_views(
    t,
    group_sizes,
    recipe: str,
    dtype,
    transpose: bool,
    backend: str,
    data: bool = True,
    amax=None,
    colsum_dtype=None,
):
    """(data, scale, data_t, scale_t, colsum) of activations t [M, K] in row groups (group_sizes None: one group),
    as the GEMMs read them: data [M, K], scale [G] / [M] / [M, cdiv(K, 128)], data_t [K, M_t] and its scale_t.
    data=False (rowwise, blockwise): the transposed copy alone, data and scale None. ``amax`` (tensorwise, eager
    calls): a [1] fp32 tensor every group's scale comes from, given, so no pass reads t to find it.
    ``colsum_dtype``: colsum [G, K] = for g: sum(t[rows(g)], 0) in it (dy's bias gradient, from the quantize's
    own read of t where it has one: docs/design.md, 'FP8 bias gradient'), else None."""
    G = 1 if group_sizes is None else group_sizes.shape[0]
    if amax is not None:
        amax = amax.float().reshape(1).expand(G).contiguous()
        data_s, scale_s, data_t_s, scale_t_s, colsum = _quantize_forward(
            t, group_sizes, recipe, dtype, transpose, G, backend, data, amax, colsum_dtype
        )
    else:
        data_s, scale_s, data_t_s, scale_t_s, colsum = quantize(
            t, group_sizes, recipe, dtype, transpose, G, backend, data, colsum_dtype
        )
    colsum = None if colsum_dtype is None else colsum
    scale_t = scale_s if recipe == "tensorwise" else scale_t_s
    if not data:
        return None, None, data_t_s, scale_t, colsum
    scale = scale_s.T if recipe == "blockwise" else scale_s
    return data_s[:, : t.shape[1]], scale, data_t_s, scale_t, colsum


def grouped_column_sums(t, group_sizes, out_dtype, backend: str) -> torch.Tensor:
    """[G, N]: for g: sum(t[rows(g)], 0), alone (a bias gradient without the weight's): one k-grouped
    launch over a stride-0 ones column, so no [M] buffer of ones is allocated."""
    ones = t.new_ones(1).expand(t.shape[0], 1)
    return k_grouped(ones, t, group_sizes, out_dtype, backend)[0].squeeze(1)


def weight_grads(
    x,
    dy,
    group_sizes,
    backend: str,
    *,
    w_dtype: torch.dtype,
    need_w: bool,
    bias_dtype: torch.dtype | None,
    linear_layout: bool = True,
    main_grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dW, dbias) of y[rows(g)] = x[rows(g)] @ W[g] (+ bias[g]), each only if asked (need_w; bias_dtype
    not None). dW[g] = dy_g^T x_g in the [G, N, K] layout of an nn.Linear weight (``linear_layout``;
    dbias = column sums of dy then come from the same launch), else x_g^T dy_g [G, K, N]. With
    ``main_grad`` (fp32 [G, N, K], linear layout) dW is accumulated into it and None is returned.
    The one weight-gradient definition: the ops' backward and GroupedLinear's (delayed or not) call it.

    The fused column sums are not differentiable, so a backward that is itself recorded (create_graph)
    takes dbias from its own differentiable launch instead.
    """
    if not need_w:
        return None, None if bias_dtype is None else grouped_column_sums(dy, group_sizes, bias_dtype, backend)
    if main_grad is not None:
        return None, k_grouped_out(dy, x, group_sizes, main_grad, True, backend, bias_dtype)
    if linear_layout and (bias_dtype is None or not torch.is_grad_enabled()):
        return k_grouped(dy, x, group_sizes, w_dtype, backend, bias_dtype)
    if linear_layout:
        grad_w = k_grouped(dy, x, group_sizes, w_dtype, backend)[0]
        return grad_w, grouped_column_sums(dy, group_sizes, bias_dtype, backend)
    grad_w = k_grouped(x, dy, group_sizes, w_dtype, backend)[0]
    return grad_w, None if bias_dtype is None else grouped_column_sums(dy, group_sizes, bias_dtype, backend)
