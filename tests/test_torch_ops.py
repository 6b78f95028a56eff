"""PyTorch glue: autograd, torch.compile, group_sizes forms, bad input and the syncing check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import BACKENDS, DEVICE, needs_cuda

from moegemm._src.torch import args as api  # the argument handling: CHECK_BY_DEFAULT, resolve_backend
from moegemm._src.torch.args import resolve_backend
from moegemm.testing import assert_rel_close
from moegemm.torch import k_grouped_mm, m_grouped_mm

SIZES = [9, 0, 14, 6]  # sum 29 < M: rows 29..32 are unowned


def per_group_loop(x, w, sizes):
    """torch autograd oracle: a loop of matmuls over host-side splits; unowned rows 0."""
    outs, start = [], 0
    for g, s in enumerate(sizes):
        outs.append(x[start : start + s] @ w[g])
        start += s
    outs.append(x[start:].new_zeros(x.shape[0] - start, w.shape[2]) + 0 * x[start:, :1])
    return torch.cat(outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["transpose_w", "k-major"])
def test_m_grouped_autograd_matches_loop(backend, layout):
    M, K, N = 33, 20, 12
    x = torch.randn(M, K, device=DEVICE, requires_grad=True)
    if layout == "transpose_w":
        storage = torch.randn(len(SIZES), N, K, device=DEVICE, requires_grad=True)
        w = storage.mT
    else:
        storage = w = torch.randn(len(SIZES), K, N, device=DEVICE, requires_grad=True)
    dy = torch.randn(M, N, device=DEVICE)
    gs = torch.tensor(SIZES, device=DEVICE)
    out = m_grouped_mm(x, w, gs, backend=backend)
    gx, gw = torch.autograd.grad(out, (x, storage), dy)
    x64, s64 = x.detach().double().requires_grad_(), storage.detach().double().requires_grad_()
    w64 = s64.mT if layout == "transpose_w" else s64
    ref = per_group_loop(x64, w64, SIZES)
    rx, rw = torch.autograd.grad(ref, (x64, s64), dy.double())
    assert_rel_close(out.detach().cpu(), ref.detach().cpu(), torch.float32, what="out")
    assert_rel_close(gx.cpu(), rx.cpu(), torch.float32, what="dx")
    assert_rel_close(gw.cpu(), rw.cpu(), torch.float32, what="dw")
    assert gw.shape == storage.shape
    assert torch.equal(gw[1], torch.zeros_like(gw[1])), "empty group must get an exactly zero weight gradient"
    assert torch.equal(gx[29:], torch.zeros_like(gx[29:])), "unowned rows must get zero input gradient"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["transpose_w", "k-major"])
@pytest.mark.parametrize("wants", ["x-w-bias", "bias-only"])
def test_m_grouped_bias_autograd_matches_loop(backend, layout, wants):
    """dbias comes from the wgrad launch (transpose_w layout, weight grad wanted) or its own launch (else)."""
    M, K, N = 33, 20, 12
    G = len(SIZES)
    x = torch.randn(M, K, device=DEVICE, requires_grad=wants != "bias-only")
    storage = (
        torch.randn(G, N, K, device=DEVICE)
        if layout == "transpose_w"
        else torch.randn(G, K, N, device=DEVICE)
    )
    storage.requires_grad_(wants != "bias-only")
    w = storage.mT if layout == "transpose_w" else storage
    bias = torch.randn(G, N, device=DEVICE, requires_grad=True)
    dy = torch.randn(M, N, device=DEVICE)
    gs = torch.tensor(SIZES, device=DEVICE)
    out = m_grouped_mm(x, w, gs, bias=bias, backend=backend)
    wrt = (x, storage, bias) if wants != "bias-only" else (bias,)
    grads = torch.autograd.grad(out, wrt, dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, storage, bias)]
    x64, s64, b64 = leaves
    w64 = s64.mT if layout == "transpose_w" else s64
    rows = torch.repeat_interleave(torch.arange(G), torch.tensor(SIZES))
    ref = per_group_loop(x64, w64, SIZES) + torch.cat([b64[rows.to(DEVICE)], b64.new_zeros(M - len(rows), N)])
    refs = torch.autograd.grad(
        ref, [leaves[i] for i in ((0, 1, 2) if wants != "bias-only" else (2,))], dy.double()
    )
    assert_rel_close(out.detach().cpu(), ref.detach().cpu(), torch.float32, what="out")
    for name, got, want in zip(("dx", "dw", "dbias")[-len(grads) :], grads, refs, strict=True):
        assert_rel_close(got.cpu(), want.cpu(), torch.float32, what=name)
    assert torch.equal(grads[-1][1], torch.zeros(N, device=DEVICE)), "empty group: dbias must be exactly 0"


@pytest.mark.parametrize("backend", BACKENDS)
def test_m_grouped_double_backward_with_bias(backend):
    """create_graph=True: dx, dw and dbias are differentiable (dbias may not come from the fused column
    sums, which are not); a gradient penalty over all three matches the loop oracle's."""
    M, K, N = 33, 20, 12
    G = len(SIZES)
    x = torch.randn(M, K, device=DEVICE, requires_grad=True)
    storage = torch.randn(G, N, K, device=DEVICE, requires_grad=True)  # the transpose_w (fused dbias) layout
    bias = torch.randn(G, N, device=DEVICE, requires_grad=True)
    dy = torch.randn(M, N, device=DEVICE, requires_grad=True)
    gs = torch.tensor(SIZES, device=DEVICE)
    rows = torch.repeat_interleave(torch.arange(G), torch.tensor(SIZES)).to(DEVICE)

    def penalty_grads(forward, leaves):
        grads = torch.autograd.grad(forward(*leaves[:3]), leaves[:3], leaves[3], create_graph=True)
        # The penalty is linear in bias's absence: it depends on x, w and dy (dbias = column sums of dy).
        return torch.autograd.grad(sum(g.square().sum() for g in grads), (leaves[0], leaves[1], leaves[3]))

    def ours(x, s, b):
        return m_grouped_mm(x, s.mT, gs, bias=b, backend=backend)

    def loop(x, s, b):
        return per_group_loop(x, s.mT, SIZES) + torch.cat([b[rows], b.new_zeros(M - len(rows), N)])

    got = penalty_grads(ours, (x, storage, bias, dy))
    want = penalty_grads(loop, [t.detach().double().requires_grad_() for t in (x, storage, bias, dy)])
    for name, g, w in zip(("x", "w", "dy"), got, want, strict=True):
        assert_rel_close(g.cpu(), w.cpu(), torch.float32, what=f"d(penalty)/d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_grouped_autograd(backend):
    M, K, N = 31, 10, 12
    a = torch.randn(M, K, device=DEVICE, requires_grad=True)
    b = torch.randn(M, N, device=DEVICE, requires_grad=True)
    gs = torch.tensor([10, 0, 15], device=DEVICE)
    out = k_grouped_mm(a, b, gs, backend=backend)
    dout = torch.randn_like(out)
    ga, gb = torch.autograd.grad(out, (a, b), dout)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = torch.stack([a64[:10].T @ b64[:10], a64[:0].T @ b64[:0], a64[10:25].T @ b64[10:25]])
    ra, rb = torch.autograd.grad(ref, (a64, b64), dout.double())
    assert_rel_close(ga.cpu(), ra.cpu(), torch.float32, what="da")
    assert_rel_close(gb.cpu(), rb.cpu(), torch.float32, what="db")


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    M, K, N, G = 40, 16, 24, 3
    w1 = torch.randn(G, N, K, device=DEVICE, requires_grad=True)
    w2 = torch.randn(G, K, N, device=DEVICE, requires_grad=True)
    x = torch.randn(M, K, device=DEVICE, requires_grad=True)
    gs = torch.tensor([12, 0, 28], device=DEVICE)

    b1 = torch.randn(G, N, device=DEVICE, requires_grad=True)

    def mlp(x, gs):
        h = torch.relu(m_grouped_mm(x, w1.mT, gs, bias=b1))
        return m_grouped_mm(h, w2.mT, gs).square().sum() + k_grouped_mm(x, h, gs).sum()

    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    loss = compiled(x, gs)
    grads = torch.autograd.grad(loss, (x, w1, w2, b1))
    loss_eager = mlp(x, gs)
    grads_eager = torch.autograd.grad(loss_eager, (x, w1, w2, b1))
    assert_rel_close(loss.detach().reshape(1).cpu(), loss_eager.detach().reshape(1).cpu(), torch.float32)
    for g, ge in zip(grads, grads_eager, strict=True):
        assert_rel_close(g.cpu(), ge.cpu(), torch.float32)


@pytest.mark.gpu
def test_group_sizes_forms_agree():
    x = torch.randn(20, 8, device=DEVICE)
    w = torch.randn(2, 8, 8, device=DEVICE)
    outs = [
        m_grouped_mm(x, w, gs)
        for gs in ([5, 15], torch.tensor([5, 15]), torch.tensor([5, 15], device=DEVICE))
    ]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


# ---------------------------------------------------------------- bad input


def _mm_args(M=10, K=8, N=6, G=2, dtype=torch.float32):
    return torch.randn(M, K, dtype=dtype), torch.randn(G, K, N, dtype=dtype), [4, 6]


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda x, w, gs: (x, torch.randn(2, 9, 6), gs), ValueError, r"x \(10, 8\), w \(2, 9, 6\)"),
        (lambda x, w, gs: (x[None], w, gs), ValueError, "x \\[M, K\\]"),
        (lambda x, w, gs: (x, w, [1, 2, 3]), ValueError, "3 entries but the weight has G=2"),
        (lambda x, w, gs: (x, w, torch.tensor([4.0, 6.0])), TypeError, "int32 or int64, got torch.float32"),
        (lambda x, w, gs: (x, w, torch.tensor([[4, 6]])), ValueError, r"1-D \[G\], got shape \(1, 2\)"),
        (lambda x, w, gs: (x, w, [4.0, 6.5]), TypeError, r"must hold integers, got \[4.0, 6.5\]"),
        (lambda x, w, gs: (x.half(), w, gs), TypeError, "share a dtype"),
        (lambda x, w, gs: (x.to(torch.int32), w, gs), TypeError, "x must be bfloat16, float16 or float32"),
    ],
    ids=[
        "k-mismatch",
        "x-rank",
        "group-count",
        "sizes-dtype",
        "sizes-rank",
        "float-list",
        "mixed-dtype",
        "int-x",
    ],
)
def test_m_grouped_bad_input(mutate, exc, match):
    with pytest.raises(exc, match=match):
        m_grouped_mm(*mutate(*_mm_args()))


