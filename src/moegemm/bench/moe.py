"""The expert-block benchmark (``python -m moegemm.bench --moe``): moegemm's fused ``moe_experts`` against its
peers on real MoE shapes, forward and forward+backward (issue 40, 'Benchmark').

Per shape x routing x implementation, in this order:

- correctness: the output and every gradient (x, w13, w2, topk_weights) of one fwd+bwd against an fp32 run of
  ``moegemm.torch.moe_experts_reference`` (fp64 on CPU) on the same inputs and output gradient, by relative
  Frobenius error (``harness.relerr``). An implementation above ``REL_TOL`` on any of them is failed and not timed.
- host syncs of one warm fwd+bwd: the warnings ``torch.cuda.set_sync_debug_mode("warn")`` raises, counted
  ("error" would abort at the first one and count nothing past it).
- peak memory allocated during one fwd+bwd above what was allocated before it (the inputs),
  ``timing.call_with_peak_mb``; the returned gradients are in it (``grads_gib``, the same for every
  implementation). ``activation_gib``: what a forward leaves allocated for its backward, less its output.
- times: the forward (autograd on, as in training) and the fwd+bwd on the headline clock: the in-process
  implementations of a (shape, routing, seed) take turns call by call, the L2 flushed before each call
  (``timing.paired_stats``: median and quartiles); CUPTI device time per call beside it (``timing.device_ms``).
  TF/s from the headline median: a forward is 6*T*k*d*n FLOPs, a fwd+bwd three times that, the backward alone
  (step minus forward) twice. Every (shape, routing) runs on three seeds by default (``--seeds``).

FP8 (``FP8_PEERS``, named with ``--moe-peers``): ``moe_experts(fp8_recipe=)`` per recipe, with the weights' FP8
copies cached across calls (``Fp8WeightCache``: the micro-batches of gradient accumulation after the first) or
made in every call ("-quantize-weights"); gated at ``FP8_REL_TOL``; ``fp8_speedup``: the BF16 ``moegemm``
record's device ms over theirs, same shape and routing.

Implementations are ``(x, ids, weights, w13, w2) -> out`` with autograd (``IMPLS``): moegemm's fused op, the
unfused composition on moegemm's grouped GEMM and on ``torch._grouped_mm`` (torchtitan's GroupedExperts glue),
Liger-Kernel's fused MoE autotuned (its recommended path; it reads LIGER_FUSED_MOE_AUTOTUNE at import, so the
variable is set before anything imports it, and ``liger-autotune-off`` runs in a child process of its own),
SonicMoE live (``moe_peers.sonicmoe``), and SonicMoE's published H100 figures, labelled published (not run).

"moegemm-jax" is ``moegemm.jax.moe_experts`` (``JaxBlock``, ``_measure_jax``), in a child process too (XLA's
allocator keeps what it grows): the same inputs through DLPack, jitted fwd and fwd+bwd timed on device arrays,
the same gate on its outputs as torch tensors; XLA's own peak statistic, no sync count; ``jax_vs_torch``: its
device ms over the fused torch op's. A default CUDA run times it on the skewed routing only (wall time); without
CUDA it runs only when named, under the Triton interpreter (the GPU executor needs a GPU).

Routing (``route``): "balanced" gives every expert exactly T*k/E rows (when E divides T*k; else within one);
"skewed" is softmax top-k over normal logits plus a linear ramp of ``SKEW`` across the experts, weights
renormalised over the k chosen (the anchors' routing); "hot" adds ``HOT_BIAS`` to expert 0's logit, which then
sits in almost every token's top-k.

Without CUDA it is a correctness job on the tiny shapes (moegemm's kernels under the Triton interpreter): nothing
is timed, Liger is skipped, and the exit status is 1 on a failed check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

# ---------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One expert block: T tokens of width d, E experts of hidden width n, top-k routing."""

    name: str
    T: int
    d: int
    n: int
    E: int
    k: int
    tags: tuple[str, ...]
    source: str = ""

    @property
    def fwd_flops(self) -> int:
        return fwd_flops(self.T, self.d, self.n, self.k)


def fwd_flops(T: int, d: int, n: int, k: int) -> int:
    """fc1 (2 * T*k * d * 2n) plus fc2 (2 * T*k * n * d); the backward is twice that."""
    return 6 * T * k * d * n


def step_flops(T: int, d: int, n: int, k: int) -> int:
    return 3 * fwd_flops(T, d, n, k)


SHAPES = {
    s.name: s
    for s in (
        MoEShape("sonic-n256-E256-k16", 32768, 4096, 256, 256, 16, ("sonic", "gpu"), "SonicMoE H100 config"),
        MoEShape("sonic-n512-E128-k8", 32768, 4096, 512, 128, 8, ("sonic", "gpu"), "SonicMoE H100 config"),
        MoEShape("sonic-n1024-E64-k4", 32768, 4096, 1024, 64, 4, ("sonic", "gpu"), "SonicMoE H100 config"),
        MoEShape("sonic-n2048-E32-k4", 32768, 4096, 2048, 32, 4, ("sonic", "gpu"), "SonicMoE H100 config"),
        MoEShape("qwen3-30b-a3b", 32768, 2048, 768, 128, 8, ("model", "gpu"), "Qwen3-30B-A3B config"),
        # EP 8 of 256 experts: the 32 local experts see 8192 tokens x 8 = 65536 rows, the average EP-8 load.
        MoEShape("deepseek-v3-ep8", 8192, 7168, 2048, 32, 8, ("model", "gpu"), "DeepSeek-V3 at EP 8"),
        # gpt-oss uses a clamped SwiGLU with a bias; ours is plain SwiGLU, so only the shape is gpt-oss's.
        MoEShape("gpt-oss-120b", 32768, 2880, 2880, 128, 4, ("model", "gpu"), "gpt-oss-120b (plain SwiGLU)"),
        MoEShape("tiny-E4-k2", 48, 64, 32, 4, 2, ("tiny",), "CI"),
        MoEShape("tiny-E8-k3", 40, 48, 24, 8, 3, ("tiny",), "CI"),
        MoEShape("tiny-E3-k1", 33, 32, 16, 3, 1, ("tiny",), "CI: k = 1, T*k not a multiple of E"),
    )
}
GPU_DEFAULT = tuple(name for name, s in SHAPES.items() if "gpu" in s.tags)
TINY = tuple(name for name, s in SHAPES.items() if "tiny" in s.tags)


