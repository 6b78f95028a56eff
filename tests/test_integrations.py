"""The drop-ins of moegemm.torch.integrations against the implementations they replace.

torchtitan is not installed: ``torchtitan_moe`` below restates its GroupedExperts (per-expert loop over rows
grouped by expert, zero padding rows past the counted ones; weight names of its releases and its 2026 main).
transformers 5.x is: tiny Qwen3-MoE and Mixtral models built from a config (no weights downloaded) run once
with the stock "eager" experts and once with moegemm's; their logits and every parameter's gradient agree.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moegemm.testing import assert_rel_close
from moegemm.torch import integrations
from moegemm.torch.integrations import (
    GroupedExperts,
    from_torchtitan,
    register_transformers,
    swap_grouped_experts,
)

# These tests build CPU modules; backend="triton" runs their kernels under the interpreter there. With a GPU (no
# TRITON_INTERPRET) the kernels take CUDA tensors only: tests/test_moe.py covers them on the device.
CPU_TRITON = pytest.param(
    "triton",
    marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="CPU tensors: the kernels need the interpreter"
    ),
)


BACKEND = "reference"


class torchtitan_moe:  # noqa: N801 - stands for the module torchtitan.models.moe
    class GroupedExperts(nn.Module):
        """torchtitan's GroupedExperts semantics (its for-loop path), any weight naming, any dtype."""

        def __init__(self, dim, hidden_dim, num_experts, use_grouped_mm=True, names=("w1", "w2", "w3")):
            super().__init__()
            self.num_experts, self.use_grouped_mm, self.names = num_experts, use_grouped_mm, names
            for name, shape in zip(
                names, ((hidden_dim, dim), (dim, hidden_dim), (hidden_dim, dim)), strict=True
            ):
                setattr(self, name, nn.Parameter(torch.randn(num_experts, *shape) * 0.3))

        def forward(self, x, num_tokens_per_expert):
            w1, w2, w3 = (getattr(self, n) for n in self.names)
            counts = [int(c) for c in num_tokens_per_expert.tolist()]
            outs, start = [], 0
            for e, c in enumerate(counts):
                xe = x[start : start + c]
                outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
                start += c
            out = torch.cat(outs)
            return torch.cat([out, out.new_zeros(x.shape[0] - start, out.shape[1])])


TT_NAMES = [("w1", "w2", "w3"), ("w1_EFD", "w2_EDF", "w3_EFD")]


@pytest.mark.parametrize("backend", ["reference", CPU_TRITON])
@pytest.mark.parametrize("names", TT_NAMES, ids=["v0.2", "main"])
@pytest.mark.parametrize("counts_dtype", [torch.float32, torch.int64], ids=["histc-float", "int"])
def test_grouped_experts_matches_torchtitan(names, counts_dtype, backend):
    torch.manual_seed(0)
    stock = torchtitan_moe.GroupedExperts(12, 10, 4, names=names)
    ours = from_torchtitan(stock, backend=backend)
    for name in names:
        assert getattr(ours, name) is getattr(stock, name)  # shared, not copied
    assert list(ours.state_dict()) == list(stock.state_dict())
    counts = torch.tensor([5, 0, 7, 3], dtype=counts_dtype)  # expert 1 empty; 15 rows + 4 padding rows
    x = torch.randn(19, 12, requires_grad=True)
    dy = torch.randn(19, 12)
    out = ours(x, counts)
    out.backward(dy)
    grads = [x.grad] + [getattr(stock, n).grad for n in names]
    x64 = x.detach().double().requires_grad_()
    stock64 = copy.deepcopy(stock).double()
    for p in stock64.parameters():
        p.grad = None
    ref = stock64(x64, counts)
    ref.backward(dy.double())
    assert_rel_close(out.detach(), ref.detach(), torch.float32, what="out")
    assert torch.equal(out[15:], torch.zeros(4, 12)), "padding rows must be zero"
    ref_grads = [x64.grad] + [getattr(stock64, n).grad for n in names]
    for what, got, want in zip(["dx", *names], grads, ref_grads, strict=True):
        assert_rel_close(got, want, torch.float32, what=f"d{what}")
    assert torch.equal(grads[1][1], torch.zeros(10, 12)), "an expert with no rows gets exactly zero gradient"


