"""Smallest compiled GroupedLinear stacks, fp32 on the given device, checked against eager: which one loses grads."""

from __future__ import annotations

import sys

import torch
from torch import nn

from moegemm.torch import GroupedLinear

G, K, H = 4, 24, 16


class Stack(nn.Module):
    def __init__(self, device, bias1, bias2, layers):
        super().__init__()
        self.fc1 = GroupedLinear(G, K, H, bias=bias1, device=device)
        self.fc2 = GroupedLinear(G, H, K, bias=bias2, device=device) if layers == 2 else None

    def forward(self, x, gs):
        h = nn.functional.gelu(self.fc1(x, gs))
        return self.fc2(h, gs) if self.fc2 is not None else h


def grads(model, x, gs, compiled):
    x = x.detach().clone().requires_grad_()
    fn = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    fn(x, gs).square().sum().backward()
    out = {"dx": x.grad.clone()}
    out.update({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return out


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    only = sys.argv[2] if len(sys.argv) > 2 else None
    variants = {
        "1 layer bias": (True, False, 1), "1 layer nobias": (False, False, 1),
        "2 layers nobias": (False, False, 2), "2 layers bias1": (True, False, 2), "2 layers bias2": (False, True, 2),
    }  # fmt: skip
    for name, (b1, b2, layers) in variants.items():
        if only and name != only:
            continue
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = Stack(device, b1, b2, layers)
        x = torch.randn(12, K, device=device)
        gs = torch.tensor([3, 0, 5, 4], device=device)
        want, got = grads(model, x, gs, False), grads(model, x, gs, True)
        errs = {k: float((got[k] - want[k]).norm() / want[k].norm()) for k in want}
        print(name, {k: f"{v:.2g}" for k, v in errs.items()}, flush=True)


if __name__ == "__main__":
    main()