def select_shapes(text: str | None, cuda: bool) -> list[MoEShape]:
    """Comma-separated names or tags ("gpu", "sonic", "model", "tiny", "all"); default gpu on CUDA, tiny on CPU."""
    names = [t.strip() for t in (text or "").split(",") if t.strip()] or ["gpu" if cuda else "tiny"]
    picked: list[MoEShape] = []
    for name in names:
        if name in SHAPES:
            hits = [SHAPES[name]]
        else:
            hits = [s for s in SHAPES.values() if name == "all" or name in s.tags]
        if not hits:
            raise SystemExit(f"--moe-shapes: unknown shape or tag {name!r}; shapes: {', '.join(SHAPES)}")
        picked += [s for s in hits if s not in picked]
    return picked


# ---------------------------------------------------------------- routing and inputs

ROUTINGS = ("balanced", "skewed", "hot")
SKEW = 1.0  # logit ramp across the experts ("mild": the last expert's logit is 1 above the first's)
HOT_BIAS = 4.0  # added to expert 0's logit in "hot": it lands in nearly every token's top-k


def route(T: int, E: int, k: int, routing: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 [T, k], topk_weights fp32 [T, k]) on the CPU, the same for the same seed. k <= E, and a
    token's k experts are distinct. Weights: softmax of the logits over the k chosen (renormalised)."""
    if k > E:
        raise ValueError(f"route: top-{k} of {E} experts")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if routing == "balanced":
        # Slot p = rank(t) * k + j goes to expert perm[p % E]: each expert gets every E-th slot, so the counts are
        # exact (within one when E does not divide T*k), and a token's k consecutive slots are distinct experts.
        rank = torch.randperm(T, generator=g)
        perm = torch.randperm(E, generator=g)
        ids = perm[(rank[:, None] * k + torch.arange(k)) % E]
    elif routing in ("skewed", "hot"):
        logits = logits + SKEW * torch.linspace(0.0, 1.0, E)
        if routing == "hot":
            logits[:, 0] += HOT_BIAS
        ids = logits.topk(k, dim=1).indices
    else:
        raise ValueError(f"route: routing {routing!r}; one of {ROUTINGS}")
    weights = torch.softmax(logits.gather(1, ids), dim=1)
    return ids.to(torch.int32), weights


def expert_counts(ids: torch.Tensor, E: int) -> torch.Tensor:
    return torch.bincount(ids.reshape(-1).long().cpu(), minlength=E)


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    dy: torch.Tensor

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.w13, self.w2, self.weights


GRADS = ("out", "dx", "dw13", "dw2", "dweights")


def make_inputs(shape: MoEShape, routing: str, seed: int, device: torch.device, dtype: torch.dtype) -> Inputs:
    """Seeded inputs, the leaves requiring grad. Weights scaled by 1/sqrt(fan-in) so every stage is O(1). The
    dense tensors are drawn on ``device`` (the same seed draws the same values on the same kind of device): on
    the host, the largest shape's w13 alone takes seconds."""
    ids, weights = route(shape.T, shape.E, shape.k, routing, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g, device=device) * scale).to(dtype)

    x = randn(shape.T, shape.d)
    w13 = randn(shape.E, 2 * shape.n, shape.d, scale=shape.d**-0.5)
    w2 = randn(shape.E, shape.d, shape.n, scale=shape.n**-0.5)
    dy = randn(shape.T, shape.d)
    leaves = [t.requires_grad_() for t in (x, w13, w2, weights.to(device=device, dtype=dtype))]
    return Inputs(leaves[0], ids.to(device), leaves[3], leaves[1], leaves[2], dy)


def step(block: Callable, inp: Inputs) -> tuple[torch.Tensor, ...]:
    """One fwd+bwd: (out, dx, dw13, dw2, dweights)."""
    out = block(inp.x, inp.ids, inp.weights, inp.w13, inp.w2)
    grads = torch.autograd.grad(out, (inp.x, inp.w13, inp.w2, inp.weights), inp.dy)
    return (out.detach(), *grads)


ORACLE_ROWS = 1 << 17  # routed rows per chunk of the oracle: bounds its fp32 [rows, d] buffers


def oracle(inp: Inputs, compute: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(out, dx, dw13, dw2, dweights) of ``moe_experts_reference`` in ``compute`` (TF32 off) on upcast copies of
    the inputs, over chunks of tokens (the weight gradients summed over the chunks): the reference keeps
    several [T*k, d] buffers, which at T*k = 2^19 and d = 4096 would be 8 GiB each in fp32."""
    from moegemm.bench.problem import exact_fp32
    from moegemm.torch import moe_experts_reference

    x, w13, w2, weights = (t.detach().to(compute).requires_grad_() for t in inp.leaves)
    T, k = inp.ids.shape
    chunk = max(1, ORACLE_ROWS // max(k, 1))
    outs, dxs, dws = [], [], []
    dw13 = torch.zeros_like(w13)
    dw2 = torch.zeros_like(w2)
    with exact_fp32():
        for s in range(0, T, chunk):
            sl = slice(s, min(T, s + chunk))
            xc, wc = x[sl].detach().requires_grad_(), weights[sl].detach().requires_grad_()
            out = moe_experts_reference(xc, inp.ids[sl], wc, w13, w2, compute_dtype=compute)
            gx, g13, g2, gw = torch.autograd.grad(out, (xc, w13, w2, wc), inp.dy[sl].to(compute))
            outs.append(out.detach())
            dxs.append(gx)
            dws.append(gw)
            dw13 += g13
            dw2 += g2
    return torch.cat(outs), torch.cat(dxs), dw13, dw2, torch.cat(dws)


# Relative Frobenius error bound vs the fp32 oracle, by dtype: the block rounds to the dtype several times in a
# row (fc1 output, activation, fc2 output, the weighted rows, and the same in the backward), each adding about
# 2^-9 / sqrt(3) ~ 1.1e-3 RMS in bf16; a wrong expert, weight or activation gives errors of order 1.
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}
# The FP8 block: an output passes four e4m3 roundings (x, w13, h, w2; a gradient as many), each about
# 2^-4 / sqrt(3) ~ 3.6% RMS, 6-7% together (tests/test_moe_fp8.py); a wrong scale or expert gives order 1.
FP8_REL_TOL = 1.2e-1


# ---------------------------------------------------------------- implementations


class Unavailable(Exception):
    """The implementation cannot run here; the message is the recorded reason."""


def _moegemm():
    from moegemm.torch import moe_experts

    return moe_experts


def _moegemm_fp8(recipe: str, cached: bool) -> Callable[[], Callable]:
    """The FP8 block; ``cached``: the weights' FP8 copies kept across calls (``Fp8WeightCache``: gradient
    accumulation's micro-batches after the first), else quantized in every call (the first micro-batch)."""

    def load():
        from moegemm.torch import Fp8WeightCache, moe_experts

        caches = (Fp8WeightCache(), Fp8WeightCache()) if cached else None

        def block(x, ids, weights, w13, w2):
            return moe_experts(x, ids, weights, w13, w2, fp8_recipe=recipe, fp8_caches=caches)

        return block

    return load


def _glue(mm: Callable) -> Callable:
    """The unfused block as torchtitan-style code writes it: argsort the flattened ids, gather x's rows into
    expert order, grouped fc1, ``silu(gate) * up``, grouped fc2, scale by the routing weight, ``index_add_``
    back to tokens; all autograd. ``mm(a, w [E, K, N], counts int32 [E] on the device) -> [rows, N]``. The
    counts come from ``histc`` (torch.bincount on CUDA syncs to size its output)."""

    def block(x, ids, weights, w13, w2):
        E, n = w13.shape[0], w2.shape[2]
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=E, min=0, max=E - 1).to(torch.int32)
        token = order // k
        h = mm(x[token], w13.mT, counts)
        a = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
        y = mm(a, w2.mT, counts) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, y)

    return block


