"""Public JAX entry points: argument checks and backend dispatch.

Backends: ``"triton"`` runs the Triton kernels on the GPU through jax-triton; ``"interpret"`` runs
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

from typing import Literal

import jax
import jax.numpy as jnp

from moegemm._src.jax import interpret as _interpret
from moegemm._src.jax import jax_triton as _jax_triton
from moegemm._src.jax import ops as _ops
from moegemm._src.jax.launch import Executor
from moegemm.jax import reference

Backend = Literal["auto", "triton", "interpret", "reference"]
BACKENDS = ("auto", "triton", "interpret", "reference")
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_EXECUTORS = {executor.name: executor for executor in (_jax_triton.EXECUTOR, _interpret.EXECUTOR)}


def _executor(backend: str) -> Executor | None:
    """The executor that serves ``backend`` (None: the reference); raises if it cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
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
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {dtype}")
    return dtype


def _group_sizes(group_sizes, G: int | None) -> jax.Array:
    group_sizes = jnp.asarray(group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer array, got {group_sizes.dtype}")
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must be 1-D [G], got shape {group_sizes.shape}")
    if G is not None and group_sizes.shape[0] != G:
        raise ValueError(f"group_sizes has {group_sizes.shape[0]} entries but the weight has G={G} groups")
    return group_sizes.astype(jnp.int32)


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
    return group_offset.reshape(()).astype(jnp.int32)


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


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    precision=None,
    preferred_element_type=None,
    group_offset: jax.Array | None = None,
    out_sharding=None,
    *,
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
    """
    del precision
    if out_sharding is not None:
        raise NotImplementedError("out_sharding is not supported; shard with shard_map around ragged_dot")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"ragged_dot expects lhs [M, K] and rhs [G, K, N] with matching K; got lhs {lhs.shape}, "
            f"rhs {rhs.shape}"
        )
    dtype = _float_dtype("lhs and rhs", jnp.result_type(lhs, rhs))
    lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
    out_dtype = _float_dtype(
        "preferred_element_type", dtype if preferred_element_type is None else preferred_element_type
    )
    G = rhs.shape[0]
    group_sizes = _group_sizes(group_sizes, None if group_offset is not None else G)
    group_offset = _group_offset(group_offset, G, group_sizes.shape[0])
    executor = _executor(backend)
    if executor is None:
        return reference.ragged_dot_reference(
            lhs, rhs, group_sizes, group_offset=group_offset, out_dtype=out_dtype
        )
    # With group_offset the kernel reads and writes the local groups' rows in place and zero-fills
    # the others in the same launch: no row copies on the expert-parallel path.
    return _ops.m_grouped_mm(lhs, rhs, group_sizes, group_offset, out_dtype, False, executor)


def m_grouped_mm(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_w: bool = False,
    out_dtype=None,
    group_offset: jax.Array | None = None,
    backend: Backend = "auto",
) -> jax.Array:
    """m-grouped GEMM (forward and dgrad): ``for g: out[rows(g)] = x[rows(g)] @ W[g]``.

    x [M, K] and w in one dtype (bf16/fp16/fp32). W = w [G, K, N]; with ``transpose_w=True`` w is
    stored [G, N, K] (nn.Linear layout) and W[g] = w[g].T is read through swapped strides, no copy.
    group_sizes [G] integer, on the device. Returns [M, N] in ``out_dtype`` (default x.dtype), fp32
    accumulation; rows at or past sum(group_sizes) are 0. Differentiable in x and w (our kernels).
    ``group_offset`` (int32 scalar on the device): expert parallelism as in :func:`ragged_dot`.
    """
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
    group_sizes = _group_sizes(group_sizes, None if group_offset is not None else w.shape[0])
    group_offset = _group_offset(group_offset, w.shape[0], group_sizes.shape[0])
    executor = _executor(backend)
    if executor is None:
        W = jnp.swapaxes(w, 1, 2) if transpose_w else w
        return reference.m_grouped_mm_reference(
            x, W, group_sizes, group_offset=group_offset, out_dtype=out_dtype
        )
    return _ops.m_grouped_mm(x, w, group_sizes, group_offset, out_dtype, transpose_w, executor)


def k_grouped_mm(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    *,
    accumulate: jax.Array | None = None,
    out_dtype=jnp.float32,
    group_offset: jax.Array | None = None,
    num_groups: int | None = None,
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
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    dtype = _float_dtype("a", a.dtype)
    if _float_dtype("b", b.dtype) != dtype:
        raise TypeError(f"a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(
            f"k_grouped_mm expects a [M, K] and b [M, N] with the same M; got a {a.shape}, b {b.shape}"
        )
    group_sizes = _group_sizes(group_sizes, None)
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
