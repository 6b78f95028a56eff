"""Public JAX entry points: argument checks and backend dispatch, for high-precision and FP8 operands.

One public function per GEMM shape: :func:`m_grouped_mm` (forward, dgrad), :func:`k_grouped_mm`
(wgrad), :func:`ragged_dot` (the ``jax.lax.ragged_dot`` drop-in). Each takes high-precision arrays
or quantized ones (:class:`Fp8Array`, from :func:`quantize_fp8`), never a mix; quantized operands
carry their recipe. ``ragged_dot(..., fp8_recipe=...)`` is the differentiable FP8 training path
(quantized inside, dgrad and wgrad in FP8).

Backends: ``"triton"`` runs the Triton and Gluon kernels on the GPU (XLA custom calls of jaxlib's Triton
launcher, ``moegemm._src.jax.gpu``); ``"interpret"`` runs
the same kernels, with the same launch arguments, under the Triton interpreter in a
``jax.pure_callback`` (CPU tests; needs TRITON_INTERPRET=1 set before triton is imported);
``"reference"`` runs the jax.numpy twin (``moegemm.jax.reference``); ``"auto"`` picks triton when
JAX's default backend is a GPU, reference otherwise. A choice that cannot be served raises. The
string is resolved once, into the ``Executor`` that runs the kernels (None for the reference).

Group sizes stay on the device: nothing here syncs, and every op runs under jit. Device-side sizes
follow the kernels' clamping rules (negative -> 0, offsets clamped at M; rows past
sum(group_sizes) belong to no group and come out 0).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from moegemm._src import fp8
from moegemm._src.jax import gpu as _gpu
from moegemm._src.jax import interpret as _interpret
from moegemm._src.jax import ops as _ops
from moegemm._src.jax.launch import Executor
from moegemm.jax import reference

__all__ = [
    "Backend",
    "Fp8Array",
    "k_grouped_mm",
    "m_grouped_mm",
    "quantize_fp8",
    "ragged_dot",
    "resolve_backend",
]

Backend = Literal["auto", "triton", "interpret", "reference"]
_BACKENDS = ("auto", "triton", "interpret", "reference")
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_EXECUTORS = {executor.name: executor for executor in (_gpu.EXECUTOR, _interpret.EXECUTOR)}


def _executor(backend: str) -> Executor | None:
    """The executor that serves ``backend`` (None: the reference); raises if it cannot run here."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if jax.default_backend() == "gpu" else "reference"
    if backend == "reference":
        return None
    reason = _EXECUTORS[backend].available()
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run: {reason}")
    return _EXECUTORS[backend]


def resolve_backend(backend: str) -> str:
    """The backend that ``backend`` runs on ("auto" resolved); raises with the reason if it cannot run."""
    executor = _executor(backend)
    return "reference" if executor is None else executor.name


