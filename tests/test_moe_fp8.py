"""The FP8 expert block (``moe_experts(..., fp8_recipe=)``): the fused FP8 launches against their twins, the block's
output and every gradient against its twin and the fp64 oracle, routing edge cases, the weight cache, bad input,
tracing, and (on a GPU) no host sync. Triton runs under the interpreter on CPU (compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, needs_cuda
from test_moe import fp64_grads
from test_moe import make as _bf16_block

from moegemm._src import plan
from moegemm._src.torch import moe as _moe
from moegemm._src.torch import ops as _ops
from moegemm._src.torch import reference as _ref
from moegemm._src.torch.launch_fp8 import launch_swiglu, launch_swiglu_bwd
from moegemm.testing.accuracy import relerr
from moegemm.torch import Fp8WeightCache, MoE, moe_experts

RECIPES = ["tensorwise", "rowwise", "blockwise"]
NAMES = ("out", "dx", "dweights", "dw13", "dw2")
# Against the fp64 oracle of the unquantized block: every output passes through four e4m3 roundings (x, w13, h, w2;
# the gradients through as many), each about 2^-4 / sqrt(3) ~ 3.6% RMS on a value, ~6-7% together. Measured on CPU
# (2026-12, interpreter kernels and twins, this file's cases): out, dx, dw13, dw2 0.054-0.068 (max 0.0679), set at
# 1.3x that; dweights, a few dozen values here, 0.055-0.078 (max 0.0784), 1.3x. The activations (x, h, dy, dz)
# rounded to e5m2 in place of e4m3 give 0.091-0.117 and fail every case (0.12 passed them all); a wrong scale,
# column or expert gives errors of order 1.
ORACLE_TOL = dict.fromkeys(NAMES, 8.8e-2) | {"dweights": 1.02e-1}
# Kernels against their twins (the same quantization points): a z or dh an ulp apart (the interpreter truncates its
# fp32 -> bf16 casts; on a GPU the tensor cores accumulate differently, and the split form rounds dh to bf16) flips
# an FP8 byte of the next operand now and then: 1-3% measured on CPU and on the H100.
TWIN_TOL = 5e-2
# The fused launches against their twin with fp32 outputs: the summation order alone on CPU; on the H100 the FP8
# tensor cores keep about 14 bits while they accumulate the 128 products between promotions (DeepSeek-V3's report):
# 1.2-2.1e-4 measured (2026-11-27).
FP32_TOL = 1e-5 if DEVICE == "cpu" else 1e-3


def make(T, d, n, E, k, *, seed=0, ids=None):
    """``test_moe.make``'s block in bf16: [x, ids, weights, w13, w2]."""
    return _bf16_block(T, d, n, E, k, dtype=torch.bfloat16, seed=seed, ids=ids)


