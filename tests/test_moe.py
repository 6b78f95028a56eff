"""The fused expert block ``moe_experts``: forward and every gradient against fp64 oracles, routing edge cases, bad
input, the routing metadata, tracing. Triton runs under the interpreter on CPU (compiled on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE, needs_cuda

from moegemm._src import plan
from moegemm._src.torch import moe as _moe
from moegemm.testing import assert_rel_close, oracle
from moegemm.testing.accuracy import relerr
from moegemm.torch import moe_experts, moe_experts_reference

BACKENDS = ["triton", "reference"]


def make(T, d, n, E, k, *, dtype=torch.float32, seed=0, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    weights = torch.rand(T, k, generator=g) + 0.1
    w13 = torch.randn(E, 2 * n, d, generator=g) / d**0.5
    w2 = torch.randn(E, d, n, generator=g) / n**0.5
    return (
        [t.to(DEVICE, dtype) for t in (x,)]
        + [ids.to(DEVICE, torch.int64)]
        + [t.to(DEVICE, dtype) for t in (weights, w13, w2)]
    )


def run(backend, x, ids, weights, w13, w2, dout=None):
    """(out, dx, dweights, dw13, dw2) of one forward and backward with fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w13, w2)]
    out = moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend=backend)
    if dout is None:
        dout = torch.randn_like(out)
    if not out.requires_grad:  # the reference twin with no token touches no input
        return out.detach(), *[torch.zeros_like(t) for t in leaves]
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return out.detach(), *[torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


def fp64_grads(x, ids, weights, w13, w2, dout):
    """The reference twin's autograd in fp64 (on CPU): (out, dx, dweights, dw13, dw2)."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (x, weights, w13, w2)]
    out = moe_experts_reference(
        leaves[0], ids.cpu(), leaves[1], leaves[2], leaves[3], compute_dtype=torch.float64
    )
    if out.numel() == 0:
        return out, *[torch.zeros_like(t) for t in leaves]
    return out.detach(), *torch.autograd.grad(out, leaves, dout.cpu().double())


NAMES = ("out", "dx", "dweights", "dw13", "dw2")


def check_all(backend, args, dtype=torch.float32, dout=None):
    x = args[0]
    dout = torch.randn(x.shape, dtype=dtype, device=DEVICE) if dout is None else dout
    got = run(backend, *args, dout=dout)
    want = fp64_grads(*args, dout)
    for name, a, b in zip(NAMES, got, want):
        assert_rel_close(a.cpu(), b, dtype, what=f"{backend} {name}")
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_matches_token_by_token_oracle(backend):
    """The forward against the oracle that shares no code (numpy, token by token), with an empty expert."""
    x, ids, weights, w13, w2 = make(13, 24, 20, 6, 2, seed=1)
    ids[ids == 5] = 4  # expert 5 gets no token
    out = moe_experts(x, ids, weights, w13, w2, backend=backend)
    want = oracle.moe_experts(x.cpu(), ids.cpu(), weights.cpu(), w13.cpu(), w2.cpu())
    assert_rel_close(out.cpu(), torch.from_numpy(want), torch.float32, what="out")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case",
    [
        dict(T=17, d=40, n=24, E=5, k=2),  # several tiles along d and n at the interpreter's 32-wide tiles
        dict(T=9, d=13, n=7, E=4, k=3),  # odd (unaligned) dims
        dict(T=11, d=32, n=16, E=3, k=1),  # k = 1
    ],
)
def test_gradients_of_every_input(backend, case):
    check_all(backend, make(**case, seed=2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_hot_expert_and_empty_experts_get_exact_zero_grads(backend):
    x, ids, weights, w13, w2 = make(10, 24, 16, 5, 2, seed=3)
    ids[:, 0], ids[:, 1] = 2, 2  # every choice of every token on expert 2 (duplicates within a token too)
    got = check_all(backend, (x, ids, weights, w13, w2))
    dw13, dw2 = got[3], got[4]
    for e in (0, 1, 3, 4):
        assert torch.equal(dw13[e], torch.zeros_like(dw13[e])), (
            f"expert {e} has no token: dw13 must be exactly 0"
        )
        assert torch.equal(dw2[e], torch.zeros_like(dw2[e])), (
            f"expert {e} has no token: dw2 must be exactly 0"
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_experts_in_a_token_each_count(backend):
    x, ids, weights, w13, w2 = make(6, 16, 8, 4, 3, seed=4)
    ids[:, 1] = ids[:, 0]
    got = check_all(backend, (x, ids, weights, w13, w2))
    # A token whose two choices name one expert with weights a and b: the same as one choice with a + b.
    merged_w = weights.clone()
    merged_w[:, 0] += merged_w[:, 1]
    merged_w[:, 1] = 0
    out = moe_experts(x, ids, merged_w, w13, w2, backend=backend)
    assert_rel_close(out.cpu(), got[0].cpu(), torch.float32, what="duplicate == merged")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens(backend):
    x, ids, weights, w13, w2 = make(0, 16, 8, 4, 2)
    out, dx, dweights, dw13, dw2 = run(backend, x, ids, weights, w13, w2)
    assert out.shape == (0, 16) and dx.shape == (0, 16) and dweights.shape == (0, 2)
    assert torch.equal(dw13, torch.zeros_like(dw13)) and torch.equal(dw2, torch.zeros_like(dw2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_ids_and_weights_are_clamped(backend):
    """Out-of-range ids act as the clamped id, non-finite weights as 0: the same result as the cleaned input,
    with no NaN anywhere (the kernels read and write nothing out of bounds)."""
    x, ids, weights, w13, w2 = make(8, 16, 8, 4, 2, seed=5)
    bad_ids, bad_w = ids.clone(), weights.clone()
    bad_ids[0, 0], bad_ids[3, 1], bad_ids[4, 0] = (
        -7,
        99,
        2**32 + 1,
    )  # the last wraps to 1 if cast before the clamp
    bad_w[2, 0], bad_w[5, 1], bad_w[6, 0] = float("nan"), float("inf"), float("-inf")
    clean_ids, clean_w = bad_ids.clamp(0, 3), torch.nan_to_num(bad_w, nan=0.0, posinf=0.0, neginf=0.0)
    dout = torch.randn(8, 16, device=DEVICE)
    got = run(backend, x, bad_ids, bad_w, w13, w2, dout=dout)
    want = run(backend, x, clean_ids, clean_w, w13, w2, dout=dout)
    bad = ~torch.isfinite(bad_w)
    for name, a, b in zip(NAMES, got, want):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        if name == "dweights":  # a non-finite weight is the constant 0: its gradient is exactly 0
            assert torch.equal(a[bad], torch.zeros_like(a[bad])), a[bad]
            b = torch.where(bad, 0.0, b)
        assert_rel_close(a.cpu(), b.cpu(), torch.float32, what=f"clamped {name}")


def test_check_raises_naming_the_value():
    x, ids, weights, w13, w2 = make(4, 8, 4, 3, 2)
    bad = ids.clone()
    bad[1, 1] = 3
    with pytest.raises(ValueError, match=r"topk_ids\[1, 1\] = 3 is outside \[0, E=3\)"):
        moe_experts(x, bad, weights, w13, w2, check=True)
    w_bad = weights.clone()
    w_bad[2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"topk_weights\[2, 0\] = nan is not finite"):
        moe_experts(x, ids, w_bad, w13, w2, check=True)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (dict(w13=(3, 7, 8)), "w13"),  # odd 2n
        (dict(w2=(3, 8, 5)), "w2"),  # n mismatch
        (dict(weights=(4, 3)), "topk_weights"),
        (dict(x=(4, 9)), "d=9"),
    ],
)
def test_bad_shapes_name_them(shapes, match):
    x, ids, weights, w13, w2 = make(4, 8, 4, 3, 2)
    tensors = dict(x=x, weights=weights, w13=w13, w2=w2)
    for name, shape in shapes.items():
        tensors[name] = torch.randn(shape, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        moe_experts(tensors["x"], ids, tensors["weights"], tensors["w13"], tensors["w2"])


def test_routing_metadata_example():
    """Routing's docstring example, an empty expert included."""
    ids = torch.tensor([[2, 0], [0, 2]], device=DEVICE)
    r = _moe.routing(ids, torch.ones(2, 2, device=DEVICE), 3)
    assert r.gather.tolist() == [0, 1, 0, 1]
    assert r.pos.tolist() == [[2, 0], [1, 3]]
    assert r.group_sizes.tolist() == [2, 0, 2]
    assert r.gather.dtype == r.pos.dtype == r.group_sizes.dtype == torch.int32


def test_routing_metadata_is_a_permutation():
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 7, (50, 3), generator=g).to(DEVICE)
    weights = torch.rand(50, 3, generator=g).to(DEVICE)
    r = _moe.routing(ids, weights, 7)
    R = 150
    assert sorted(r.pos.flatten().tolist()) == list(range(R))
    rows = r.pos.flatten().long()
    assert torch.equal(
        r.gather[rows].long(), torch.arange(R, device=DEVICE) // 3
    )  # row of (t, j) reads token t
    assert torch.equal(r.row_scale[rows], weights.flatten())
    np.testing.assert_array_equal(
        r.group_sizes.cpu().numpy(), np.bincount(ids.flatten().cpu().numpy(), minlength=7)
    )
    expert_of_row = torch.repeat_interleave(torch.arange(7, device=DEVICE), r.group_sizes.long())
    assert torch.equal(expert_of_row, ids.flatten()[torch.argsort(rows)])  # rows are expert-major