def _float_dtype(name: str, dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {dtype}")
    return dtype


def _to_int32(values: jax.Array, lo: int, hi: int) -> jax.Array:
    """Integer ``values`` as int32, clamped to [lo, hi] first when their dtype is wider than int32 (int64
    under jax_enable_x64, uint32): a bare cast wraps 2**32 + 2 to 2. Narrower dtypes are cast as they are
    and clamped downstream by the same rule."""
    info, i32 = jnp.iinfo(values.dtype), jnp.iinfo(jnp.int32)
    if info.min < i32.min or info.max > i32.max:
        values = jnp.clip(values, max(lo, info.min), min(hi, info.max))
    return values.astype(jnp.int32)


def _group_sizes(group_sizes, G: int | None, M: int) -> jax.Array:
    """group_sizes [G] as int32, clamped to [0, M] (the kernels' rule) before the cast."""
    group_sizes = jnp.asarray(group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer array, got {group_sizes.dtype}")
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must be 1-D [G], got shape {group_sizes.shape}")
    if G is not None and group_sizes.shape[0] != G:
        raise ValueError(f"group_sizes has {group_sizes.shape[0]} entries but the weight has G={G} groups")
    return _to_int32(group_sizes, 0, M)


def _group_offset(group_offset, G_local: int, G_total: int) -> jax.Array | None:
    """group_offset as an int32 scalar (None stays None), checked statically against the group counts."""
    if group_offset is None:
        return None
    group_offset = jnp.asarray(group_offset)
    if not jnp.issubdtype(group_offset.dtype, jnp.integer) or group_offset.size != 1:
        raise TypeError(
            f"group_offset must be an integer scalar, got {group_offset.dtype} of shape {group_offset.shape}"
        )
    if G_local > G_total:
        raise ValueError(f"group_sizes has {G_total} entries, fewer than the {G_local} local groups")
    # [-G_total, G_total] keeps the rule's result (negative counts from the end, then [0, G_total - G_local]).
    return _to_int32(group_offset.reshape(()), -G_total, G_total)


def _local_groups(group_offset, num_groups: int | None, G_total: int) -> tuple[int, jax.Array | None]:
    """(the number of groups a k-grouped op writes, group_offset as int32 or None): all G_total groups
    without an offset; with one, ``num_groups`` (static) local groups."""
    if group_offset is None:
        if num_groups is not None and num_groups != G_total:
            raise ValueError(
                f"num_groups={num_groups} differs from group_sizes' {G_total} entries; "
                "a subset of the groups needs group_offset"
            )
        return G_total, None
    if num_groups is None:
        raise ValueError("group_offset needs num_groups, the number of local groups (static)")
    return num_groups, _group_offset(group_offset, num_groups, G_total)


def _accumulate_buffer(accumulate, shape: tuple[int, ...], dims: str) -> jax.Array:
    """The fp32 buffer a k-grouped op accumulates into, checked against the output ``shape``."""
    accumulate = jnp.asarray(accumulate)
    if accumulate.shape != shape or accumulate.dtype != jnp.float32:
        raise ValueError(
            f"accumulate must be a float32 {dims} = {shape} buffer, got {accumulate.dtype} {accumulate.shape}"
        )
    return accumulate


# ---------------------------------------------------------------- quantized operands


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Array:
    """A quantized array, a pytree: ``data * scale`` approximates it (layouts in ``moegemm.jax.reference``).

    Activations (``shape`` = (M, K)): data [M, K]; scale [G] (tensorwise), [M] (rowwise) or
    [cdiv(K, 128), M] (blockwise, M-major); data_t [K, M_t] and scale_t (the wgrad operand) or None;
    group_sizes the [G] sizes it was quantized with (None: one group).
    A weight (``shape`` = (G, N, K), the stored array's): data [G, N, K]; data_t [G, K, padded(N)]
    (rows padded to 16 bytes) or None. FP8 tensor cores read only K-major operands, so the GEMMs read
    ``data`` as ``w[g]^T`` and ``data_t`` as ``w[g]`` (see :func:`m_grouped_mm`'s ``transpose_w``).
    """

    data: jax.Array
    scale: jax.Array
    data_t: jax.Array | None
    scale_t: jax.Array | None
    group_sizes: jax.Array | None
    recipe: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def is_weight(self) -> bool:
        return self.data.ndim == 3

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """data * scale in ``dtype``, in the original layout; rows past the last group are 0."""
        if self.is_weight:
            return reference._dequantize_weight(self.data, self.scale, self.recipe, dtype=dtype)
        return reference._dequantize_activation(
            self.data, self.scale, self.recipe, self.group_sizes, dtype=dtype
        )

    def dequantize_t(self, dtype=jnp.float32) -> jax.Array:
        """The transposed copy, dequantized, in the original layout (x's [M, K], w's [G, N, K])."""
        if self.data_t is None:
            raise ValueError("this Fp8Array has no transposed copy: quantize with transpose=True")
        if self.is_weight:
            N = self.data.shape[1]
            wt = reference._dequantize_weight(self.data_t[..., :N], self.scale_t, self.recipe, dtype=dtype)
            return jnp.swapaxes(wt, 1, 2)
        return reference._dequantize_activation_t(
            self.data_t, self.scale_t, self.recipe, self.group_sizes, self.data.shape[0], dtype=dtype
        )

    def t(self) -> Fp8Array:
        """A weight's transpose [G, K, N] (data and data_t swap roles). Its data is the transposed
        copy's storage [G, K, padded(N)] as is (no copy; the GEMM reads the first N columns of each row).
        ``m_grouped_mm(dy_q, w_q.t(), gs)`` is ``m_grouped_mm(dy_q, w_q, gs, transpose_w=False)``."""
        if not self.is_weight or self.data_t is None:
            raise ValueError("t() needs a weight [G, N, K] quantized with transpose=True")
        return Fp8Array(self.data_t, self.scale_t, None, None, None, self.recipe)


def _quantized(op: str, names: tuple[str, str], a, b) -> bool:
    """True if both operands are Fp8Arrays, False if neither is; a mix raises, naming both."""
    qa, qb = isinstance(a, Fp8Array), isinstance(b, Fp8Array)
    if qa != qb:
        kind = lambda q, x: "an Fp8Array" if q else f"a high-precision {type(x).__name__}"
        raise TypeError(
            f"{op}: {names[0]} is {kind(qa, a)} but {names[1]} is {kind(qb, b)}; pass both quantized "
            "(moegemm.jax.quantize_fp8, one recipe) or both in high precision"
        )
    if qa and a.recipe != b.recipe:
        raise ValueError(f"{op}: both operands must use one recipe, got {a.recipe!r} and {b.recipe!r}")
    return qa


def _fp8_dtype(name: str, dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in _FP8_DTYPES:
        raise TypeError(f"{name} must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {dtype}")
    return dtype


def quantize_fp8(
    x: jax.Array,
    recipe: fp8.Recipe,
    *,
    group_sizes: jax.Array | None = None,
    dtype=jnp.float8_e4m3fn,
    transpose: bool = False,
    backend: Backend = "auto",
) -> Fp8Array:
    """Quantizes activations x [M, K] (rows grouped by ``group_sizes``) or a weight x [G, N, K].

    One scale per block of the recipe (``moegemm._src.fp8``: tensorwise, rowwise, blockwise),
    ``scale = amax / max(dtype)`` (current scaling; an all-zero block gets scale 1), data =
    round-to-nearest-even(x * (1 / scale)), the reciprocal rounded once per scale. ``transpose`` also
    writes the transposed copy the other GEMM needs (wgrad for activations, dgrad for a weight).
    Tensorwise activations get one scale per group when ``group_sizes`` is given. Not differentiable: for training use
    ``ragged_dot(..., fp8_recipe=...)``, which quantizes inside and differentiates straight through.
    """
    fp8.check_recipe(recipe)
    x = jnp.asarray(x)
    _float_dtype("x", x.dtype)
    dtype = _fp8_dtype("dtype", dtype)
    executor = _executor(backend)
    if x.ndim == 3:
        if group_sizes is not None:
            raise ValueError(
                "a weight [G, N, K] is grouped by its first dimension; group_sizes is for activations"
            )
        parts = _ops.quantize_weight(x, recipe, dtype, transpose, executor)
        return Fp8Array(*parts, None, recipe)
    if x.ndim != 2:
        raise ValueError(f"quantize_fp8 takes activations [M, K] or a weight [G, N, K], got shape {x.shape}")
    sizes = None if group_sizes is None else _group_sizes(group_sizes, None, x.shape[0])
    parts = _ops.quantize_activation(x, sizes, recipe, dtype, transpose, executor)
    return Fp8Array(*parts, sizes, recipe)


# ---------------------------------------------------------------- the ops


def ragged_dot(
    lhs: jax.Array | Fp8Array,
    rhs: jax.Array | Fp8Array,
    group_sizes: jax.Array,
    precision=None,
    preferred_element_type=None,
    group_offset: jax.Array | None = None,
    out_sharding=None,
    *,
    fp8_recipe: fp8.Recipe | None = None,
    fp8_dtype=jnp.float8_e4m3fn,
    fp8_grad_dtype=None,
    fp8_fprop_fast_accum: bool = True,
    rhs_fp8: Fp8Array | None = None,
    backend: Backend = "auto",
) -> jax.Array:
    """Drop-in for ``jax.lax.ragged_dot``: ``for g: out[rows(g)] = lhs[rows(g)] @ rhs[g]``.

    lhs [M, K], rhs [G, K, N] (bf16/fp16/fp32; mixed dtypes promote as in jax.lax.ragged_dot),
    group_sizes [G] integer; rows(g) = [offset_g, offset_g + size_g), offset = exclusive prefix sum.
    Returns [M, N] in ``preferred_element_type`` (default: the promoted input dtype), fp32
    accumulation; rows at or past sum(group_sizes) are 0. ``precision`` is accepted for
    compatibility: fp32 inputs always use IEEE fp32 products (HIGHEST).

    ``group_offset`` (int32 scalar, expert parallelism as in megablox gmm): group_sizes covers all
    G_total groups and rhs holds the G_local = rhs.shape[0] groups starting at group_offset
    (0 <= group_offset <= G_total - G_local); rows of other groups are 0.
    Example: group_sizes=[3, 2, 4], group_offset=1, rhs [2, K, N]: rows 0..2 -> 0,
    rows 3..4 -> @ rhs[0], rows 5..8 -> @ rhs[1].

    FP8 training (``fp8_recipe`` "tensorwise", "rowwise" or "blockwise"): lhs and rhs are quantized
    inside (``fp8_dtype``; activations per group for tensorwise), the product runs on FP8 tensor
    cores with fp32 accumulation, and ``jax.grad`` runs dgrad and wgrad in FP8 too, dy quantized in
    the backward (``fp8_grad_dtype``, default ``fp8_dtype``; jnp.float8_e5m2 is TransformerEngine's
    "hybrid"). Gradients are straight through the quantization and come in lhs's and rhs's dtypes;
    the output defaults to lhs's dtype. ``fp8_fprop_fast_accum`` (tensorwise/rowwise): the forward
    accumulates on the tensor cores without the fp32 promotion (TransformerEngine's fprop default);
    dgrad and wgrad promote. ``rhs_fp8``: rhs's quantization, made once and kept while rhs is unchanged
    (``quantize_fp8(rhs, fp8_recipe, dtype=fp8_dtype, transpose=True)``, e.g. once per optimizer step across
    gradient-accumulation micro-batches, as TransformerEngine's ``is_first_microbatch``): the step then
    quantizes only lhs and dy, and rhs's gradient still comes back.

    Quantized operands (both :class:`Fp8Array`, not differentiable): rhs_q quantizes rhs [G, K, N]
    with ``transpose=True`` (the K-major copy the kernel reads); the output defaults to bfloat16.
    ``ragged_dot(x_q, w_q, gs)`` is ``m_grouped_mm(x_q, w_q, gs, transpose_w=False)``.
    """
    del precision
    if out_sharding is not None:
        raise NotImplementedError("out_sharding is not supported; shard with moegemm.jax.sharding.ragged_dot")
    if _quantized("ragged_dot", ("lhs", "rhs"), lhs, rhs):
        if rhs_fp8 is not None:
            raise ValueError("ragged_dot: rhs_fp8 is for a high-precision rhs; rhs is quantized already")
        if fp8_recipe is not None:
            raise ValueError(
                f"ragged_dot: fp8_recipe={fp8_recipe!r} quantizes high-precision operands; lhs and rhs are "
                f"already quantized ({lhs.recipe!r})"
            )
        return m_grouped_mm(
            lhs, rhs, group_sizes, transpose_w=False, out_dtype=preferred_element_type,
            group_offset=group_offset, backend=backend,
        )  # fmt: skip
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"ragged_dot expects lhs [M, K] and rhs [G, K, N] with matching K; got lhs {lhs.shape}, "
            f"rhs {rhs.shape}"
        )
    G = rhs.shape[0]
    group_sizes = _group_sizes(group_sizes, None if group_offset is not None else G, lhs.shape[0])
    group_offset = _group_offset(group_offset, G, group_sizes.shape[0])
    executor = _executor(backend)
    if rhs_fp8 is not None and fp8_recipe is None:
        raise ValueError(
            "ragged_dot: rhs_fp8 is rhs's FP8 copy for the fp8_recipe path; pass fp8_recipe as well"
        )
    if fp8_recipe is not None:
        fp8.check_recipe(fp8_recipe)
        lhs_dtype, rhs_dtype = _float_dtype("lhs", lhs.dtype), _float_dtype("rhs", rhs.dtype)
        out_dtype = _float_dtype("preferred_element_type", preferred_element_type or lhs_dtype)
        fp8_dtype = _fp8_dtype("fp8_dtype", fp8_dtype)
        grad_dtype = fp8_dtype if fp8_grad_dtype is None else _fp8_dtype("fp8_grad_dtype", fp8_grad_dtype)
        options = _ops.Fp8Options(
            fp8_recipe, fp8_dtype, grad_dtype, lhs_dtype, rhs_dtype, fp8_fprop_fast_accum
        )
        rhs_q = _rhs_fp8_parts(rhs_fp8, rhs, fp8_recipe, fp8_dtype)
        return _ops.m_grouped_mm(
            lhs, rhs, group_sizes, group_offset, rhs_q, out_dtype, False, executor, options
        )
    dtype = _float_dtype("lhs and rhs", jnp.result_type(lhs, rhs))
    lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
    out_dtype = _float_dtype(
        "preferred_element_type", dtype if preferred_element_type is None else preferred_element_type
    )
    if executor is None:
        return reference.ragged_dot_reference(
            lhs, rhs, group_sizes, group_offset=group_offset, out_dtype=out_dtype
        )
    # With group_offset the kernel reads and writes the local groups' rows in place and zero-fills
    # the others in the same launch: no row copies on the expert-parallel path.
    return _ops.m_grouped_mm(lhs, rhs, group_sizes, group_offset, None, out_dtype, False, executor, None)


def _rhs_fp8_parts(rhs_fp8, rhs: jax.Array, recipe: str, dtype) -> _ops.QuantizedParts | None:
    """ragged_dot's ``rhs_fp8`` as the op's weight parts, checked against rhs and the recipe (None: none)."""
    if rhs_fp8 is None:
        return None
    if not isinstance(rhs_fp8, Fp8Array) or not rhs_fp8.is_weight or rhs_fp8.data_t is None:
        raise TypeError(
            "ragged_dot: rhs_fp8 must be quantize_fp8(rhs, fp8_recipe, transpose=True) (an Fp8Array weight with "
            f"its transposed copy), got {type(rhs_fp8).__name__}"
        )
    if rhs_fp8.shape != rhs.shape or rhs_fp8.recipe != recipe or jnp.dtype(rhs_fp8.data.dtype) != dtype:
        raise ValueError(
            f"ragged_dot: rhs_fp8 is a {rhs_fp8.recipe!r} {rhs_fp8.data.dtype} quantization of shape "
            f"{rhs_fp8.shape}; rhs {rhs.shape} with fp8_recipe={recipe!r}, fp8_dtype={dtype} needs the same"
        )
    return _ops.QuantizedParts(rhs_fp8.data, rhs_fp8.scale, rhs_fp8.data_t, rhs_fp8.scale_t)


def m_grouped_mm(
    x: jax.Array | Fp8Array,
    w: jax.Array | Fp8Array,
    group_sizes: jax.Array,
    *,
    transpose_w: bool | None = None,
    out_dtype=None,
    group_offset: jax.Array | None = None,
    fast_accum: bool = False,
    backend: Backend = "auto",
) -> jax.Array:
    """m-grouped GEMM (forward and dgrad): ``for g: out[rows(g)] = x[rows(g)] @ W[g]``.

    x [M, K] and w in one dtype (bf16/fp16/fp32). W = w [G, K, N]; with ``transpose_w=True`` w is
    stored [G, N, K] (nn.Linear layout) and W[g] = w[g].T is read through swapped strides, no copy.
    group_sizes [G] integer, on the device. Returns [M, N] in ``out_dtype`` (default x.dtype), fp32
    accumulation; rows at or past sum(group_sizes) are 0. Differentiable in x and w (our kernels).
    ``group_offset`` (int32 scalar on the device): expert parallelism as in :func:`ragged_dot`.

    Quantized x and w (both :class:`Fp8Array`, one recipe; not differentiable): x_q activations
    [M, K], w_q a weight stored [G, N, K]. ``transpose_w`` None or True reads W[g] = w[g]^T from its
    data (the fprop of an nn.Linear-layout weight); False reads W[g] = w[g] from its transposed copy
    (the dgrad; quantize w with transpose=True). Returns ``out_dtype`` (default bfloat16), fp32
    accumulation promoted every 128 of K; ``fast_accum`` (tensorwise/rowwise) lets the tensor cores
    accumulate all of K, as torch's use_fast_accum. A tensorwise x_q quantized in groups has one
    scale per entry of group_sizes. Example (rowwise fprop of y = x @ w[g]^T, w [G, N, K])::

        m_grouped_mm(quantize_fp8(x, "rowwise", group_sizes=gs), quantize_fp8(w, "rowwise"), gs)
    """
    if _quantized("m_grouped_mm", ("x", "w"), x, w):
        return _m_grouped_mm_fp8(x, w, group_sizes, transpose_w, out_dtype, group_offset, fast_accum, backend)
    if fast_accum:
        raise ValueError("m_grouped_mm: fast_accum is an FP8 option; x and w are in high precision")
    transpose_w = bool(transpose_w)
    x, w = jnp.asarray(x), jnp.asarray(w)
    dtype = _float_dtype("x", x.dtype)
    if _float_dtype("w", w.dtype) != dtype:
        raise TypeError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    K_w = w.shape[2] if transpose_w and w.ndim == 3 else (w.shape[1] if w.ndim == 3 else None)
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != K_w:
        layout = "[G, N, K] (transpose_w=True)" if transpose_w else "[G, K, N]"
        raise ValueError(
            f"m_grouped_mm expects x [M, K] and w {layout} with matching K; got x {x.shape}, w {w.shape}"
        )
    out_dtype = _float_dtype("out_dtype", dtype if out_dtype is None else out_dtype)
    group_sizes = _group_sizes(group_sizes, None if group_offset is not None else w.shape[0], x.shape[0])
    group_offset = _group_offset(group_offset, w.shape[0], group_sizes.shape[0])
    executor = _executor(backend)
    if executor is None:
        return reference.m_grouped_mm_reference(
            x, w, group_sizes, transpose_w=transpose_w, group_offset=group_offset, out_dtype=out_dtype
        )
    return _ops.m_grouped_mm(x, w, group_sizes, group_offset, None, out_dtype, transpose_w, executor, None)


def _m_grouped_mm_fp8(x_q, w_q, group_sizes, transpose_w, out_dtype, group_offset, fast_accum, backend):
    if x_q.is_weight or not w_q.is_weight:
        raise ValueError(
            f"m_grouped_mm expects quantized activations [M, K] and a quantized weight [G, N, K]; got "
            f"{x_q.shape} and {w_q.shape}"
        )
    K = x_q.shape[1]
    if transpose_w is False:
        if w_q.data_t is None:
            raise ValueError(
                "m_grouped_mm(transpose_w=False) reads the weight's transposed copy (K-major, as FP8 tensor "
                "cores need): quantize w with transpose=True"
            )
        w_data, w_scale = w_q.data_t, w_q.scale_t
    else:
        w_data, w_scale = w_q.data, w_q.scale
    # The weight's rows may be padded storage (a transposed copy): [G, N, padded(K)].
    if w_data.shape[2] not in (K, fp8.padded(K)):
        raise ValueError(
            f"m_grouped_mm: x_q [M, K] = {x_q.shape} and the weight's K-major copy {tuple(w_data.shape)} "
            "[G, N, K] differ in K"
        )
    G = w_data.shape[0]
    sizes = _group_sizes(group_sizes, None if group_offset is not None else G, x_q.shape[0])
    offset = _group_offset(group_offset, G, sizes.shape[0])
    if x_q.recipe == "tensorwise" and x_q.scale.size not in (1, sizes.shape[0]):
        raise ValueError(
            f"tensorwise x_q has {x_q.scale.size} group scales but group_sizes has {sizes.shape[0]} entries"
        )
    out_dtype = _float_dtype("out_dtype", jnp.bfloat16 if out_dtype is None else out_dtype)
    return _ops.m_grouped_fp8(
        x_q.data, x_q.scale, w_data, w_scale, sizes, offset, x_q.recipe, out_dtype, _executor(backend),
        fast_accum,
    )  # fmt: skip


def k_grouped_mm(
    a: jax.Array | Fp8Array,
    b: jax.Array | Fp8Array,
    group_sizes: jax.Array | None = None,
    *,
    accumulate: jax.Array | None = None,
    out_dtype=jnp.float32,
    group_offset: jax.Array | None = None,
    num_groups: int | None = None,
    fast_accum: bool = False,
    backend: Backend = "auto",
) -> jax.Array:
    """k-grouped GEMM (weight gradient): ``for g: out[g] = (accumulate[g] +) a[rows(g)]^T @ b[rows(g)]``.

    a [M, K] and b [M, N] in one float dtype; group_sizes [G] integer. Returns [G, K, N] in
    ``out_dtype`` (fp32 default, bf16/fp16 allowed), fp32 accumulation; a group with no rows gives
    exact zeros. ``accumulate=`` an fp32 [G, K, N] buffer returns buffer + a^T b (the Megatron
    main_grad convention, functionally); on GPU the buffer is aliased to the output, so donating it
    under jit updates it in place. Differentiable in a, b and the buffer.
    Expert parallelism: with ``group_offset`` (int32 scalar on the device) and ``num_groups`` (static),
    group_sizes covers all G_total groups and out [num_groups, K, N] holds groups
    [offset, offset + num_groups), their rows read in place.

    Quantized a and b (both :class:`Fp8Array`, not differentiable): activations quantized with
    ``transpose=True`` and the same group sizes (their transposed copies are laid out by them; the
    kernel reads those); ``group_sizes`` None means a's. For dW of y = x @ w^T:
    ``k_grouped_mm(dy_q, x_q, None)`` gives [G, N, K]. ``fast_accum`` as in :func:`m_grouped_mm`.
    """
    if _quantized("k_grouped_mm", ("a", "b"), a, b):
        return _k_grouped_mm_fp8(
            a, b, group_sizes, accumulate, out_dtype, group_offset, num_groups, fast_accum, backend
        )
    if fast_accum:
        raise ValueError("k_grouped_mm: fast_accum is an FP8 option; a and b are in high precision")
    if group_sizes is None:
        raise ValueError("k_grouped_mm: group_sizes is required for high-precision operands")
    a, b = jnp.asarray(a), jnp.asarray(b)
    dtype = _float_dtype("a", a.dtype)
    if _float_dtype("b", b.dtype) != dtype:
        raise TypeError(f"a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(
            f"k_grouped_mm expects a [M, K] and b [M, N] with the same M; got a {a.shape}, b {b.shape}"
        )
    group_sizes = _group_sizes(group_sizes, None, a.shape[0])
    num_groups, group_offset = _local_groups(group_offset, num_groups, group_sizes.shape[0])
    G, K, N = num_groups, a.shape[1], b.shape[1]
    out_dtype = _float_dtype("out_dtype", out_dtype)
    if accumulate is not None:
        accumulate = _accumulate_buffer(accumulate, (G, K, N), "[G, K, N]")
        out_dtype = accumulate.dtype
    executor = _executor(backend)
    if executor is None:
        return reference.k_grouped_mm_reference(
            a, b, group_sizes, c=accumulate, group_offset=group_offset, num_groups=G, out_dtype=out_dtype
        )
    return _ops.k_grouped_mm(a, b, group_sizes, group_offset, accumulate, out_dtype, G, executor)


def _k_grouped_mm_fp8(
    a_q, b_q, group_sizes, accumulate, out_dtype, group_offset, num_groups, fast_accum, backend
):
    if a_q.is_weight or b_q.is_weight or a_q.shape[0] != b_q.shape[0]:
        raise ValueError(
            f"k_grouped_mm expects quantized activations [M, Ka] and [M, Nb]; got {a_q.shape} and {b_q.shape}"
        )
    if a_q.data_t is None or b_q.data_t is None:
        raise ValueError(
            "k_grouped_mm reads the transposed copies: quantize both operands with transpose=True"
        )
    if a_q.group_sizes is None or b_q.group_sizes is None or a_q.group_sizes.shape != b_q.group_sizes.shape:
        raise ValueError(
            "k_grouped_mm: quantize a and b with the same group_sizes (their transposed copies are laid out "
            "group by group)"
        )
    sizes = _group_sizes(
        a_q.group_sizes if group_sizes is None else group_sizes, a_q.group_sizes.shape[0], a_q.shape[0]
    )
    num_groups, offset = _local_groups(group_offset, num_groups, sizes.shape[0])
    M, K, N = a_q.shape[0], a_q.shape[1], b_q.shape[1]
    out_dtype = _float_dtype("out_dtype", out_dtype)
    if accumulate is not None:
        accumulate = _accumulate_buffer(accumulate, (num_groups, K, N), "[G, Ka, Nb]")
        out_dtype = accumulate.dtype
    return _ops.k_grouped_fp8(
        M, a_q.data_t, a_q.scale_t, b_q.data_t, b_q.scale_t, sizes, offset, accumulate, num_groups,
        a_q.recipe, out_dtype, _executor(backend), fast_accum,
    )  # fmt: skip