@pytest.mark.parametrize(
    "bias,exc,match",
    [
        (torch.randn(2, 5), ValueError, r"bias must be \[G, N\] = \(2, 6\) for w \(2, 8, 6\), got \(2, 5\)"),
        (torch.randn(6), ValueError, r"bias must be \[G, N\] = \(2, 6\)"),
        (torch.randn(2, 6, dtype=torch.float64), TypeError, "x, w and bias must share a dtype"),
    ],
    ids=["bias-shape", "bias-rank", "bias-dtype"],
)
def test_m_grouped_bad_bias(bias, exc, match):
    x, w, gs = _mm_args()
    with pytest.raises(exc, match=match):
        m_grouped_mm(x, w, gs, bias=bias)


def test_k_grouped_bad_input():
    a, b = torch.randn(10, 4), torch.randn(10, 5)
    with pytest.raises(ValueError, match=r"a \(10, 4\), b \(9, 5\)"):
        k_grouped_mm(a, b[:9], [5, 5])
    with pytest.raises(ValueError, match=r"\[G, K, N\] = \(2, 4, 5\), got \(2, 5, 4\)"):
        k_grouped_mm(a, b, [5, 5], out=torch.empty(2, 5, 4))
    with pytest.raises(TypeError, match="float32 to accumulate"):
        k_grouped_mm(a, b, [5, 5], out=torch.empty(2, 4, 5, dtype=torch.bfloat16), accumulate=True)
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        k_grouped_mm(a, b, [5, 5], accumulate=True)
    with pytest.raises(TypeError, match="out_dtype must be"):
        k_grouped_mm(a, b, [5, 5], out_dtype=torch.int32)
    with pytest.raises(ValueError, match="group_sizes is required for high-precision operands"):
        k_grouped_mm(a, b)