def test_swap_grouped_experts_in_a_model():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "layer0": nn.ModuleDict({"experts": torchtitan_moe.GroupedExperts(8, 6, 3)}),
            "layer1": nn.ModuleDict({"experts": torchtitan_moe.GroupedExperts(8, 6, 3, names=TT_NAMES[1])}),
            "norm": nn.LayerNorm(8),
        }
    )
    keys, params = list(model.state_dict()), list(model.parameters())
    x, counts = torch.randn(9, 8), torch.tensor([4, 2, 3])
    want = [model[f"layer{i}"]["experts"](x, counts) for i in range(2)]
    assert swap_grouped_experts(model, backend=BACKEND) is model
    assert all(isinstance(model[f"layer{i}"]["experts"], GroupedExperts) for i in range(2))
    assert list(model.state_dict()) == keys and all(
        a is b for a, b in zip(model.parameters(), params, strict=True)
    )
    for i in range(2):
        assert_rel_close(model[f"layer{i}"]["experts"](x, counts), want[i], torch.float32, what=f"layer{i}")
    with pytest.raises(ValueError, match="no torchtitan GroupedExperts"):
        swap_grouped_experts(model)
    single = torchtitan_moe.GroupedExperts(8, 6, 3)
    assert isinstance(swap_grouped_experts(single), GroupedExperts)
    with pytest.raises(TypeError, match="weight sets"):
        from_torchtitan(nn.Linear(2, 2))


def test_grouped_experts_standalone_init():
    ge = GroupedExperts(16, 8, 4, names=TT_NAMES[1])
    ge.init_weights(0.01)
    assert ge.w1_EFD.shape == (4, 8, 16) and ge.w2_EDF.shape == (4, 16, 8) and ge.w3_EFD.shape == (4, 8, 16)
    assert 0.005 < ge.w2_EDF.std() < 0.015


# --- transformers ---------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers", minversion="5.0")

IMPL = register_transformers("moegemm_reference", backend=BACKEND)
IMPLS = {"reference": IMPL, "triton": register_transformers("moegemm_triton", backend="triton")}

COMMON = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}
MODELS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    ),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
}


def _spy(monkeypatch) -> list[int]:
    calls = []
    real = integrations.moe_experts

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(integrations, "moe_experts", spy)
    return calls


@pytest.mark.parametrize("backend", ["reference", CPU_TRITON])
@pytest.mark.parametrize("model", list(MODELS))
def test_transformers_model_matches_stock_experts(model, backend, monkeypatch):
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(MODELS[model](), experts_implementation="eager")
    with torch.no_grad():  # a stronger init than the config's, so that experts matter in the logits
        for name, p in stock.named_parameters():
            if "experts" in name:
                p.mul_(10)
    ours = copy.deepcopy(stock)
    ours.set_experts_implementation(IMPLS[backend])
    assert ours.config._experts_implementation == IMPLS[backend]
    ids = torch.randint(0, 64, (2, 9))
    calls = _spy(monkeypatch)
    got = ours(ids, labels=ids)
    assert calls == [18, 18], "both layers' experts must run on moegemm"
    want = stock(ids, labels=ids)
    assert_rel_close(got.logits.detach(), want.logits.detach(), torch.float32, what=f"{model} logits")
    got.loss.backward()
    want.loss.backward()
    stock_params = dict(stock.named_parameters())
    for name, p in ours.named_parameters():
        assert_rel_close(p.grad, stock_params[name].grad, torch.float32, what=f"{model} d{name}")


def test_transformers_from_config_with_implementation(monkeypatch):
    calls = _spy(monkeypatch)
    model = transformers.AutoModelForCausalLM.from_config(MODELS["qwen3_moe"](), experts_implementation=IMPL)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 32, 32) and experts.down_proj.shape == (8, 32, 16)
    model(torch.randint(0, 64, (1, 5)))
    assert len(calls) == 2


def test_transformers_unsupported_experts_raise():
    from transformers.integrations.moe import _default_apply_gate

    class Experts(nn.Module):
        _apply_gate = _default_apply_gate

    e = Experts()
    e.gate_up_proj, e.down_proj = torch.zeros(2, 8, 4), torch.zeros(2, 4, 4)
    e.has_gate, e.has_bias, e.is_transposed, e.is_concatenated, e.act_fn = True, True, False, True, nn.SiLU()
    args = (torch.zeros(3, 4), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))
    with pytest.raises(NotImplementedError, match="has_bias=True"):
        integrations.transformers_experts_forward(e, *args)
    e.has_bias, e.act_fn = False, nn.GELU()
    with pytest.raises(NotImplementedError, match="GELU"):
        integrations.transformers_experts_forward(e, *args)
    e.act_fn = nn.SiLU()
    assert integrations.transformers_experts_forward(e, *args).shape == (3, 4)