# The bf16 block rounds three times before its output (z, h and fc2's rows), each rounding below 2^-9 relative;
# the interpreter's fp32 -> bf16 cast truncates instead (twice the error, one-sided).
BF16_BLOCK_TOL = 2e-2 if DEVICE == "cpu" else 1e-2


def test_bf16_block_within_bf16_tolerance():
    args = make(16, 48, 32, 4, 2, dtype=torch.bfloat16, seed=7)
    dout = torch.randn(16, 48, device=DEVICE, dtype=torch.bfloat16)
    got = run("triton", *args, dout=dout)
    want = fp64_grads(*args, dout)
    for name, a, b in zip(NAMES, got, want):
        err = relerr(a.cpu(), b)
        assert err <= BF16_BLOCK_TOL, f"bf16 {name}: relerr {err:.2e} > {BF16_BLOCK_TOL}"


def test_compile_fullgraph_traces_forward_and_backward():
    x, ids, weights, w13, w2 = make(9, 16, 8, 4, 2, seed=8)
    leaves = [t.clone().requires_grad_() for t in (x, weights, w13, w2)]

    def f(x, w, a, b):
        return moe_experts(x, ids, w, a, b, backend="triton")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(*leaves)
    grads = torch.autograd.grad(out.sum(), leaves)
    want = fp64_grads(x, ids, weights, w13, w2, torch.ones_like(x))
    assert_rel_close(out.detach().cpu(), want[0], torch.float32, what="compiled out")
    for name, a, b in zip(NAMES[1:], grads, want[1:]):
        assert_rel_close(a.cpu(), b, torch.float32, what=f"compiled {name}")