@pytest.mark.parametrize(
    "sizes,match",
    [
        ([4, -1], r"negative entries \(group, size\): \[\(1, -1\)\]"),
        ([4, 7], "sum\\(group_sizes\\) = 11 exceeds the 10 rows"),
    ],
)
def test_check_option_reports_values(sizes, match, monkeypatch):
    x, w, _ = _mm_args()
    with pytest.raises(ValueError, match=match):
        m_grouped_mm(x, w, sizes, check=True)
    with pytest.raises(ValueError, match=match):
        k_grouped_mm(x, x, sizes, check=True)
    monkeypatch.setattr(api, "CHECK_BY_DEFAULT", True)  # what MOEGEMM_CHECK=1 at import sets
    with pytest.raises(ValueError, match=match):
        m_grouped_mm(x, w, sizes)
    monkeypatch.setattr(api, "CHECK_BY_DEFAULT", False)
    m_grouped_mm(x, w, sizes)  # unchecked: clamps, no error


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), ("", False)])
def test_moegemm_check_env_sets_the_default_at_import(value, expected):
    code = "from moegemm._src.torch import args; print(args.CHECK_BY_DEFAULT)"
    env = {**os.environ, "MOEGEMM_CHECK": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(expected)


def test_backend_choice_is_explicit():
    with pytest.raises(ValueError, match="backend must be"):
        resolve_backend("cutlass", torch.device("cpu"))
    assert resolve_backend("reference", torch.device(DEVICE)) == "reference"
    assert resolve_backend("auto", torch.device(DEVICE)) == "triton"  # CUDA, or CPU under the interpreter


def test_public_api_is_declared():
    """moegemm.torch exports exactly its public names, and its public modules define no other."""
    import moegemm.torch as mt
    from moegemm.torch import api as public_api
    from moegemm.torch import grouped_linear, integrations, moe, moe_layer, reference

    assert sorted(mt.__all__) == [
        "Fp8Tensor",
        "Fp8WeightCache",
        "GroupedLinear",
        "MoE",
        "Router",
        "TokenDispatcher",
        "TorchtitanTokenDispatcher",
        "k_grouped_mm",
        "k_grouped_mm_reference",
        "m_grouped_mm",
        "m_grouped_mm_reference",
        "moe_experts",
        "moe_experts_reference",
        "quantize_fp8",
    ]
    assert all(hasattr(mt, name) for name in mt.__all__)
    for module in (public_api, grouped_linear, reference, moe, moe_layer, integrations):
        defined = {
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
        }
        assert defined == set(module.__all__), module.__name__


def _host_sizes_ops():
    """(name, call(group_sizes) -> result, reference(sizes list) -> fp64 result) on small bf16 inputs."""
    from moegemm.torch import GroupedLinear, k_grouped_mm_reference, m_grouped_mm_reference

    torch.manual_seed(0)
    M, K, N = 128, 64, 48
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(4, K, N, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    layer = GroupedLinear(4, K, N, dtype=torch.bfloat16, device=DEVICE)
    cpu = [t.double().cpu() for t in (x, w, dy)]
    return {
        "m_grouped_mm": (
            lambda gs: m_grouped_mm(x, w, gs),
            lambda s: m_grouped_mm_reference(cpu[0], cpu[1], torch.tensor(s)),
        ),
        "k_grouped_mm": (
            lambda gs: k_grouped_mm(x, dy, gs),
            lambda s: k_grouped_mm_reference(cpu[0], cpu[2], torch.tensor(s), out_dtype=torch.float64),
        ),
        "GroupedLinear": (
            lambda gs: layer(x, gs).detach(),
            lambda s: m_grouped_mm_reference(
                cpu[0],
                layer.weight.detach().double().cpu().mT,
                torch.tensor(s),
                layer.bias.detach().double().cpu(),
            ),
        ),
    }


@pytest.mark.gpu
@needs_cuda  # the race is between the host and a busy stream
@pytest.mark.parametrize("host", ["pinned", "pageable", "list"])
@pytest.mark.parametrize("op", ["m_grouped_mm", "k_grouped_mm", "GroupedLinear"])
def test_host_group_sizes_can_be_reused_at_once(op, host):
    """A caller refills its host-side routing buffer right after the call, while the stream is still busy
    with earlier work: the kernels must see the values of the call, never the refill."""
    call, reference = _host_sizes_ops()[op]
    sizes, refill = [40, 0, 60, 28], [0, 128, 0, 0]
    make = (
        (lambda: list(sizes))
        if host == "list"
        else (lambda: torch.tensor(sizes, dtype=torch.int32, pin_memory=host == "pinned"))
    )
    call(make())  # compile first, so the timed call below is only queued work
    torch.cuda.synchronize()
    gs = make()
    torch.cuda._sleep(500_000_000)  # ~0.3 s of GPU time queued ahead of the copy and the kernel
    out = call(gs)
    if host == "list":
        gs[:] = refill
    else:
        gs.copy_(torch.tensor(refill))
    torch.cuda.synchronize()
    dtype = torch.float32 if op == "k_grouped_mm" else torch.bfloat16
    assert_rel_close(
        out.cpu(), reference(sizes), dtype, what=f"{op} with {host} sizes refilled after the call"
    )


@pytest.mark.gpu
@needs_cuda
def test_host_group_sizes_refused_under_graph_capture():
    """Host sizes would be frozen into a captured graph (and read from a freed staging buffer on replay)."""
    x = torch.randn(32, 16, device=DEVICE)
    w = torch.randn(2, 16, 8, device=DEVICE)
    m_grouped_mm(x, w, torch.tensor([16, 16], device=DEVICE))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for sizes in ([16, 16], torch.tensor([16, 16])):
            with pytest.raises(
                ValueError, match=r"group_sizes must be a CUDA tensor under CUDA graph capture"
            ):
                m_grouped_mm(x, w, sizes)
