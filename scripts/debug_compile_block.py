"""Localizes test_compile_fullgraph_moe_block's CUDA-only dx mismatch: eager vs compiled vs an fp64 CPU oracle,
with either dx path (router / expert gather) detached in turn."""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
from torch import nn

from moegemm.torch import GroupedLinear

G, K = 4, 24


class Block(nn.Module):
    def __init__(self, backend, device, detach_router=False, detach_gather=False):
        super().__init__()
        self.router = nn.Linear(K, G, bias=False, device=device)
        self.fc1 = GroupedLinear(G, K, 16, device=device, backend=backend)
        self.fc2 = GroupedLinear(G, 16, K, bias=False, device=device, backend=backend)
        self.detach_router, self.detach_gather = detach_router, detach_gather

    def forward(self, x):
        xr = x.detach() if self.detach_router else x
        probs, experts = self.router(xr).softmax(-1).topk(2, dim=-1)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        tokens = order // 2
        gs = torch.zeros(G, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        xg = x[tokens]
        if self.detach_gather:
            xg = xg.detach()
        h = self.fc2(nn.functional.gelu(self.fc1(xg, gs)), gs)
        h = h * probs.flatten()[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, tokens, h)


def run(block, x, compile_backend=None):
    x = x.detach().clone().requires_grad_()
    fn = torch.compile(block, fullgraph=True, backend=compile_backend) if compile_backend else block
    y = fn(x)
    y.square().sum().backward()
    out = {"y": y.detach().cpu().double(), "dx": x.grad.cpu().double()}
    for name, p in block.named_parameters():
        out["d" + name] = p.grad.cpu().double()
    block.zero_grad(set_to_none=True)
    return out


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    rows = []
    for backend in ("triton", "reference"):
        for dr, dg in ((False, False), (True, False), (False, True)):
            torch.manual_seed(0)
            block = Block(backend, device, dr, dg)
            x = torch.randn(12, K, device=device)
            oracle_block = copy.deepcopy(block).cpu().double()
            for m in (oracle_block.fc1, oracle_block.fc2):
                m.backend = "reference"
            oracle = run(oracle_block, x.cpu().double())
            results = {"eager": run(block, x)}
            for cb in ("eager", "aot_eager"):
                torch._dynamo.reset()
                try:
                    results["compiled-" + cb] = run(block, x, cb)
                except Exception as e:  # noqa: BLE001
                    results["compiled-" + cb] = repr(e)[:300]
            for mode, res in results.items():
                row = {"backend": backend, "detach_router": dr, "detach_gather": dg, "mode": mode}
                if isinstance(res, str):
                    row["error"] = res
                else:
                    row.update({k: rel(v, oracle[k]) for k, v in res.items()})
                print(json.dumps(row))
                rows.append(row)
    out = os.environ.get("OUT")
    if out:
        with open(f"{out}/debug_compile_block.json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