def _moegemm_unfused():
    from moegemm.torch import m_grouped_mm

    return _glue(m_grouped_mm)


def _torch_grouped_mm():
    if not hasattr(torch, "_grouped_mm"):
        raise Unavailable(f"torch {torch.__version__} has no torch._grouped_mm")

    def mm(a, w, counts):
        return torch._grouped_mm(a, w, offs=torch.cumsum(counts, 0, dtype=torch.int32))

    return _glue(mm)


def _liger():
    if not torch.cuda.is_available():
        raise Unavailable("Liger's fused MoE runs Triton kernels on CUDA only (no CUDA here)")
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as exc:
        raise Unavailable(f"liger_kernel.ops.fused_moe does not import: {exc}") from None

    def block(x, ids, weights, w13, w2):
        return LigerFusedMoEFunction.apply(x, w13, w2, ids, weights)  # ids already int32

    return block


# The JAX op (moegemm.jax.moe_experts) runs in a child process of its own (``run_child``, like Liger): XLA's
# allocator keeps what it grew for one shape, so beside torch's in one process the largest shapes would not fit.
JAX_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # allocate on demand, beside torch's allocator
JAX_DEFAULT_ROUTINGS = ("skewed",)  # the default GPU run times the JAX op on these only (wall time)


class JaxBlock:
    """``moegemm.jax.moe_experts`` on ``backend`` ("triton" on the GPU, "interpret" under the
    Triton interpreter on CPU), measured by ``_measure_jax``: the torch inputs enter through DLPack once, outside
    the timing; ``fwd`` and ``step`` are jitted, and ``step`` returns (out, dx, dtopk_weights, dw13, dw2) from
    ``jax.vjp`` with the same upstream gradient the torch impls get."""

    def __init__(self, backend: str):
        import jax

        from moegemm.jax import moe_experts

        self.backend = backend

        def block(x, ids, weights, w13, w2):
            return moe_experts(x, ids, weights, w13, w2, backend=backend)

        def step_fn(x, ids, weights, w13, w2, dy):
            out, vjp = jax.vjp(lambda x, w, a, b: block(x, ids, w, a, b), x, weights, w13, w2)
            return (out, *vjp(dy))

        self.block = block
        self.fwd = jax.jit(block)
        self.step = jax.jit(step_fn)

    @staticmethod
    def to_jax(inp: Inputs) -> tuple:
        """(x, ids, weights, w13, w2, dy) as JAX arrays sharing the torch tensors' memory (no copy)."""
        import jax

        tensors = (inp.x, inp.ids, inp.weights, inp.w13, inp.w2, inp.dy)
        return tuple(jax.dlpack.from_dlpack(t.detach().contiguous()) for t in tensors)

    @staticmethod
    def to_torch(got: tuple) -> tuple[torch.Tensor, ...]:
        """``step``'s (out, dx, dweights, dw13, dw2) as torch tensors in ``GRADS`` order (out, dx, dw13, dw2,
        dweights), through DLPack."""
        out, dx, dweights, dw13, dw2 = (torch.from_dlpack(a) for a in got)
        return out, dx, dw13, dw2, dweights

    def held_bytes(self, args: tuple) -> int:
        """Bytes the forward keeps for the backward beyond its inputs: the residuals of an eager ``jax.vjp`` of the
        jitted block (z and the routing metadata), less those that are an input's own buffer."""
        import jax

        x, ids, weights, w13, w2, _ = args
        fwd = jax.jit(self.block)
        out, vjp = jax.vjp(lambda x, w, a, b: fwd(x, ids, w, a, b), x, weights, w13, w2)
        inputs = {a.unsafe_buffer_pointer() for a in args}
        leaves = [a for a in jax.tree_util.tree_leaves(vjp) if isinstance(a, jax.Array)]
        held = sum(a.nbytes for a in leaves if a.unsafe_buffer_pointer() not in inputs)
        del out, vjp, leaves
        return held


def _moegemm_jax():
    os.environ.update({k: v for k, v in JAX_ENV.items() if k not in os.environ})
    try:
        import jax
    except ImportError as exc:
        raise Unavailable(f"jax does not import: {exc}") from None
    from moegemm.jax import api

    if torch.cuda.is_available():
        if jax.default_backend() != "gpu":
            raise Unavailable(f"jax {jax.__version__} has no GPU backend here ({jax.default_backend()})")
        backend = "triton"
    else:
        backend = "interpret"  # the same launches under the Triton interpreter: correctness only
    try:
        api.resolve_backend(backend)
    except ValueError as exc:  # no GPU, or TRITON_INTERPRET unset
        raise Unavailable(f"moegemm.jax.moe_experts {exc}") from None
    return JaxBlock(backend)


@dataclasses.dataclass(frozen=True)
class MoEImpl:
    name: str
    load: Callable[[], Callable] | None  # None: not run (published figures)
    env: dict | None = None  # environment variables it reads at import (set before anything imports it)
    label: str = ""
    tol: float | None = None  # the correctness gate's bound (None: REL_TOL of the inputs' dtype)
    # In a child process of its own (``run_child``): JAX (XLA's allocator), or an ``env`` that contradicts
    # another implementation's in the run. In-process implementations share the paired clock.
    child: bool = False


def _sonicmoe(layout: str) -> Callable[[], Callable]:
    def load():
        from moegemm.bench import moe_peers

        try:
            return moe_peers.sonicmoe(layout=layout)
        except (ImportError, RuntimeError) as exc:
            raise Unavailable(str(exc)) from None

    return load


