"""The JAX glue of the expert block (``moegemm.jax.moe``): routing metadata, the fused launches, the custom_vjp.

The same kernels, launches and saved values as the PyTorch glue (``moegemm._src.torch.moe``; docs/design.md,
'Fused expert block')::

    forward   z, h = fc1(x[gather] @ w13[e]^T) with the SwiGLU epilogue     (m-grouped, GATHER, "swiglu")
              y    = h @ w2[e]^T                                             (m-grouped, plain)
              out  = combine(y, pos, topk_weights)                           (combine)
    backward  dz, hs = s * h, ds = fc2's dgrad dout[gather] @ w2[e]           (m-grouped, GATHER, "swiglu_bwd")
              dw2  = dout[gather]^T @ hs,  dw13 = dz^T @ x[gather]            (k-grouped, GATHER_A / GATHER_B)
              dx   = combine(dz @ w13[e], pos)                               (m-grouped, combine)
              dtopk_weights[t, j] = sum over ds's column tiles of row pos[t, j]

The backward keeps x, z [R, 2n] and the integer routing metadata (``Routing``). Launches are ``KernelCall``s run
by the resolved ``Executor`` (GPU or interpreter); inputs are validated by ``moegemm.jax.moe``.

The executors append every output after the inputs, so a launch's outputs must be the kernel's last pointer
parameters. fc1 writes z through ``act_ptr`` (before row_scale, act_out and ds): those three slots become
one-element outputs the "swiglu" epilogue never touches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton

from moegemm._src import plan
from moegemm._src.jax import launch as _launch
from moegemm._src.jax import ops as _ops
from moegemm._src.jax.launch import Executor, KernelCall, Target
from moegemm._src.kernels import combine as combine_kernels
from moegemm._src.kernels.k_grouped import k_grouped_mm_kernel
from moegemm._src.kernels.m_grouped import m_grouped_mm_kernel
from moegemm._src.moe import Routing


def routing(topk_ids: jax.Array, topk_weights: jax.Array, E: int, expert_base=None) -> Routing:
    """``Routing`` of topk_ids [T, k] and topk_weights [T, k] over E experts: a stable argsort, counts by
    scatter-add, the inverse permutation by scatter (shapes static, so it runs under jit).

    ``expert_base`` (expert parallelism, docs/design.md, 'Expert parallelism'; None, a Python int or a traced
    int32 scalar such as ``axis_index * E`` under shard_map): the E experts are [expert_base, expert_base + E) of
    a larger set and a choice of any other expert is absent, as in the PyTorch glue: its row sorts after every
    group (rows past sum(group_sizes), which no launch reads or writes), its pos is -1 (the combine skips it)
    and its row_scale 0."""
    T, k = topk_ids.shape
    R = T * k
    absent = None
    if expert_base is None:
        flat = jnp.clip(topk_ids.reshape(-1), 0, max(E - 1, 0)).astype(jnp.int32)
    else:
        local = topk_ids.reshape(-1).astype(jnp.int32) - jnp.asarray(expert_base, jnp.int32)
        absent = (local < 0) | (local >= E)
        flat = jnp.where(absent, E, local)  # key E: after every group
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    # Bin E counts the absent choices and is dropped (the scatter's explicit home, not an out-of-bounds index).
    group_sizes = jnp.zeros(E + 1, jnp.int32).at[flat].add(1)[:E]
    gather = order // max(k, 1)
    pos = jnp.zeros(R, jnp.int32).at[order].set(jnp.arange(R, dtype=jnp.int32))
    weights = topk_weights.reshape(-1).astype(jnp.float32)
    weights = jnp.where(jnp.isfinite(weights), weights, 0.0)
    if absent is not None:
        pos = jnp.where(absent, -1, pos)
        weights = jnp.where(absent, 0.0, weights)
    return Routing(gather, pos.reshape(T, k), group_sizes, weights[order])


# ---------------------------------------------------------------- launches (KernelCalls)


def _fused_plan(
    op, M, N, K, G, dtype, max_stride, k_contiguous, gather, epilogue, target: Target, fill_tail=True
) -> plan.Plan:
    """The plan of one of the block's launches, with the PyTorch glue's Problem (``_fused_launch``); fill_tail
    False: the rows past the groups are left unwritten (the expert-parallel local step's absent rows)."""
    problem = plan.Problem(
        op,
        M,
        N,
        K,
        G,
        jnp.dtype(dtype).name,
        out_itemsize=jnp.dtype(dtype).itemsize,
        max_stride=max_stride,
        w_k_contiguous=k_contiguous if op == plan.M_GROUPED else False,
        a_k_contiguous=k_contiguous if op == plan.K_GROUPED else True,
        gather=gather,
        epilogue=epilogue,
        fill_tail=fill_tail,
    )
    return _launch._plan(problem, target)


def _m_sizes(M, N, K, G, w_strides, stride_om) -> dict:
    stride_wg, stride_wk, stride_wn = w_strides
    return dict(
        M=M,
        N=N,
        K=K,
        G=G,
        G_TOTAL=G,
        stride_xm=K,
        stride_xk=1,
        stride_wg=stride_wg,
        stride_wk=stride_wk,
        stride_wn=stride_wn,
        stride_om=stride_om,
        stride_on=1,
        stride_bg=0,
        stride_bn=0,
    )


def _unused(dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    """A one-element output filling a pointer slot the launch never writes (module docstring)."""
    return jax.ShapeDtypeStruct((1,), jnp.dtype(dtype))


def fc1_call(x: jax.Array, w13: jax.Array, r: Routing, target: Target, fill_tail: bool = True) -> KernelCall:
    """z [R, 2n] and h [R, n] = silu(z[:, :n]) * z[:, n:], z = x[gather[rows(e)]] @ w13[e]^T per expert e.
    Outputs (z, 3 unused, h)."""
    (R,), (_, d), (E, two_n, _) = r.gather.shape, x.shape, w13.shape
    w_strides = (two_n * d, 1, d)  # w13 [E, 2n, d] read as W [E, d, 2n]
    chosen = _fused_plan(
        plan.M_GROUPED, R, two_n, d, E, x.dtype, max(d, two_n // 2, 1), d != 1, ("x",), "swiglu", target,
        fill_tail,
    )  # fmt: skip
    args = (x, w13, r.group_sizes, r.group_sizes, x, r.gather)  # no group offset, no bias
    outs = (
        jax.ShapeDtypeStruct((R, two_n), x.dtype),  # act: z
        _unused(),  # row_scale
        _unused(x.dtype),  # act_out
        _unused(),  # ds
        jax.ShapeDtypeStruct((R, two_n // 2), x.dtype),  # out: h
    )
    meta = {**chosen.meta, **_m_sizes(R, two_n, d, E, w_strides, two_n // 2)}
    return KernelCall(m_grouped_mm_kernel, chosen.grid, args, outs, meta, {})


def rows_call(a: jax.Array, w: jax.Array, w_strides, N: int, r: Routing, target: Target) -> KernelCall:
    """out [R, N] = a[rows(e)] @ W[e] per expert e, W[e] [K, N] read from w with ``w_strides`` (group, K, N);
    the rows past the groups are left unwritten (the expert-parallel local step's fc2 and dx rows, whose absent
    rows nothing reads). Outputs (4 unused, out)."""
    (R, K), E = a.shape, r.group_sizes.shape[0]
    chosen = _fused_plan(
        plan.M_GROUPED, R, N, K, E, a.dtype, max(K, N, 1), w_strides[1] == 1, (), "", target, False
    )
    args = (a, w, r.group_sizes, r.group_sizes, a, r.group_sizes)  # no offset, bias or gather
    outs = (_unused(), _unused(), _unused(a.dtype), _unused(), jax.ShapeDtypeStruct((R, N), a.dtype))
    meta = {**chosen.meta, **_m_sizes(R, N, K, E, w_strides, N)}
    return KernelCall(m_grouped_mm_kernel, chosen.grid, args, outs, meta, {})


def fc2_dgrad_call(
    dout: jax.Array, w2: jax.Array, z: jax.Array, r: Routing, target: Target, fill_tail: bool = True
) -> KernelCall:
    """fc2's dgrad with the SwiGLU backward: dh = dout[gather[rows(e)]] @ w2[e] [R, n]; outputs (hs = s * h
    [R, n], ds [cdiv(n, BLOCK_N), R] fp32 = per-column-tile sums of dh * h, dz [R, 2n]), s = row_scale,
    BLOCK_N the plan's."""
    (R,), (_, d), (E, _, n) = r.gather.shape, dout.shape, w2.shape
    chosen = _fused_plan(
        plan.M_GROUPED,
        R,
        n,
        d,
        E,
        dout.dtype,
        max(d, 2 * n, 1),
        False,
        ("x",),
        "swiglu_bwd",
        target,
        fill_tail,
    )
    args = (dout, w2, r.group_sizes, r.group_sizes, dout, r.gather, z, r.row_scale)
    outs = (
        jax.ShapeDtypeStruct((R, n), dout.dtype),  # act_out: hs
        jax.ShapeDtypeStruct((triton.cdiv(n, chosen.meta["BLOCK_N"]), R), jnp.float32),  # ds
        jax.ShapeDtypeStruct((R, 2 * n), dout.dtype),  # out: dz
    )
    meta = {**chosen.meta, **_m_sizes(R, n, d, E, (d * n, n, 1), 2 * n)}
    return KernelCall(m_grouped_mm_kernel, chosen.grid, args, outs, meta, {})


def wgrad_call(
    a: jax.Array,
    b: jax.Array,
    r: Routing,
    out_dtype,
    target: Target,
    *,
    gather_a: bool = False,
    gather_b: bool = False,
) -> KernelCall:
    """out [E, K, N] = for e: A[rows(e)]^T @ B[rows(e)], A's row r = a[gather[r]] with ``gather_a`` (else a[r]),
    B's likewise; an expert with no rows gets exact zeros."""
    (M,), K, N, G = r.gather.shape, a.shape[1], b.shape[1], r.group_sizes.shape[0]
    gather = (("a",) if gather_a else ()) + (("b",) if gather_b else ())
    chosen = _fused_plan(plan.K_GROUPED, M, N, K, G, a.dtype, max(K, N, 1), K != 1, gather, "", target)
    assert chosen.meta["SPLIT_R"] == 1, "plan.JAX has no workspace: no split rows"
    args = (
        a,
        b,
        r.group_sizes,
        r.group_sizes,  # no group offset
        a,  # no accumulation
        a,  # no column sums
        r.gather if gather_a else r.group_sizes,
        r.gather if gather_b else r.group_sizes,
    )
    sizes = dict(M=M, N=N, K=K, G=G, G_TOTAL=G, stride_am=K, stride_ak=1, stride_bm=N, stride_bn=1)
    sizes |= dict(stride_og=K * N, stride_ok=N, stride_on=1, stride_sg=0, stride_sk=0)
    out = jax.ShapeDtypeStruct((G, K, N), jnp.dtype(out_dtype))
    return KernelCall(k_grouped_mm_kernel, chosen.grid, args, out, {**chosen.meta, **sizes}, {})


def combine_call(rows: jax.Array, pos: jax.Array, weight: jax.Array | None, out_dtype) -> KernelCall:
    """out [T, D] = for t: sum_j weight[t, j] * rows[pos[t, j]] (weight None: 1), j in order (deterministic)."""
    (T, k), (R, D) = pos.shape, rows.shape
    meta = dict(
        T=T,
        R=R,
        D=D,
        TOP_K=k,
        stride_rm=D,
        stride_om=D,
        HAS_WEIGHT=weight is not None,
        BLOCK_T=combine_kernels.BLOCK_T,
        BLOCK_D=combine_kernels.BLOCK_D,
        num_warps=combine_kernels.NUM_WARPS,
    )
    args = (rows, pos, pos if weight is None else weight)
    out = jax.ShapeDtypeStruct((T, D), jnp.dtype(out_dtype))
    return KernelCall(combine_kernels.combine_kernel, combine_kernels.grid(T, D), args, out, meta, {})


# ---------------------------------------------------------------- forward and backward


def _empty(T: int, d: int, n: int, E: int, k: int) -> bool:
    """No launch has work: no rows (T * k = 0), or an empty hidden or expert dimension."""
    return T * k == 0 or d == 0 or n == 0 or E == 0


def _forward(x, topk_ids, topk_weights, w13, w2, expert_base, executor: Executor):
    """(out [T, d], z [R, 2n], Routing)."""
    (T, d), (E, two_n, _), k = x.shape, w13.shape, topk_ids.shape[1]
    r = routing(topk_ids, topk_weights, E, expert_base)
    if _empty(T, d, two_n // 2, E, k):
        return jnp.zeros((T, d), x.dtype), jnp.zeros((T * k, two_n), x.dtype), r
    target = executor.target()
    # With absent rows (expert_base) nothing reads the rows past the groups: no launch writes them.
    fill = expert_base is None
    z, *_, h = executor.run(fc1_call(x, w13, r, target, fill))
    if fill:
        y = _ops._m_grouped_mm_impl(h, w2, r.group_sizes, None, x.dtype, True, executor)
    else:  # w2 [E, d, n] read as W [E, n, d]
        y = executor.run(rows_call(h, w2, (d * two_n // 2, 1, two_n // 2), d, r, target))[-1]
    out = executor.run(combine_call(y, r.pos, topk_weights, x.dtype))
    return out, z, r


def _backward(dout, x, topk_weights, w13, w2, z, r: Routing, executor: Executor, absent: bool = False):
    """(dx, dtopk_weights, dw13, dw2); absent: the forward had absent rows (expert_base), which the launches
    leave unwritten."""
    (T, d), (E, two_n, _), k = x.shape, w13.shape, r.pos.shape[1]
    if _empty(T, d, two_n // 2, E, k):
        return (
            jnp.zeros_like(x),
            jnp.zeros_like(topk_weights),
            jnp.zeros_like(w13),
            jnp.zeros_like(w2),
        )
    target = executor.target()
    dout = dout.astype(x.dtype)  # the kernels take one operand dtype
    hs, ds, dz = executor.run(fc2_dgrad_call(dout, w2, z, r, target, not absent))
    dw2 = executor.run(wgrad_call(dout, hs, r, w2.dtype, target, gather_a=True))
    dw13 = executor.run(wgrad_call(dz, x, r, w13.dtype, target, gather_b=True))
    if absent:  # w13 [E, 2n, d] is W [E, 2n, d]
        dx_rows = executor.run(rows_call(dz, w13, (two_n * d, d, 1), d, r, target))[-1]
    else:
        dx_rows = _ops._m_grouped_mm_impl(dz, w13, r.group_sizes, None, x.dtype, False, executor)
    dx = executor.run(combine_call(dx_rows, r.pos, None, x.dtype))
    # The routing weights' gradient <dout[t], y_row>: the fc2 dgrad epilogue's per-tile sums, added in tile order.
    # An absent choice (pos -1, expert parallelism) has no row: its gradient is 0, not row -1's (no wrap).
    flat_pos = r.pos.reshape(-1)
    dweights = jnp.where(flat_pos >= 0, ds.sum(0)[jnp.maximum(flat_pos, 0)], 0.0).reshape(T, k)
    # A non-finite weight counts as the constant 0 in the forward, so its gradient is 0 (as the reference twin's).
    dweights = jnp.where(jnp.isfinite(topk_weights), dweights, 0.0)
    return dx, dweights.astype(topk_weights.dtype), dw13, dw2


def _varying(a: jax.Array) -> set:
    """The manual mesh axes ``a`` varies over (jax 0.10: ``manual_axis_type.varying``; older: ``vma``)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)
    return set(mat.varying) if mat is not None else set(getattr(aval, "vma", ()))


def _vary(out: jax.Array, axes: set) -> jax.Array:
    """``out`` varying over ``axes`` too (shard_map's type check, expert parallelism, docs/design.md, 'Expert
    parallelism'): a launch's outputs (a pure_callback's, a custom call's) vary over no axis, yet depend on every
    input."""
    missing = tuple(sorted(axes - _varying(out)))
    return jax.lax.pcast(out, missing, to="varying") if missing else out


def _all_varying(*arrays) -> set:
    return set().union(*(_varying(a) for a in arrays if a is not None))


def _cotangent(g: jax.Array, primal: jax.Array, axes: set) -> jax.Array:
    """The cotangent ``g`` of ``primal``, computed per device from inputs varying over ``axes``, with
    ``primal``'s type: summed over the axes ``primal`` does not vary over (the transpose of an invariant value
    used in a varying computation, as JAX's own AD does)."""
    extra = tuple(sorted(axes - _varying(primal)))
    g = _vary(g, axes)
    return jax.lax.psum(g, extra) if extra else g


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def moe_experts(x, topk_ids, topk_weights, w13, w2, expert_base, executor: Executor):
    """The block's out [T, d] (``moegemm.jax.moe.moe_experts``), differentiable in x, topk_weights, w13, w2.
    ``expert_base``: None, or an int32 scalar array (traced under shard_map: an operand, not a static
    argument): w13 and w2 hold experts [expert_base, expert_base + E) and other choices are absent
    (``routing``), the expert-parallel local step (docs/design.md, 'Expert parallelism')."""
    out = _forward(x, topk_ids, topk_weights, w13, w2, expert_base, executor)[0]
    return _vary(out, _all_varying(x, topk_ids, topk_weights, w13, w2, expert_base))


def _moe_experts_fwd(x, topk_ids, topk_weights, w13, w2, expert_base, executor):
    out, z, r = _forward(x, topk_ids, topk_weights, w13, w2, expert_base, executor)
    out = _vary(out, _all_varying(x, topk_ids, topk_weights, w13, w2, expert_base))
    return out, (x, topk_weights, w13, w2, z, r, expert_base)


def _moe_experts_bwd(executor, residuals, dout):
    x, topk_weights, w13, w2, z, r, expert_base = residuals  # expert_base None (an empty pytree) or an array
    axes = _all_varying(dout, x, topk_weights, w13, w2, *r)  # r: of topk_ids and expert_base
    grads = _backward(dout, x, topk_weights, w13, w2, z, r, executor, expert_base is not None)
    dx, dweights, dw13, dw2 = (_cotangent(g, p, axes) for g, p in zip(grads, (x, topk_weights, w13, w2)))
    return dx, None, dweights, dw13, dw2, None  # integer ids and expert_base: no cotangent


moe_experts.defvjp(_moe_experts_fwd, _moe_experts_bwd)
