"""moegemm.torch.moe_layer (Router, MoE) against plain PyTorch's fp64 statement of its routing and experts.

The oracle routes token by token in Python loops and runs every expert densely, so it shares no code with the
module (which runs topk/gather/masked_fill and moe_experts). The module runs in fp32 with backend="reference".
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from moegemm.testing import assert_rel_close
from moegemm.torch import moe_layer
from moegemm.torch.moe_layer import MoE

# These tests build CPU modules; backend="triton" runs their kernels under the interpreter there. With a GPU (no
# TRITON_INTERPRET) the kernels take CUDA tensors only: tests/test_moe.py covers them on the device.
CPU_TRITON = pytest.param(
    "triton",
    marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="CPU tensors: the kernels need the interpreter"
    ),
)


D, N = 16, 8  # model dim, expert hidden dim
BACKEND = "reference"


def make_moe(seed: int = 0, **kwargs) -> MoE:
    """An MoE with weights large enough that routing spreads and outputs are far from 0."""
    kwargs.setdefault("num_experts", 8)
    kwargs.setdefault("top_k", 2)
    torch.manual_seed(seed)
    kwargs.setdefault("backend", BACKEND)
    moe = MoE(D, N, kwargs.pop("num_experts"), kwargs.pop("top_k"), **kwargs)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    return moe


def oracle_route(scores: torch.Tensor, moe: MoE, expert_bias: torch.Tensor | None):
    """Per-token routing in Python: (ids [T, k] long, weights [T, k]) from scores [T, E] fp64."""
    r = moe.router
    T, E = scores.shape
    ids, weights = [], []
    for t in range(T):
        choice = [float(v) for v in scores[t].detach()]
        if expert_bias is not None:
            choice = [c + float(b) for c, b in zip(choice, expert_bias, strict=True)]
        allowed = list(range(E))
        if r.num_expert_groups is not None:
            per = E // r.num_expert_groups
            group_score = []
            for g in range(r.num_expert_groups):
                vals = sorted(choice[g * per : (g + 1) * per], reverse=True)
                group_score.append(vals[0] + vals[1] if r.score_func == "sigmoid" else vals[0])
            kept = sorted(range(r.num_expert_groups), key=lambda g: -group_score[g])[: r.num_limited_groups]
            allowed = [e for e in range(E) if e // per in kept]
        chosen = sorted(allowed, key=lambda e: -choice[e])[: r.top_k]
        w = scores[t, chosen]  # the unbiased scores, differentiable
        if r.route_norm:
            w = w / w.sum()
        ids.append(chosen)
        weights.append(w * r.route_scale)
    return torch.tensor(ids, dtype=torch.long).reshape(T, r.top_k), torch.stack(weights) if T else scores[
        :, :0
    ]


def oracle(moe: MoE, x: torch.Tensor):
    """fp64: (out [..., D], ids, scores, params dict) with every parameter an fp64 leaf requiring grad."""
    params = {name: p.detach().double().requires_grad_() for name, p in moe.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    x2 = x64.reshape(-1, D)
    logits = x2 @ params["router.gate.weight"].T
    scores = torch.sigmoid(logits) if moe.router.score_func == "sigmoid" else torch.softmax(logits, -1)
    bias = None if moe.expert_bias is None else moe.expert_bias.double()
    ids, weights = oracle_route(scores, moe, bias)
    w13, w2 = params["w13"], params["w2"]
    out = torch.zeros_like(x2)
    for t in range(x2.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            z = w13[e] @ x2[t]
            out[t] = out[t] + weights[t, j] * (w2[e] @ (F.silu(z[:N]) * z[N:]))
    if moe.shared is not None:
        s1, s2, s3 = (params[f"shared.{w}.weight"] for w in ("w1", "w2", "w3"))
        out = out + (F.silu(x2 @ s1.T) * (x2 @ s3.T)) @ s2.T
    return out.reshape(x.shape), x64, ids, scores, params


CONFIGS = {
    "softmax": {},
    "sigmoid-norm-scale": {"score_func": "sigmoid", "route_norm": True, "route_scale": 2.5, "top_k": 3},
    "softmax-groups": {"num_expert_groups": 4, "num_limited_groups": 2},
    "sigmoid-groups-norm": {
        "score_func": "sigmoid",
        "num_expert_groups": 4,
        "num_limited_groups": 2,
        "route_norm": True,
        "top_k": 3,
    },
    "shared-experts": {"shared_experts": 2},
    "k1": {"num_experts": 4, "top_k": 1},
    "bias": {"load_balance": "bias", "score_func": "sigmoid"},
}


@pytest.mark.parametrize("backend", ["reference", CPU_TRITON])
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_forward_and_gradients_match_fp64_oracle(config, backend):
    moe = make_moe(**CONFIGS[config], backend=backend)
    if moe.expert_bias is not None:
        moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, moe.num_experts))  # changes some selections
    x = torch.randn(2, 5, D, requires_grad=True)
    out = moe(x)
    ref, x64, _, _, params = oracle(moe, x)
    assert_rel_close(out.detach(), ref.detach(), torch.float32, what=f"{config} out")
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    assert_rel_close(x.grad, x64.grad, torch.float32, what=f"{config} dx")
    for name, p in moe.named_parameters():
        assert p.grad is not None, name
        assert_rel_close(p.grad, params[name].grad, torch.float32, what=f"{config} d{name}")


def test_router_selection_matches_oracle_ids():
    """Group-limited + bias selection, id by id: top-k alone would often leave the kept groups."""
    moe = make_moe(
        num_experts=16,
        top_k=4,
        score_func="sigmoid",
        num_expert_groups=8,
        num_limited_groups=2,
        load_balance="bias",
    )
    moe.expert_bias.copy_(torch.randn(16) * 0.2)
    x = torch.randn(32, D)
    weights, ids, scores = moe.router(x, moe.expert_bias)
    _, _, ref_ids, ref_scores, _ = oracle(moe, x)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    groups_used = (ids // 2).sort(-1).values
    assert ((groups_used[:, 1:] != groups_used[:, :-1]).sum(-1) <= 1).all()  # at most 2 groups per token
    unlimited = (scores + moe.expert_bias).topk(4, -1).indices // 2
    assert any(len(set(row.tolist())) > 2 for row in unlimited), "the test should exercise the group limit"
    # The bias selects; the weights are the unbiased scores of the selected experts.
    assert torch.equal(weights, scores.gather(-1, ids))


def test_expert_bias_selects_but_does_not_weight():
    moe = make_moe(load_balance="bias")
    moe.expert_bias[3] = 10.0
    x = torch.randn(12, D)
    weights, ids, scores = moe.router(x, moe.expert_bias)
    assert (ids == 3).any(-1).all()
    assert torch.equal(weights[ids == 3], scores[:, 3])
    moe(x)
    assert moe.tokens_per_expert[3] == 12


def test_aux_loss_matches_hand_computation_and_gradient():
    for score_func in ("softmax", "sigmoid"):
        moe = make_moe(score_func=score_func, aux_loss_coef=0.1, top_k=3)
        x = torch.randn(20, D)
        moe(x)
        _, _, ids, scores, params = oracle(moe, x)
        E, k, T = 8, 3, 20
        f = [sum(int((ids[t] == e).sum()) for t in range(T)) / (T * k) for e in range(E)]
        p = scores / scores.sum(-1, keepdim=True)
        want = 0.1 * E * sum(f[e] * p[:, e].mean() for e in range(E))
        assert abs(moe.aux_loss.item() - want.item()) <= 1e-6 * abs(want.item()), (
            score_func,
            moe.aux_loss,
            want,
        )
        moe.aux_loss.backward()
        want.backward()
        assert_rel_close(
            moe.router.gate.weight.grad, params["router.gate.weight"].grad, torch.float32, what="daux"
        )
    assert make_moe(load_balance=None).aux_loss is None


def test_tokens_per_expert_accumulates_in_training_only():
    moe = make_moe(top_k=3)
    x1, x2 = torch.randn(9, D), torch.randn(4, 3, D)
    want = torch.zeros(8)
    for x in (x1, x2):
        moe(x)
        _, _, ids, _, _ = oracle(moe, x)
        want += torch.bincount(ids.flatten(), minlength=8).float()
    assert torch.equal(moe.tokens_per_expert, want)
    assert moe.tokens_per_expert.sum() == (9 + 12) * 3
    moe.eval()
    moe(x1)
    assert torch.equal(moe.tokens_per_expert, want)
    moe.reset_tokens_per_expert()
    assert not moe.tokens_per_expert.any()
    assert "tokens_per_expert" not in moe.state_dict()


def test_update_expert_bias():
    moe = make_moe(load_balance="bias", bias_update_rate=0.01, num_experts=4)
    moe.expert_bias.copy_(torch.tensor([0.5, 0.0, 0.0, -0.5]))
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 4.0, 4.0]))  # mean 5
    moe.update_expert_bias()
    assert torch.equal(moe.expert_bias, torch.tensor([0.49, 0.01, 0.01, -0.49]))
    assert not moe.tokens_per_expert.any()
    moe.update_expert_bias()  # nothing counted: no change
    assert torch.equal(moe.expert_bias, torch.tensor([0.49, 0.01, 0.01, -0.49]))
    assert "expert_bias" in moe.state_dict()
    with pytest.raises(RuntimeError, match="load_balance='bias'"):
        make_moe().update_expert_bias()


def test_bias_balancing_reduces_imbalance():
    """A few updates of the aux-loss-free rule move tokens off an overloaded expert."""
    moe = make_moe(load_balance="bias", bias_update_rate=0.05, score_func="sigmoid")
    with torch.no_grad():
        moe.router.gate.weight[0] += 2.0  # expert 0 wins for most tokens
    x = torch.randn(64, D)
    moe(x)
    before = moe.tokens_per_expert.clone()
    for _ in range(20):
        moe.update_expert_bias()
        moe(x)
    assert moe.tokens_per_expert.max() < before.max(), (before, moe.tokens_per_expert)


def test_empty_input_and_shape():
    moe = make_moe(shared_experts=1)
    out = moe(torch.randn(0, D))
    assert out.shape == (0, D)
    assert torch.isfinite(moe.aux_loss)
    assert moe(torch.randn(3, 1, 2, D)).shape == (3, 1, 2, D)


@pytest.mark.parametrize("shape", [(4, 2 * D), (3, 2, D // 2), (D + 1,)], ids=str)
def test_input_of_another_dim_raises(shape):
    """x [..., d'] with d' != dim raises naming both (issue 63): x [4, 2 * dim] reshaped to [8, dim] ran as 8
    tokens and came back [4, 2 * dim]."""
    moe = make_moe()
    with pytest.raises(ValueError, match=rf"x\.shape={re.escape(str(shape))}.*dim={D}"):
        moe(torch.randn(shape))


def test_init_weights():
    torch.manual_seed(0)
    moe = MoE(64, 32, 8, 2, shared_experts=1, load_balance="bias")
    for name, p in moe.named_parameters():
        std = p.detach().std().item()
        assert 0.01 < std < 0.03 and p.abs().max() <= 0.04 + 1e-6, (name, std)
    assert moe.w13.shape == (8, 64, 64) and moe.w2.shape == (8, 64, 32)
    assert moe.router.gate.weight.shape == (8, 64) and moe.router.gate.bias is None
    assert moe.shared.w1.weight.shape == (32, 64)
    assert MoE(8, 4, 4, 2, device="meta").w13.is_meta


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"score_func": "relu"}, "score_func"),
        ({"top_k": 9}, "top_k"),
        ({"num_expert_groups": 4}, "both"),
        ({"num_expert_groups": 3, "num_limited_groups": 1}, "divide"),
        ({"num_expert_groups": 4, "num_limited_groups": 5}, "num_limited_groups"),
        ({"num_expert_groups": 4, "num_limited_groups": 1, "top_k": 3}, "exceeds"),
        ({"num_expert_groups": 8, "num_limited_groups": 2, "score_func": "sigmoid"}, "top-2"),
        ({"load_balance": "loss"}, "load_balance"),
    ],
)
def test_bad_options_raise(kwargs, match):
    kwargs = {"num_experts": 8, "top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        MoE(D, N, kwargs.pop("num_experts"), kwargs.pop("top_k"), **kwargs)


def _dense_experts(x, ids, weights, w13, w2, **_):
    """A sync-free moe_experts (every expert on every token): compile sees the module's own code only."""
    n = w2.shape[2]
    z = torch.einsum("td,efd->tef", x, w13)
    y = torch.einsum("ten,edn->ted", F.silu(z[..., :n]) * z[..., n:], w2)
    gates = torch.zeros(x.shape[0], w13.shape[0], dtype=y.dtype).scatter_add(1, ids, weights.to(y.dtype))
    return torch.einsum("te,ted->td", gates, y)


@pytest.mark.parametrize("load_balance", ["bias", "aux_loss"])
def test_module_code_compiles_fullgraph(monkeypatch, load_balance):
    """Router, counts and aux loss trace with fullgraph=True (no host sync, no graph break), fwd and bwd."""
    monkeypatch.setattr(moe_layer, "moe_experts", _dense_experts)
    moe = make_moe(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2, load_balance=load_balance)
    x = torch.randn(10, D, requires_grad=True)
    want = moe(x)
    want_aux = moe.aux_loss
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    if load_balance == "aux_loss":
        assert torch.allclose(moe.aux_loss, want_aux)
        got = got + moe.aux_loss
    got.sum().backward()
    assert x.grad is not None and moe.w13.grad is not None
    assert moe.tokens_per_expert.sum() == 2 * 10 * 2  # the compiled forward counted too


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors: the kernels need the interpreter")
def test_moe_compiles_fullgraph_with_moe_experts():
    """The whole module on moe_experts' kernels (custom ops; the Triton interpreter on CPU) traces with
    fullgraph=True, forward and backward, and matches the fp64 oracle."""
    moe = make_moe(shared_experts=1, backend="triton")
    x = torch.randn(10, D, requires_grad=True)
    got = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    ref, x64, _, _, params = oracle(moe, x)
    assert_rel_close(got.detach(), ref.detach(), torch.float32, what="compiled out")
    dy = torch.randn_like(got)
    got.backward(dy)
    ref.backward(dy.double())
    assert_rel_close(x.grad, x64.grad, torch.float32, what="compiled dx")
    assert_rel_close(moe.w13.grad, params["w13"].grad, torch.float32, what="compiled dw13")