def run(backend, recipe, x, ids, weights, w13, w2, dout, caches=None):
    """(out, dx, dweights, dw13, dw2) of one forward and backward with fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w13, w2)]
    out = moe_experts(
        leaves[0], ids, leaves[1], leaves[2], leaves[3], fp8_recipe=recipe, fp8_caches=caches, backend=backend
    )
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return out.detach(), *[torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


def check_block(recipe, args, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    dout = torch.randn(args[0].shape, generator=g).to(DEVICE, args[0].dtype)
    got = run("triton", recipe, *args, dout)
    twin = run("reference", recipe, *args, dout)
    want = fp64_grads(*args, dout)
    for name, a, t, w in zip(NAMES, got, twin, want):
        assert torch.isfinite(a).all(), f"{recipe} {name}: non-finite (an unwritten output?)"
        assert relerr(a.cpu(), t.cpu()) <= TWIN_TOL, (
            f"{recipe} {name}: kernels vs twins {relerr(a.cpu(), t.cpu()):.2e}"
        )
        assert relerr(t.cpu(), w) <= ORACLE_TOL[name], (
            f"{recipe} {name}: twins vs fp64 oracle {relerr(t.cpu(), w):.2e}"
        )
        assert relerr(a.cpu(), w) <= ORACLE_TOL[name], (
            f"{recipe} {name}: kernels vs fp64 oracle {relerr(a.cpu(), w):.2e}"
        )
    return got


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_block_matches_twin_and_oracle_with_empty_and_hot_experts(recipe):
    """T 37 (no multiple of a tile), d 256 (two 128 scale blocks), expert 1 in every token, expert 3 in none."""
    T, E, k = 37, 5, 2
    ids = torch.stack([torch.tensor([1, 0]), torch.tensor([1, 2]), torch.tensor([4, 1])] * 13)[:T]
    check_block(recipe, make(T, 256, 128, E, k, ids=ids))


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fp8_block_one_hot_expert_and_unaligned_hidden(recipe):
    """Every choice on one expert; d 200 and n 72 off every multiple of 128 (partial scale blocks, padded rows)."""
    T, E = 24, 3
    ids = torch.full((T, 1), 2)
    check_block(recipe, make(T, 200, 72, E, 1, ids=ids, seed=3), seed=3)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("epilogue", ["swiglu", "swiglu_bwd"])
def test_fused_fp8_launch_matches_its_twin_in_fp32(recipe, epilogue):
    """The FP8 m-grouped launch with the gather prologue and a SwiGLU epilogue, its outputs in fp32 (no bf16
    rounding between kernel and twin): the gathered rows' scales, the gate/up columns' weight scales and the
    epilogue must match the twin to the accumulation's precision (``FP32_TOL``; promoted accumulation, on sm90 the
    split form)."""
    g = torch.Generator().manual_seed(7)
    T, d, n, E, R = 19, 256, 64, 3, 40
    sizes = torch.tensor([17, 0, 23], dtype=torch.int32)
    gather = torch.randint(0, T, (R,), generator=g, dtype=torch.int32)
    x = torch.randn(T, d, generator=g).to(DEVICE)
    N = 2 * n if epilogue == "swiglu" else n
    w = (torch.randn(E, N, d, generator=g) * torch.rand(E, N, 1, generator=g)).to(DEVICE)
    x_q, sx, _, _, _ = _ops.quantize_activation_views(x, None, recipe, _moe.E4M3, False, "reference")
    w_q, sw, _, _ = _ops.quantize_weight_views(w, recipe, "reference")
    z = torch.randn(R, 2 * n, generator=g).to(DEVICE)
    row_scale = torch.rand(R, generator=g).to(DEVICE)
    sizes, gather = sizes.to(DEVICE), gather.to(DEVICE)
    outs = {}
    for backend in ("triton", "reference"):
        got = _moe._fp8_gemm(
            x_q, sx, w_q, sw, sizes, recipe, False, backend, gather, epilogue, torch.float32, z, row_scale
        )
        outs[backend] = (
            list(got)
            if epilogue == "swiglu"
            else [*got[:2], got[2].sum(0), *(got[3] * (recipe == "tensorwise"))]
        )
    for i, (a, b) in enumerate(zip(outs["triton"], outs["reference"])):
        assert torch.isfinite(a).all(), f"{epilogue} output {i}: non-finite (unwritten?)"
        assert relerr(a.cpu(), b.cpu()) <= FP32_TOL, (
            f"{recipe} {epilogue} output {i}: {relerr(a.cpu(), b.cpu()):.2e}"
        )


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_block_split_launches_match_the_fused_ones(recipe):
    """The gathered SwiGLU launches split into a row copy, the plain launch and the SwiGLU row kernels (what sm90
    runs where the warp-specialized kernel takes the plain launch: plan.fp8_epilogue_split) against the fused
    Triton launches: the same block, dh rounded once more to bf16."""
    ids = torch.stack([torch.tensor([1, 0]), torch.tensor([1, 2]), torch.tensor([4, 1])] * 7)[:20]
    args = make(20, 256, 72, 5, 2, ids=ids, seed=4)
    dout = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(9)).to(DEVICE, args[0].dtype)
    with plan.constrain(fp8_epilogue_split=False):
        fused = run("triton", recipe, *args, dout)
    with plan.constrain(fp8_epilogue_split=True):
        split = run("triton", recipe, *args, dout)
    for name, a, b in zip(NAMES, split, fused):
        assert torch.isfinite(a).all(), f"{recipe} {name}: non-finite (an unwritten output?)"
        assert relerr(a.cpu(), b.cpu()) <= TWIN_TOL, (
            f"{recipe} {name}: split vs fused {relerr(a.cpu(), b.cpu()):.2e}"
        )


def test_swiglu_row_kernels_match_the_epilogue_twins():
    g = torch.Generator().manual_seed(2)
    R, n = 37, 200
    z = torch.randn(R, 2 * n, generator=g).to(DEVICE)
    dh = torch.randn(R, n, generator=g).to(DEVICE)
    s = torch.rand(R, generator=g).to(DEVICE)
    h = _ops.empty(R, n, dtype=torch.float32, device=DEVICE)
    launch_swiglu(z, h)
    dz = _ops.empty(R, 2 * n, dtype=torch.float32, device=DEVICE)
    hs = _ops.empty(R, n, dtype=torch.float32, device=DEVICE)
    amax = torch.zeros(2, device=DEVICE)
    ds = launch_swiglu_bwd(dh, z, s, dz, hs, amax)
    want_h = _ref.swiglu_epilogue(z, torch.float32)[1]
    want = _ref.swiglu_bwd_epilogue(dh, z, s)
    want_amax = torch.stack([want[0].abs().amax(), want[1].abs().amax()])
    for what, a, b in (
        ("h", h, want_h), ("dz", dz, want[0]), ("s h", hs, want[1]), ("ds", ds, want[2]), ("amax", amax, want_amax)
    ):  # fmt: skip
        assert relerr(a.cpu(), b.cpu()) <= 1e-5, f"{what}: {relerr(a.cpu(), b.cpu()):.2e}"


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_fp8_block_no_tokens(backend):
    x, ids, weights, w13, w2 = make(0, 128, 64, 3, 2)
    out, dx, dweights, dw13, dw2 = run(backend, "rowwise", x, ids, weights, w13, w2, torch.zeros_like(x))
    assert out.shape == (0, 128) and dx.shape == (0, 128) and dweights.shape == (0, 2)
    assert torch.equal(dw13, torch.zeros_like(dw13)) and torch.equal(dw2, torch.zeros_like(dw2))


def test_fp8_weight_cache_reuses_until_the_weight_changes():
    x, ids, weights, w13, w2 = make(16, 128, 64, 3, 2)
    w13, w2 = w13.clone().requires_grad_(), w2.clone().requires_grad_()
    caches = (Fp8WeightCache(), Fp8WeightCache())
    first = moe_experts(
        x, ids, weights, w13, w2, fp8_recipe="blockwise", fp8_caches=caches, backend="reference"
    )
    held = [c.storage for c in caches]
    again = moe_experts(
        x, ids, weights, w13, w2, fp8_recipe="blockwise", fp8_caches=caches, backend="reference"
    )
    assert all(c.storage is h for c, h in zip(caches, held)), "unchanged weights must reuse their FP8 copies"
    assert torch.equal(first, again)
    with torch.no_grad():
        w2.mul_(2.0)  # an optimizer step: the version counter moves
    moe_experts(x, ids, weights, w13, w2, fp8_recipe="blockwise", fp8_caches=caches, backend="reference")
    assert caches[0].storage is held[0] and caches[1].storage is not held[1], (
        "a changed weight must be re-quantized"
    )


def test_fp8_bad_recipe_and_expert_parallel_raise():
    x, ids, weights, w13, w2 = make(4, 128, 64, 2, 1)
    with pytest.raises(ValueError, match="recipe"):
        moe_experts(x, ids, weights, w13, w2, fp8_recipe="mxfp8")
    with pytest.raises(NotImplementedError, match="ep_group"):
        moe_experts(x, ids, weights, w13, w2, fp8_recipe="rowwise", ep_group=object())


def test_fp8_block_compile_fullgraph_equals_eager():
    args = make(12, 128, 64, 3, 2, seed=5)
    dout = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(105)).to(DEVICE, args[0].dtype)
    x, ids, weights, w13, w2 = args
    leaves = [t.clone().requires_grad_() for t in (x, weights, w13, w2)]

    def f(x, w, a, b):
        return moe_experts(x, ids, w, a, b, fp8_recipe="rowwise", backend="reference")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(*leaves)
    got = (out.detach(), *torch.autograd.grad(out, leaves, dout))
    eager = run("reference", "rowwise", *args, dout)
    for name, a, b, w in zip(NAMES, got, eager, fp64_grads(*args, dout)):
        assert torch.equal(a, b), f"compiled {name} differs from eager"
        # The eager twin is the compiled one's source: the fp64 oracle is the independent check of the values.
        assert relerr(a.cpu(), w) <= ORACLE_TOL[name], (
            f"compiled {name} vs fp64 oracle {relerr(a.cpu(), w):.2e}"
        )


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_block_on_gpu_no_host_sync_and_against_oracle(recipe):
    T, d, n, E, k = 1000, 520, 200, 12, 3
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(T, E, device="cuda", generator=g) + 3.0 * torch.linspace(0, 1, E, device="cuda")
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    x, _, _, w13, w2 = make(T, d, n, E, k)
    args = (x, ids.to(torch.int32), weights.to(torch.bfloat16), w13, w2)
    check_block(recipe, args)
    leaves = [t.detach().clone().requires_grad_() for t in (x, args[2], w13, w2)]
    moe_experts(
        leaves[0], args[1], *leaves[1:], fp8_recipe=recipe
    ).sum().backward()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe_experts(leaves[0], args[1], *leaves[1:], fp8_recipe=recipe)
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_gathered_transposed_quantize_writes_the_twins_bytes(recipe):
    """The wgrad operand quantized from x[gather] without a copy: the kernels' bytes and scales equal the twin's
    (rows gathered twice and out of order, an empty group, a width off 128, an outlier)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(30, 200, generator=g)
    x[7, 3] = 300.0
    x = x.to(DEVICE, torch.bfloat16)
    sizes = torch.tensor([20, 0, 25], dtype=torch.int32, device=DEVICE)
    gather = torch.randint(0, 30, (45,), generator=g, dtype=torch.int32).to(DEVICE)
    amax = x.float().abs().amax().reshape(1) if recipe == "tensorwise" else None
    got = _ops.quantize_gathered_t(x, gather, sizes, recipe, _moe.E4M3, "triton", amax)
    want = _ops.quantize_gathered_t(x, gather, sizes, recipe, _moe.E4M3, "reference", amax)
    used = 16 * sum(-(-int(n) // 16) for n in sizes.tolist())  # the groups' 16-aligned columns
    assert torch.equal(got[0][:, :used].view(torch.uint8), want[0][:, :used].view(torch.uint8)), recipe
    # Blockwise scale_t has a row per group-aligned 128-token block in use (its storage is an upper bound).
    blocks = sum(-(-int(n) // 128) for n in sizes.tolist()) if recipe == "blockwise" else None
    assert torch.equal(got[1][:blocks], want[1][:blocks]), recipe
    if recipe == "tensorwise":  # FP8 rows requantized at another scale (the cast path reads FP8 too)
        x8 = (x.float() / 4).to(_moe.E4M3)
        got = _ops.quantize_gathered_t(x8, gather, sizes, recipe, _moe.E4M3, "triton", amax)
        want = _ops.quantize_gathered_t(x8, gather, sizes, recipe, _moe.E4M3, "reference", amax)
        assert torch.equal(got[0][:, :used].view(torch.uint8), want[0][:, :used].view(torch.uint8))


def test_tensorwise_wgrad_copy_moves_the_fp8_bytes():
    """Tensorwise's wgrad operand from the token-order FP8 copy (``_moe._rows_t``): data_t holds exactly the
    gathered rows' bytes, transposed into their groups' columns, and the scale is the copy's."""
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(30, 200, generator=g) * 3).to(DEVICE, torch.bfloat16)
    sizes = torch.tensor([20, 0, 25], dtype=torch.int32, device=DEVICE)
    gather = torch.randint(0, 30, (45,), generator=g, dtype=torch.int32).to(DEVICE)
    x_q, sx, _, _, _ = _ops.quantize_activation_views(x, None, "tensorwise", _moe.E4M3, False, "reference")
    for backend in ("triton", "reference"):
        data_t, scale_t = _moe._rows_t(None, x_q, sx, gather, sizes, "tensorwise", backend)
        rows = x_q.view(torch.uint8)[gather.long()]
        assert torch.equal(data_t[:, :20].view(torch.uint8), rows[:20].T), backend
        assert torch.equal(data_t[:, 32:57].view(torch.uint8), rows[20:].T), backend  # group 2 starts at 32
        pad = torch.cat([data_t[:, 20:32], data_t[:, 57:64]], 1).view(torch.uint8)
        assert (pad == 0).all(), f"{backend}: the groups' padding columns (the wgrad reads them) must be 0"
        assert torch.equal(scale_t, sx.expand(3)), backend


def test_moe_layer_fp8_is_the_functional_block_and_keeps_the_weights_copies():
    """MoE(fp8_recipe=) runs moe_experts(fp8_recipe=) on its router's choice; its FP8 weight copies are reused
    until an optimizer step changes the weights."""
    torch.manual_seed(0)
    layer = MoE(128, 64, 4, 2, fp8_recipe="rowwise", backend="reference", dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(10, 128, device=DEVICE, dtype=torch.bfloat16)
    out = layer(x)
    held = [c.storage for c in layer._fp8_caches]
    weights, ids, _ = layer.router(x, layer.expert_bias)
    want = moe_experts(x, ids, weights, layer.w13, layer.w2, fp8_recipe="rowwise", backend="reference")
    assert torch.equal(out, want)
    out.float().sum().backward()
    assert layer(x) is not None and all(c.storage is h for c, h in zip(layer._fp8_caches, held))
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    layer(x)
    assert all(c.storage is not h for c, h in zip(layer._fp8_caches, held)), "stale FP8 weights after a step"
    with pytest.raises(NotImplementedError, match="ep_group"):
        MoE(128, 64, 4, 2, fp8_recipe="rowwise", ep_group=object())