IMPLS = {
    i.name: i
    for i in (
        MoEImpl("moegemm", _moegemm, label="moegemm.torch.moe_experts (fused op)"),
        MoEImpl(
            "moegemm-jax",
            _moegemm_jax,
            JAX_ENV,
            "moegemm.jax.moe_experts (the same kernels from JAX; jitted, own process)",
            child=True,
        ),
        MoEImpl("moegemm-unfused", _moegemm_unfused, label="moegemm m_grouped_mm + torch glue"),
        MoEImpl("torch-grouped-mm", _torch_grouped_mm, label="torch._grouped_mm + torch glue"),
        MoEImpl(
            "liger-autotune-off",
            _liger,
            {"LIGER_FUSED_MOE_AUTOTUNE": "0"},
            "Liger fused MoE, LIGER_FUSED_MOE_AUTOTUNE=0 (own process)",
            child=True,
        ),
        MoEImpl(
            "liger",
            _liger,
            {"LIGER_FUSED_MOE_AUTOTUNE": "1"},
            "Liger fused MoE, autotuned (its recommended path)",
        ),
        MoEImpl(
            "sonicmoe",
            _sonicmoe("interleaved"),
            label="SonicMoE live, its own parameter layout (gate/up rows interleaved, made once per weight version)",
        ),
        MoEImpl(
            "sonicmoe-concat",
            _sonicmoe("concat"),
            label="SonicMoE live, concat_layout=True (moegemm's [gate; up] rows, no copy)",
        ),
        MoEImpl("sonicmoe-published", None, label="SonicMoE, published H100 figures (not run)"),
        *(
            MoEImpl(
                f"moegemm-fp8-{recipe}" + ("" if cached else "-quantize-weights"),
                _moegemm_fp8(recipe, cached),
                label=f"moegemm.torch.moe_experts(fp8_recipe={recipe!r}), the weights' FP8 copies "
                + ("cached" if cached else "made in every call"),
                tol=FP8_REL_TOL,
            )
            for recipe in ("tensorwise", "rowwise", "blockwise")
            for cached in (True, False)
        ),
    )
}
FP8_PEERS = tuple(name for name in IMPLS if name.startswith("moegemm-fp8-"))
DEFAULT_PEERS = (
    "moegemm",
    "moegemm-unfused",
    "torch-grouped-mm",
    "liger",
    "sonicmoe",
    "sonicmoe-concat",
    "sonicmoe-published",
)
# On CUDA the JAX op too (on ``JAX_DEFAULT_ROUTINGS``); without CUDA it has only the interpreter (name it).
DEFAULT_PEERS_CUDA = ("moegemm", "moegemm-jax", *DEFAULT_PEERS[1:])


def default_peers(cuda: bool) -> tuple[str, ...]:
    return DEFAULT_PEERS_CUDA if cuda else DEFAULT_PEERS


# SonicMoE's H100 figures read off its paper's chart (arXiv 2512.14080, Fig. 14; Dao-AILab/sonic-moe), as
# /work/shared/anchors/h100-moe-block.md gives them: forward and backward TF/s, activation memory where given.
SONIC_SOURCE = "arXiv 2512.14080 Fig. 14 (H100), read off the chart; not run here"
SONIC_PUBLISHED = {
    "sonic-n256-E256-k16": {"fwd_tflops": 430.0, "bwd_tflops": 460.0, "activation_gib": 2.5},
    "sonic-n1024-E64-k4": {"fwd_tflops": 550.0, "bwd_tflops": 555.0},
    "sonic-n2048-E32-k4": {"fwd_tflops": 595.0, "bwd_tflops": 585.0},
}


def published_record(shape: MoEShape, routing: str) -> dict:
    """SonicMoE's figures as a record; fwd+bwd TF/s derived as 3F / (F/fwd + 2F/bwd)."""
    rec = _base(shape, routing, "sonicmoe-published")
    fig = SONIC_PUBLISHED.get(shape.name)
    if fig is None:
        return {**rec, "status": "skipped", "reason": "no published SonicMoE figure for this shape"}
    step_tf = 3 / (1 / fig["fwd_tflops"] + 2 / fig["bwd_tflops"])
    return {
        **rec,
        "status": "published",
        "reason": SONIC_SOURCE,
        "fwd_tflops": fig["fwd_tflops"],
        "bwd_tflops": fig["bwd_tflops"],
        "step_tflops": step_tf,
        "activation_gib": fig.get("activation_gib"),
    }


# ---------------------------------------------------------------- measuring


SYNC_WARNING = "called a synchronizing CUDA operation"
SLOW_MS = (
    400.0  # a fwd+bwd slower than this (e.g. a per-expert loop) gets device time over 2 calls, no do_bench
)
DEVICE_MS_BUDGET = 300.0  # ms of calls per timing.device_ms


