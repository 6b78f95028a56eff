"""Peers of the expert-block benchmark that live in other packages: framework glue only, no kernels.

Each loader returns ``block(x, ids, weights, w13, w2) -> out`` in moegemm's layout, differentiable by autograd
with respect to x, weights, w13 and w2, or raises ``moegemm.bench.moe.Unavailable`` naming why it cannot run:

    x [T, d]; ids int32 [T, k]; weights [T, k] (any float dtype);
    w13 [E, 2n, d] (rows [0, n) gate, [n, 2n) up); w2 [E, d, n]; out [T, d] in x's dtype.
    out[t] = sum_j weights[t, j] * w2[e] @ (silu(w13[e, :n] @ x[t]) * (w13[e, n:] @ x[t])),  e = ids[t, j]

None of them is in the benchmark machine's image: they travel as wheels (``.lab/install_peers.sh``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _unavailable(reason: str) -> Exception:
    from moegemm.bench.moe import Unavailable  # lazily: moe.py imports this module

    return Unavailable(reason)


# ---------------------------------------------------------------- SonicMoE


def to_sonic_interleaved(w13: torch.Tensor) -> torch.Tensor:
    """[E, 2n, d] (gate rows, then up rows) -> [E, 2n, d] with rows (gate_0, up_0, gate_1, up_1, ...):
    SonicMoE's own parameter layout (``sonicmoe.moe.Experts`` with ``concat_layout=False``). A copy.
    ``out[:, 2i] = w13[:, i]; out[:, 2i + 1] = w13[:, n + i]``."""
    E, two_n, d = w13.shape
    return w13.view(E, 2, two_n // 2, d).transpose(1, 2).reshape(E, two_n, d)


def from_sonic_interleaved(w: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_sonic_interleaved``: interleaved rows back to (gate rows, then up rows). A copy."""
    E, two_n, d = w.shape
    return w.view(E, two_n // 2, 2, d).transpose(1, 2).reshape(E, two_n, d)


def sonic_weight_views(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [2n, d, E], w2 [d, n, E]): views of the [E, ...] weights with the experts outermost in memory, the
    layout ``sonicmoe.functional`` takes ("shape (2I, H, E), stride order (2, 0, 1)"; ``MoE.forward`` passes
    ``weight.permute(1, 2, 0)`` of its [E, out, in] parameters the same way). No copy."""
    return w13.permute(1, 2, 0), w2.permute(1, 2, 0)


class _Interleaved(torch.autograd.Function):
    """w13 -> its interleaved copy made beforehand (``native``), as a view of ``native``; the gradient goes
    back through ``from_sonic_interleaved`` (a copy of dw13, in the backward)."""

    @staticmethod
    def forward(ctx, w13, native):
        return native.view_as(native)

    @staticmethod
    def backward(ctx, grad):
        return from_sonic_interleaved(grad), None


def sonicmoe(layout: str = "concat", routing: str = "topk") -> Callable:
    """SonicMoE's expert block (Dao-AILab/sonic-moe, ``sonicmoe.functional``; QuACK grouped GEMMs in CuTe
    DSL): fc1 gathers x's rows and applies SwiGLU in its epilogue (``gemm_gated``), fc2 (``gemm``), then a
    Triton gather-and-sum of the k weighted rows of each token; the backward is fc2's dgrad with the SwiGLU
    backward and dweights in its epilogue (``gemm_dgated``), the two weight gradients (``gemm`` over varlen K)
    and fc1's dgrad.
    Both fc1 activations (pre- and post-SwiGLU) are kept for the backward.

    ``routing``:
      - "topk": the path of ``moe_TC_softmax_topk_layer`` (the one SonicMoE benchmarks) less its router GEMM
        and softmax-top-k: ``TC_topk_router_metadata_triton(ids)`` then its ``_UpProjection`` and
        ``_DownProjection`` autograd functions with fixed K (module-private names of sonic-moe 0.1.2.post1).
      - "general": the public ``moe_general_routing_inputs`` (any number of experts per token): the same
        GEMMs, plus a per-token offset search and a variable-K gather.
    ``layout``:
      - "concat": w13's rows as they are (gate then up: SonicMoE's ``concat_layout=True``); the weights and
        their gradients are views, nothing is copied anywhere.
      - "interleaved": SonicMoE's default layout (``to_sonic_interleaved``), copied once per (w13, version)
        and kept outside the call (a second copy of w13 held); in the timed path only dw13's copy back
        (``from_sonic_interleaved``) in the backward, which a model holding the interleaved parameter would
        not pay.

    The routing weights enter as fp32 (``weights.float()``, in the call: SonicMoE's scores are fp32; the
    cast's backward rounds dweights to the weights' dtype). QuACK autotunes and compiles its GEMMs per new
    shape (its autotune key holds the operands' shapes, so T too; reported ~50 s per new T), in memory per
    process; its compiled objects persist under ``QUACK_CACHE_DIR`` (default ``$TMPDIR/$USER/quack_cache``)
    and, with ``QUACK_CACHE_AUTOTUNING=1``, its tuning results too (``QUACK_CACHE_DIR``, else
    ``~/.quack/cache``)."""
    if layout not in ("concat", "interleaved"):
        raise ValueError(f"sonicmoe: layout {layout!r}; one of 'concat', 'interleaved'")
    if routing not in ("topk", "general"):
        raise ValueError(f"sonicmoe: routing {routing!r}; one of 'topk', 'general'")
    if not torch.cuda.is_available():
        raise _unavailable("SonicMoE runs CuTe DSL kernels on CUDA only (no CUDA here)")
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        raise _unavailable(f"SonicMoE needs sm_90 or newer (device is sm_{major}x)")
    try:
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import _DownProjection, _UpProjection, moe_general_routing_inputs
        from sonicmoe.functional.triton_kernels import TC_topk_router_metadata_triton
    except Exception as exc:  # ImportError, or cutlass' RuntimeError on a missing CUDA-toolkit flavour
        raise _unavailable(f"sonicmoe does not import: {type(exc).__name__}: {exc}") from None

    swiglu = ActivationType.SWIGLU
    native_cache: dict = {}

    def expert_weights(w13: torch.Tensor) -> torch.Tensor:
        if layout == "concat":
            return w13
        key = (w13.data_ptr(), w13._version, tuple(w13.shape))
        if key not in native_cache:
            native_cache.clear()
            native_cache[key] = to_sonic_interleaved(w13.detach()).contiguous()
        return _Interleaved.apply(w13, native_cache[key])

    def block(x, ids, weights, w13, w2):
        T, k = ids.shape
        E = w13.shape[0]
        w1, w2s = sonic_weight_views(expert_weights(w13), w2)
        scores = weights.float().contiguous()
        concat = layout == "concat"
        if routing == "general":
            stream = torch.cuda.current_stream().cuda_stream
            token = torch.arange(T, device=ids.device, dtype=torch.int32).repeat_interleave(k)
            out, _ = moe_general_routing_inputs(
                x, scores.reshape(-1), token, ids.reshape(-1), w1, None, w2s, None, E, stream, swiglu,
                False, concat,
            )  # fmt: skip
            return out
        TK = T * k
        dev = ids.device
        s_scatter = torch.empty(TK, dtype=torch.int32, device=dev)
        s_reverse = torch.empty(TK, dtype=torch.int32, device=dev)
        freq = torch.empty(E, dtype=torch.int32, device=dev)
        offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
        gather = torch.empty(TK, dtype=torch.int32, device=dev)
        TC_topk_router_metadata_triton(
            ids.to(torch.int32).contiguous(), E, freq, offsets, gather, s_scatter, s_reverse
        )
        a, h = _UpProjection.apply(
            x, w1, None, offsets, TK, k, gather, s_scatter, s_reverse, None, False, swiglu, False, concat
        )
        return _DownProjection.apply(
            a, h, w2s, None, scores, offsets, T, k, gather, s_scatter, s_reverse, None, False, swiglu
        )

    block.version = _version("sonic-moe")  # type: ignore[attr-defined]
    return block


# ---------------------------------------------------------------- Liger-Kernel


def liger() -> Callable:
    """Liger-Kernel's fused MoE (``liger_kernel.ops.fused_moe.LigerFusedMoEFunction``, Triton): takes
    moegemm's layout as it is (gate_up_proj [E, 2n, d] gate rows first, down_proj [E, d, n], ids int32).

    Autotuning is on unless LIGER_FUSED_MOE_AUTOTUNE is 0/false/no, read when liger_kernel is first imported.
    Its ``triton.autotune`` keys are (H_dim, I_dim) (the token gather adds K_dim) and the dtypes, never T or
    E: the first call at a (d, n) tunes it for every T after it in the process. Triton keeps the result in
    memory; with TRITON_CACHE_AUTOTUNING=1 set before the import, also on disk under TRITON_CACHE_DIR, read
    back by later processes (and by any T there too). Its routing metadata syncs once per forward (``.item()``
    of the tile count)."""
    if not torch.cuda.is_available():
        raise _unavailable("Liger's fused MoE runs Triton kernels on CUDA only (no CUDA here)")
    try:
        from liger_kernel.ops import fused_moe_kernels
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as exc:
        raise _unavailable(f"liger_kernel.ops.fused_moe does not import: {exc}") from None

    def block(x, ids, weights, w13, w2):
        return LigerFusedMoEFunction.apply(x, w13, w2, ids, weights)

    block.version = _version("liger-kernel")  # type: ignore[attr-defined]
    block.autotune = not fused_moe_kernels._AUTOTUNE_DISABLED  # type: ignore[attr-defined]
    return block