def _gpu_block(T=512, d=256, n=128, E=8, k=4, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(T, E, device="cuda", generator=g) + 3.0 * seed * torch.linspace(
        0, 1, E, device="cuda"
    )
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    w13 = (torch.randn(E, 2 * n, d, device="cuda", generator=g) / d**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, d, n, device="cuda", generator=g) / n**0.5).to(torch.bfloat16)
    return x, ids.to(torch.int32), weights.to(torch.bfloat16), w13, w2


@needs_cuda
@pytest.mark.gpu
def test_no_host_sync_in_forward_or_backward():
    x, ids, weights, w13, w2 = _gpu_block()
    leaves = [t.requires_grad_() for t in (x, weights, w13, w2)]
    moe_experts(x, ids, weights, w13, w2).sum().backward()  # compiles and binds outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe_experts(x, ids, weights, w13, w2)
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@needs_cuda
@pytest.mark.gpu
def test_graph_replay_with_changing_routing_is_exact():
    """Capture forward and backward once; replays with new tokens and new routing (new group sizes on the device)
    equal eager calls bit for bit."""
    x, ids, weights, w13, w2 = _gpu_block()
    static = [t.clone() for t in (x, ids, weights)]
    static[0].requires_grad_()
    static[2].requires_grad_()

    def step():
        out = moe_experts(static[0], static[1], static[2], w13, w2)
        return (out, *torch.autograd.grad(out, (static[0], static[2]), torch.ones_like(out)))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (1, 2, 3):
        x2, ids2, w2_, _, _ = _gpu_block(seed=seed)
        with torch.no_grad():
            static[0].copy_(x2)
            static[1].copy_(ids2)
            static[2].copy_(w2_)
        graph.replay()
        leaves = [x2.requires_grad_(), w2_.requires_grad_()]
        out = moe_experts(leaves[0], ids2, leaves[1], w13, w2)
        eager = (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))
        for name, a, b in zip(("out", "dx", "dweights"), captured, eager):
            assert torch.equal(a, b), f"replay {seed}: {name} differs from eager"