def count_syncs(fn: Callable, device: torch.device) -> int | None:
    """Host syncs of one call of ``fn``: torch's sync debug mode warns on each; None off CUDA."""
    if device.type != "cuda":
        return None
    saved = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(saved)
    torch.cuda.synchronize(device)
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def held_by_graph(fwd: Callable, device: torch.device) -> int:
    """Bytes a forward leaves allocated for its backward (the activations the graph keeps, SonicMoE's 'activation
    memory'): allocated after it, less before it, less the output."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    out = fwd()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - base - out.numel() * out.element_size()
    del out
    return held


def _base(shape: MoEShape, routing: str, impl: str) -> dict:
    return {
        "shape": shape.name,
        "routing": routing,
        "impl": impl,
        "status": None,
        "reason": None,
        "T": shape.T,
        "d": shape.d,
        "n": shape.n,
        "E": shape.E,
        "k": shape.k,
        "fwd_flops": shape.fwd_flops,
    }


def _reason(exc: BaseException) -> str:
    """The first line of the error and, for a multi-line one (Triton's CompilationError opens with only the
    source position), its last line too."""
    lines = [ln.strip() for ln in f"{type(exc).__name__}: {exc}".strip().splitlines() if ln.strip()]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text[:400]


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure(
    impl: MoEImpl,
    shape: MoEShape,
    routing: str,
    inp: Inputs,
    ref: tuple[torch.Tensor, ...],
    *,
    tcfg,
    check_only: bool,
    keep: dict | None = None,
) -> dict:
    """One record: skipped (cannot run here), failed (an error, or a relative error above REL_TOL), or ok
    (checked, then syncs, peak and device times measured; ``check_only``: checked only). ``keep``: where an ok
    torch implementation leaves its (fwd, step) callables for the paired clock of ``run_cases``, which fills its
    headline times; without it (a child process's single implementation) it is timed on its own."""
    from moegemm.bench import timing

    device = inp.x.device
    rec = _base(shape, routing, impl.name)
    tol = REL_TOL[inp.x.dtype] if impl.tol is None else impl.tol
    rec.update(tol=tol, dtype=str(inp.x.dtype).removeprefix("torch."))
    try:
        block = impl.load()
    except Unavailable as exc:
        return {**rec, "status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a peer that cannot load is a result to report
        return {**rec, "status": "skipped", "reason": "load: " + _reason(exc)}
    if isinstance(block, JaxBlock):
        return _measure_jax(block, rec, shape, inp, ref, tcfg=tcfg, check_only=check_only)
    run = lambda: step(block, inp)  # noqa: E731
    # The first call compiles (and, for autotuned Liger, tunes); it is the checked one.
    failed = _gate(rec, run, ref, device)
    if failed is not None:
        return failed
    if check_only:
        return {**rec, "status": "ok"}
    try:
        rec["host_syncs"] = count_syncs(run, device)
        start = time.perf_counter()
        got, peak_mb = timing.call_with_peak_mb(run, device)
        wall_ms = (time.perf_counter() - start) * 1e3
        del got
        _free(device)
        fwd = lambda: block(inp.x, inp.ids, inp.weights, inp.w13, inp.w2)  # noqa: E731
        grad_bytes = sum(t.numel() * t.element_size() for t in inp.leaves)
        rec.update(
            peak_gib=peak_mb / 1024,
            grads_gib=grad_bytes / 2**30,
            activation_gib=held_by_graph(fwd, device) / 2**30,
            step_wall_ms=wall_ms,
        )
        paired = keep is not None and wall_ms <= SLOW_MS
        _time(rec, shape, fwd, run, device, tcfg, wall_ms, "events", headline=not paired)
        if paired:
            keep[impl.name] = (fwd, run)
    except Exception as exc:  # noqa: BLE001
        _free(device)
        return {**rec, "status": "failed", "reason": "timing: " + _reason(exc)}
    return {**rec, "status": "ok"}


def _gate(rec: dict, run: Callable, ref: tuple[torch.Tensor, ...], device: torch.device) -> dict | None:
    """The correctness gate on one ``run()`` -> (out, dx, dw13, dw2, dweights): fills ``rec``'s relerr; the failed
    record, or None when every relative error is within ``rec["tol"]``."""
    from moegemm.bench import harness

    try:
        got = run()
        errs = {name: harness.relerr(g, r) for name, g, r in zip(GRADS, got, ref)}
        del got
    except Exception as exc:  # noqa: BLE001
        _free(device)
        return {**rec, "status": "failed", "reason": _reason(exc)}
    rec.update(relerr=errs, max_relerr=max(errs.values()))
    bad = {name: e for name, e in errs.items() if not e <= rec["tol"]}
    if bad:
        worst = ", ".join(f"{name} {e:.2e}" for name, e in bad.items())
        return {**rec, "status": "failed", "reason": f"relerr above {rec['tol']:.0e}: {worst}"}
    return None


def _time(
    rec: dict, shape: MoEShape, fwd, run, device, tcfg, wall_ms: float, clock: str, *, headline: bool = True
) -> None:
    """CUPTI device time per call of the fwd and the step into ``rec`` and, with ``headline``, their time on
    ``clock`` alone ("events": the paired clock with this implementation as the only one; "wall": calls that block
    themselves); without it the paired clock of ``run_cases`` fills the headline (``set_times``)."""
    from moegemm.bench import timing

    for op, fn in (("fwd", fwd), ("step", run)):
        if wall_ms > SLOW_MS:  # the paired clock's warm-up and reps alone would take minutes
            dev = timing.device_ms(fn, device, calls=2)
            rec[f"{op}_timing"] = "device_ms over 2 calls (slow impl: not on the paired clock)"
            set_times(rec, shape, op, dev)
        else:
            if headline and clock == "events":
                st = timing.paired_stats({op: fn}, device, tcfg, timing.round_ms({op: fn}, device))[op]
                set_times(rec, shape, op, st["median"], st)
                rec[f"{op}_timing"] = timing.method(device, clock) + " (alone: no peer in this process)"
            elif headline:
                set_times(rec, shape, op, timing.median_ms(fn, device, clock, tcfg))
                rec[f"{op}_timing"] = timing.method(device, clock)
            ms = rec.get(f"{op}_ms") or 1.0
            calls = max(3, min(20, int(DEVICE_MS_BUDGET / max(ms, 1e-3))))
            dev = timing.device_ms(fn, device, calls=calls)
        rec[f"{op}_device_ms"] = dev
        _free(device)
    _bwd(rec, shape, "device_ms", "bwd_device")


def set_times(rec: dict, shape: MoEShape, op: str, ms: float, stats: dict | None = None) -> None:
    """The headline ms of ``op`` ("fwd" or "step") and its TF/s: a forward is 6*T*k*d*n FLOPs, a fwd+bwd three
    times that; ``stats``: the paired clock's quartiles and counts. With both, the backward alone (step minus
    forward, what SonicMoE's published bwd TF/s counts: twice the forward's FLOPs)."""
    flops = shape.fwd_flops * (3 if op == "step" else 1)
    rec.update({f"{op}_ms": ms, f"{op}_tflops": flops / ms / 1e9})
    if stats is not None:
        rec.update({f"{op}_q25": stats["q25"], f"{op}_q75": stats["q75"], f"{op}_reps": stats["reps"]})
    _bwd(rec, shape, "ms", "bwd")


def _bwd(rec: dict, shape: MoEShape, field: str, out: str) -> None:
    fwd, step = rec.get(f"fwd_{field}"), rec.get(f"step_{field}")
    if fwd and step and step > fwd:
        rec.update({f"{out}_ms": step - fwd, f"{out}_tflops": 2 * shape.fwd_flops / (step - fwd) / 1e9})


JAX_SYNCS_NOTE = "not counted: torch's sync debug mode sees torch's CUDA calls only, not XLA's"


def _jax_memory() -> dict | None:
    """XLA's allocator statistics of the first device (bytes_in_use, peak_bytes_in_use), None where it has none
    (the CPU backend)."""
    import jax

    try:
        return jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a backend without statistics
        return None


def _jax_peak(before: dict | None, after: dict | None) -> tuple[int | None, str]:
    """(bytes, source) of XLA's peak during a call from its statistics before and after it: peak_bytes_in_use
    after less bytes_in_use before (the inputs are torch's, borrowed through DLPack, so in neither), when the call
    raised the process peak; the statistic cannot be reset, so otherwise (None, the reason)."""
    if not before or not after or "peak_bytes_in_use" not in after:
        return None, "none: this JAX backend gives no memory statistics"
    if after["peak_bytes_in_use"] > before.get("peak_bytes_in_use", 0):
        return after["peak_bytes_in_use"] - before["bytes_in_use"], "XLA peak_bytes_in_use during the step"
    return None, "none: the step did not raise XLA's process peak (an earlier, larger shape set it)"


def _measure_jax(
    jb: JaxBlock, rec: dict, shape: MoEShape, inp: Inputs, ref, *, tcfg, check_only: bool
) -> dict:
    """``measure`` for the JAX op: the same gate on its (out, dx, dw13, dw2, dweights) as torch tensors (DLPack);
    the timed callables are the jitted fwd and step on the device arrays, blocking (no conversion in them).

    Memory: torch's allocator cannot see XLA's. ``peak_gib``: ``_jax_peak`` around the shape's first step (the
    checked one: a later step of the same shape cannot raise the peak it set). ``activation_gib``: the bytes of
    the forward's VJP residuals that are not an input (``JaxBlock.held_bytes``). Host syncs: not counted."""
    import jax

    device = inp.x.device
    rec.update(backend=jb.backend, host_syncs=None, host_syncs_note=JAX_SYNCS_NOTE)
    try:
        args = jb.to_jax(inp)
    except Exception as exc:  # noqa: BLE001
        return {**rec, "status": "failed", "reason": "dlpack: " + _reason(exc)}
    run = lambda: jax.block_until_ready(jb.step(*args))  # noqa: E731
    before = None if check_only else _jax_memory()
    failed = _gate(rec, lambda: jb.to_torch(run()), ref, device)
    if failed is not None:
        return failed
    if check_only:
        return {**rec, "status": "ok"}
    try:
        peak, source = _jax_peak(before, _jax_memory())
        rec.update(peak_gib=None if peak is None else peak / 2**30, peak_source=source)
        start = time.perf_counter()
        got = run()
        wall_ms = (time.perf_counter() - start) * 1e3
        del got
        grad_bytes = sum(t.numel() * t.element_size() for t in inp.leaves)
        rec.update(
            grads_gib=grad_bytes / 2**30, activation_gib=jb.held_bytes(args) / 2**30, step_wall_ms=wall_ms
        )
        fwd = lambda: jb.fwd(*args[:5]).block_until_ready()  # noqa: E731
        _time(rec, shape, fwd, run, device, tcfg, wall_ms, "wall")
    except Exception as exc:  # noqa: BLE001
        _free(device)
        return {**rec, "status": "failed", "reason": "timing: " + _reason(exc)}
    return {**rec, "status": "ok"}


def jax_footprint(shape: MoEShape) -> int:
    """Rough elements of a JAX fwd+bwd (weight gradients, z and its gradient, the [R, d] rows): the JAX child runs
    its shapes smallest first, so each step can raise XLA's peak statistic (``_measure_jax``)."""
    R = shape.T * shape.k
    return 3 * shape.E * shape.d * shape.n + 5 * R * shape.n + R * shape.d


def _ratios_to_bf16(records: list[dict], impls, field: str, over_bf16: bool) -> None:
    """Each ok record of ``impls`` gets ``field``: its fwd and step device ms against the ``moegemm`` (BF16 torch)
    record's for the same shape and routing, its own over BF16's (``over_bf16``) or BF16's over its own; None
    where either is missing (not timed, or without CUDA)."""
    base = {(r["shape"], r["routing"]): r for r in records if r["impl"] == "moegemm" and r["status"] == "ok"}
    for r in records:
        if r["impl"] not in impls or r["status"] != "ok":
            continue
        b = base.get((r["shape"], r["routing"]))
        ratio = {}
        for op in ("fwd", "step"):
            own, bf16 = r.get(f"{op}_device_ms"), (b or {}).get(f"{op}_device_ms")
            ratio[op] = (own / bf16 if over_bf16 else bf16 / own) if own and bf16 else None
        r[field] = ratio if any(v is not None for v in ratio.values()) else None


def add_jax_vs_torch(records: list[dict]) -> None:
    """Each ok moegemm-jax record gets ``jax_vs_torch``: its fwd and step device ms over the ``moegemm`` torch
    record's for the same shape and routing (None where either is missing: not timed, or without CUDA)."""
    _ratios_to_bf16(records, ("moegemm-jax",), "jax_vs_torch", over_bf16=True)


def add_fp8_speedup(records: list[dict]) -> None:
    """Each ok FP8 record gets ``fp8_speedup``: the ``moegemm`` (BF16) record's fwd and step device ms over its own,
    same shape and routing (the issue's "BF16 time / FP8 time"; None where either is missing)."""
    _ratios_to_bf16(records, FP8_PEERS, "fp8_speedup", over_bf16=False)


def run_cases(
    shapes: list[MoEShape],
    routings: list[str],
    impls: list[MoEImpl],
    device: torch.device,
    *,
    dtype: torch.dtype,
    seeds: tuple[int, ...],
    tcfg,
    check_only: bool,
    paired: bool = True,
    say: Callable[[str], None] = lambda _: None,
    on_case: Callable[[list[dict]], None] = lambda _: None,
) -> list[dict]:
    """The in-process measurements: per (shape, routing, seed), the oracle once, then each impl, then (``paired``,
    on CUDA) the ok ones' fwd and then their fwd+bwd on the headline clock, taking turns; ``on_case(records so
    far)`` after each (shape, routing, seed)."""
    from moegemm.bench import timing

    compute = torch.float64 if device.type == "cpu" else torch.float32
    records = []
    for shape in shapes:
        for routing in routings:
            for seed in seeds:
                start = time.perf_counter()
                inp = make_inputs(shape, routing, seed, device, dtype)
                ref = oracle(inp, compute)
                _free(device)
                say(
                    f"{shape.name} {routing} seed {seed}: inputs and oracle {time.perf_counter() - start:.1f} s"
                )
                counts = expert_counts(inp.ids, shape.E)
                load = {
                    "max_rows": int(counts.max()),
                    "min_rows": int(counts.min()),
                    "mean_rows": shape.T * shape.k / shape.E,
                }
                kept: dict = {}
                keep = kept if paired and not check_only else None
                mine = []
                for impl in impls:
                    say(f"{shape.name} {routing} seed {seed} {impl.name}")
                    rec = measure(impl, shape, routing, inp, ref, tcfg=tcfg, check_only=check_only, keep=keep)
                    mine.append(
                        {**rec, "seed": seed, "load": load, "oracle": str(compute).removeprefix("torch.")}
                    )
                    _free(device)
                for i, op in enumerate(("fwd", "step")):
                    if not kept:
                        break
                    fns = {name: pair[i] for name, pair in kept.items()}
                    stats = timing.paired_stats(fns, device, tcfg, timing.round_ms(fns, device))
                    for r in mine:
                        if r["impl"] in stats:
                            set_times(r, shape, op, stats[r["impl"]]["median"], stats[r["impl"]])
                            r[f"{op}_timing"] = timing.method(device) + f" ({len(fns)} implementations)"
                    _free(device)
                records.extend(mine)
                del inp, ref, kept
                _free(device)
                say(f"{shape.name} {routing} seed {seed}: {time.perf_counter() - start:.1f} s")
                on_case(records)
    return records


# ---------------------------------------------------------------- child processes (Liger, JAX)


def run_child(
    impl: MoEImpl,
    shapes: list[MoEShape],
    routings: list[str],
    *,
    dtype: torch.dtype,
    seeds: tuple[int, ...],
    tcfg,
    check_only: bool,
    timeout_s: float | None = None,
) -> list[dict]:
    """``impl`` over every (shape, routing) in a child process with ``impl.env`` set before anything imports it;
    one failed record per case if the child dies."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "impl": impl.name,
            "shapes": [s.name for s in shapes],
            "routings": routings,
            "dtype": str(dtype).removeprefix("torch."),
            "seeds": list(seeds),
            "tcfg": dataclasses.asdict(tcfg),
            "check_only": check_only,
            "out": str(Path(tmp) / "records.json"),
        }
        env = {**os.environ, **(impl.env or {})}
        cmd = [sys.executable, "-m", "moegemm.bench.moe", "--worker", json.dumps(spec)]
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout_s, capture_output=True, text=True)
            error = (
                None
                if proc.returncode == 0
                else f"child exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
            )
        except subprocess.TimeoutExpired:
            error = f"child timed out after {timeout_s} s"
        out = Path(spec["out"])
        if error is None and out.exists():
            return json.loads(out.read_text())
    return [
        {
            **_base(s, r, impl.name),
            "seed": seed,
            "status": "failed",
            "reason": error or "child wrote no records",
        }
        for s in shapes
        for r in routings
        for seed in seeds
    ]


def _worker(spec: dict) -> None:
    from moegemm.bench import timing

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = run_cases(
        [SHAPES[n] for n in spec["shapes"]],
        spec["routings"],
        [IMPLS[spec["impl"]]],
        device,
        dtype=getattr(torch, spec["dtype"]),
        seeds=tuple(spec["seeds"]),
        tcfg=timing.TimingConfig(**spec["tcfg"]),
        check_only=spec["check_only"],
        paired=device.type == "cuda",
        say=lambda s: print(s, file=sys.stderr, flush=True),
    )
    Path(spec["out"]).write_text(json.dumps(records))


# ---------------------------------------------------------------- the run, its table and JSON


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(records: list[dict], title: str, check_only: bool):
    from rich.table import Table

    t = Table(title=title)
    cols = ["shape", "routing", "impl"]
    if check_only:
        cols += ["relerr out", "dx", "dw13", "dw2", "dweights", "tol", "check", "note"]
    else:
        cols += [
            "fwd ms",
            "fwd TF/s",
            "fwd+bwd ms",
            "fwd+bwd TF/s",
            "dev ms fwd",
            "dev ms f+b",
            "peak GiB",
            "act GiB",
        ]
        cols += ["syncs", "max relerr", "note"]
    for c in cols:
        left = c in ("shape", "routing", "impl", "note", "check")
        t.add_column(c, justify="left" if left else "right", no_wrap=c != "note", overflow="fold")
    t.caption = (
        "relerr: ||got - oracle|| / ||oracle|| per output/gradient (fp32 oracle; fp64 on CPU)"
        if check_only
        else "ms: do_bench median (L2 flushed); dev ms: CUPTI device time per call; TF/s: 6Tkdn (fwd), 3x that "
        "(fwd+bwd) over device time; peak: allocated during one fwd+bwd above the inputs (grads included); act: kept "
        "by the forward for the backward; syncs: per fwd+bwd"
    )
    previous = None
    for r in records:
        key = (r["shape"], r["routing"])
        first = key != previous
        if first and previous is not None:
            t.add_section()
        previous = key
        head = [r["shape"] if first else "", r["routing"] if first else "", r["impl"]]
        note = "" if r["status"] in ("ok",) else f"{r['status']}: {r['reason']}"
        if r.get("jax_vs_torch"):
            ratio = r["jax_vs_torch"]
            note = f"dev ms / moegemm's: fwd {_fmt(ratio['fwd'], '.3f')}, f+b {_fmt(ratio['step'], '.3f')}"
        if r.get("fp8_speedup"):
            ratio = r["fp8_speedup"]
            note = f"BF16 ms / FP8 ms: fwd {_fmt(ratio['fwd'], '.2f')}x, f+b {_fmt(ratio['step'], '.2f')}x"
        style = {"ok": None, "failed": "bold red", "skipped": "dim", "published": "cyan"}[r["status"]]
        errs = r.get("relerr") or {}
        if check_only:
            row = [_fmt(errs.get(g), ".1e") for g in GRADS] + [_fmt(r.get("tol"), ".0e")]
            verdict = {"ok": "pass", "failed": "FAIL"}.get(r["status"], r["status"])
            t.add_row(*head, *row, verdict, note if r["status"] != "ok" else "", style=style)
            continue
        if r["status"] == "published":
            row = ["-", _fmt(r["fwd_tflops"], ".0f"), "-", _fmt(r["step_tflops"], ".0f"), "-", "-", "-"]
            row += [_fmt(r.get("activation_gib"), ".2f"), "-", "-"]
            t.add_row(*head, *row, f"published: bwd {r['bwd_tflops']:.0f} TF/s (not run)", style=style)
            continue
        row = [
            _fmt(r.get("fwd_ms"), ".2f"),
            _fmt(r.get("fwd_tflops"), ".0f"),
            _fmt(r.get("step_ms"), ".2f"),
            _fmt(r.get("step_tflops"), ".0f"),
            _fmt(r.get("fwd_device_ms"), ".2f"),
            _fmt(r.get("step_device_ms"), ".2f"),
            _fmt(r.get("peak_gib"), ".2f"),
            _fmt(r.get("activation_gib"), ".2f"),
            _fmt(r.get("host_syncs"), "d"),
            _fmt(r.get("max_relerr"), ".1e"),
        ]
        t.add_row(*head, *row, note, style=style)
    return t


def _csv(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def main(args, argv, env, device: torch.device, console) -> int:
    """``--moe``: the run, the table and ``benchmarks/results/<device>/moe.json``; 1 on a failed check."""
    from moegemm.bench import report, timing

    check_only = device.type != "cuda"
    shapes = select_shapes(args.moe_shapes, not check_only)
    routings = _csv(args.moe_routing) or ["balanced", "skewed"]
    if set(routings) - set(ROUTINGS):
        raise SystemExit(
            f"--moe-routing takes a comma-separated subset of {ROUTINGS}, got {args.moe_routing!r}"
        )
    peers = _csv(args.moe_peers) or list(default_peers(not check_only))
    unknown = [p for p in peers if p not in IMPLS]
    if unknown:
        raise SystemExit(f"--moe-peers: unknown {unknown}; known: {', '.join(IMPLS)}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    tcfg = timing.TimingConfig.quick() if args.quick else timing.TimingConfig()
    from moegemm.bench.__main__ import seeds_arg

    seeds = seeds_arg(args, not check_only)
    name = args.name or "moe"
    out = args.out or report.default_out(env.device, name)
    meta = {
        **report.run_meta(env, check_only, argv, benchmark=name, tcfg=tcfg, seeds=seeds),
        "dtype": args.dtype,
        "shapes": {s.name: dataclasses.asdict(s) for s in shapes},
        "routings": routings,
        "routing_params": {"skew": SKEW, "hot_bias": HOT_BIAS},
        "impls": {p: IMPLS[p].label for p in peers},
        "flops": "fwd 6*T*k*d*n; fwd+bwd 3x, bwd 2x; TF/s over the headline (paired) median; *_device_ms beside",
        "timing": None if check_only else timing.method(device) + (" (--quick)" if args.quick else ""),
        "timing_config": None if check_only else dataclasses.asdict(tcfg),
        "rel_tol": REL_TOL[dtype],
        "oracle": "moegemm.torch.moe_experts_reference, " + ("fp64" if check_only else "fp32, TF32 off"),
        "sonicmoe_source": SONIC_SOURCE,
    }
    if "moegemm-jax" in peers:
        meta["jax"] = {
            "timing": "jitted fwd and fwd+bwd (jax.vjp) on device arrays, blocking: wall-clock median and CUPTI "
            "device time (which sees XLA's stream); inputs converted once through DLPack, outside the timing",
            "peak_gib": "XLA's peak_bytes_in_use during one fwd+bwd above its bytes_in_use before (torch's "
            "allocator cannot see XLA's); None where the step did not raise the process peak (see peak_source)",
            "activation_gib": "bytes of the forward's VJP residuals that are not inputs",
            "host_syncs": JAX_SYNCS_NOTE,
            "jax_vs_torch": "fwd and fwd+bwd device ms over the moegemm (torch) record's, same shape and routing",
        }
    started = time.perf_counter()
    say = lambda s: console.print(f"[{time.perf_counter() - started:5.0f} s] {s}", highlight=False)  # noqa: E731
    kw = {"dtype": dtype, "seeds": seeds, "tcfg": tcfg, "check_only": check_only}
    local = [IMPLS[p] for p in peers if IMPLS[p].load is not None and not IMPLS[p].child]
    for impl in local:  # before anything imports them (Liger reads its autotune switch at import)
        os.environ.update(impl.env or {})
    out = Path(out)

    def write(records: list[dict], partial: bool) -> None:
        """After every case too (partial): a run cut short by a time limit leaves its finished cases on disk."""
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"meta": {**meta, "partial": partial}, "records": records}
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    records = run_cases(
        shapes,
        routings,
        local,
        device,
        paired=device.type == "cuda",
        say=say,
        on_case=lambda rs: write(rs, True),
        **kw,
    )
    for p in peers:
        impl = IMPLS[p]
        if not impl.child:
            continue
        on = shapes
        on_routings = routings
        if p == "moegemm-jax":
            on = sorted(on, key=jax_footprint)  # smallest first: each step can raise XLA's peak statistic
            if not args.moe_peers and set(routings) & set(JAX_DEFAULT_ROUTINGS):
                # The default run: the JAX op on the skewed routing only, to keep the GPU run's wall time short.
                on_routings = [r for r in routings if r in JAX_DEFAULT_ROUTINGS]
                records += [
                    {
                        **_base(s, r, p),
                        "seed": seed,
                        "status": "skipped",
                        "reason": f"default peers: {'/'.join(JAX_DEFAULT_ROUTINGS)} routing only "
                        "(wall time); name it in --moe-peers for every routing",
                    }
                    for s in on
                    for r in routings
                    for seed in seeds
                    if r not in on_routings
                ]
        if not on:
            continue
        if check_only:  # no CUDA: the child would only find the same reason
            try:
                impl.load()
            except Exception as exc:  # noqa: BLE001
                records += [
                    {
                        **_base(s, r, p),
                        "seed": seed,
                        "status": "skipped",
                        "reason": _reason(exc).removeprefix("Unavailable: "),
                    }
                    for s in on
                    for r in on_routings
                    for seed in seeds
                ]
                continue
        say(f"{p}: child process, {impl.env}")
        # One child per shape: XLA keeps the memory it grew, and the child's reference check then ran out of it on
        # the H100 after a few shapes.
        for s in on:
            records += run_child(impl, [s], on_routings, **kw)
            write(records, True)
    if "sonicmoe-published" in peers:
        records += [published_record(s, r) for s in shapes for r in routings if s.name in SONIC_PUBLISHED]
    order = {(s.name, r): i for i, (s, r) in enumerate((s, r) for s in shapes for r in routings)}
    records.sort(
        key=lambda r: (order.get((r["shape"], r["routing"]), 0), r.get("seed") or 0, peers.index(r["impl"]))
    )
    add_jax_vs_torch(records)
    add_fp8_speedup(records)
    failed = [
        f"{r['shape']} {r['routing']} {r['impl']}: {r['reason']}" for r in records if r["status"] == "failed"
    ]
    meta.update(elapsed_s=time.perf_counter() - started, failed=failed)
    title = f"{env.device} | MoE expert block | {args.dtype} | torch {env.torch} triton {env.triton}"
    console.print(table(records, title + (" | correctness only" if check_only else ""), check_only))
    write(records, False)
    console.print(f"wrote {out}")
    for f in failed:
        console.print(f"  failed: {f}", style="red", highlight=False)
    console.print(f"done in {meta['elapsed_s']:.0f} s")
    return 1 if check_only and failed else 0


if __name__ == "__main__":  # the child process of run_child
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        spec = json.loads(sys.argv[2])
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        _worker(spec)
    else:
        raise SystemExit("moegemm.bench.moe is run by `python -m moegemm.bench --moe`")