@needs_cuda
@pytest.mark.gpu
def test_bf16_block_on_gpu_against_fp64():
    x, ids, weights, w13, w2 = _gpu_block(T=1000, d=520, n=200, E=12, k=3)
    dout = torch.randn_like(x)
    got = run("triton", x, ids, weights, w13, w2, dout=dout)
    want = fp64_grads(x, ids, weights, w13, w2, dout)
    for name, a, b in zip(NAMES, got, want):
        err = relerr(a.cpu(), b)
        assert err <= BF16_BLOCK_TOL, f"bf16 {name}: relerr {err:.2e} > {BF16_BLOCK_TOL}"


def test_swiglu_backward_with_w_through_tma(monkeypatch):
    """The SwiGLU backward's w2 through the descriptor the kernel makes (gathered dout rows by pointers): the plan
    takes it at any size here, and every gradient still matches."""
    from moegemm._src.torch import launch

    plan.constrain(tma_load=True, tma_load_min_flops=0)
    taken = []
    original = launch._fused_launch

    def spy(*spec):
        chosen = original(*spec)
        taken.append((spec[10], chosen.meta["TMA_LOAD"]))
        return chosen

    spy.cache_clear = original.cache_clear  # plan.reset clears the launch caches
    monkeypatch.setattr(launch, "_fused_launch", spy)
    args = make(12, 64, 32, 3, 2, dtype=torch.bfloat16, seed=9)  # TMA loads take 2-byte operands
    dout = torch.randn(12, 64, device=DEVICE, dtype=torch.bfloat16)
    for name, a, b in zip(NAMES, run("triton", *args, dout=dout), fp64_grads(*args, dout)):
        err = relerr(a.cpu(), b)
        assert err <= BF16_BLOCK_TOL, f"bf16 {name}: relerr {err:.2e} > {BF16_BLOCK_TOL}"
    assert ("swiglu_bwd", True) in taken, taken
    assert ("swiglu", False) in taken, taken  # fc1's w rows are two runs per tile: no descriptor


@pytest.mark.parametrize("in_kernel", [True, False])
def test_wgrad_rows_gathered_in_kernel_or_copied(in_kernel):
    """Both arms of plan.wgrad_gathers_rows give the same gradients."""
    plan.constrain(wgrad_gather=in_kernel)
    check_all("triton", make(10, 40, 24, 4, 2, seed=10))


def test_second_backward_raises_clearly():
    x, ids, weights, w13, w2 = make(6, 16, 8, 3, 2)
    x.requires_grad_()
    out = moe_experts(x, ids, weights, w13, w2, backend="triton")
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.sum().backward()


@pytest.mark.parametrize("backend, wgrad_gather", [("triton", True), ("triton", False), ("reference", None)])
@pytest.mark.parametrize("case", ["spread", "one rank idle"])
def test_expert_base_local_steps_sum_to_the_whole_block(backend, wgrad_gather, case):
    """Expert parallelism's local step (docs/design.md, 'Expert parallelism'): with w13/w2 holding experts
    [expert_base, expert_base + E_local), the choices of other experts are absent, so the P local steps' outputs
    and dx, dweights sum to the whole block's, and each step's dw13/dw2 are the whole block's slices. The launches
    leave the absent rows unwritten (outputs NaN-poisoned by conftest) and the combine never reads them; the
    wgrads read the routed rows by index or from copies of them alone (``wgrad_gather``)."""
    plan.constrain(wgrad_gather=wgrad_gather)
    P, El = 3, 2
    x, ids, weights, w13, w2 = make(11, 24, 16, P * El, 3, seed=5)
    if case == "one rank idle":
        ids = ids % (2 * El)  # rank 2's experts get no token
    dout = torch.randn(x.shape, dtype=torch.float32, device=DEVICE)
    want = fp64_grads(x, ids, weights, w13, w2, dout)
    total = [0.0, 0.0, 0.0]
    dw13, dw2 = [], []
    for r in range(P):
        local = (x, weights, w13[r * El : (r + 1) * El], w2[r * El : (r + 1) * El])
        leaves = [t.detach().clone().requires_grad_() for t in local]
        out = _moe.moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend, expert_base=r * El)
        grads = torch.autograd.grad(out, leaves, dout)
        for i, v in enumerate((out.detach(), grads[0], grads[1])):
            total[i] = total[i] + v
        dw13.append(grads[2])
        dw2.append(grads[3])
    got = (*total, torch.cat(dw13), torch.cat(dw2))
    for name, a, b in zip(NAMES, got, want):
        assert_rel_close(a.cpu(), b, torch.float32, what=f"{backend} {name}")
