"""Trains a small MoE block with GroupedLinear in BF16 and in each FP8 recipe; plots the loss curves.

The block: a fixed top-1 router (tokens to experts by a hash), fc1 -> GELU -> fc2 as two GroupedLinear
layers, learning a fixed random teacher MoE of the same shape (``--task``):

- ``regression``: the teacher's output, MSE loss. Its floor is zero: what is left is what the block has not
  learned, and the FP8 forward's own quantization noise is a large part of it.
- ``classification``: a label per token drawn from softmax(the teacher's output through a fixed random head),
  cross-entropy through the student's own BF16 head. The labels' entropy is the loss's floor, as the data's
  entropy is a language model's.

A seed sets the initial weights and the order of the batches; at each of ``--seeds`` seeds every recipe starts
from the same weights and sees the same batches, so its curve differs from BF16's only by the FP8 numerics.
BF16's run-to-run spread is the range of its final losses over the seeds. Two losses are compared with it, per
seed:

- the training loss (mean of the last 20 steps), the recipe's own FP8 forward: it carries that forward's
  quantization noise;
- the held-out loss of the trained weights run in BF16 (8 batches no run trained on): what the FP8 training
  learned, without the FP8 forward's noise.

Usage (GPU):

    python examples/fp8_training.py --steps 300 --seeds 3 --out /tmp/fp8-loss
    python examples/fp8_training.py --task classification --out /tmp/fp8-loss-ce
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moegemm.torch import GroupedLinear

RUNS = (None, "tensorwise", "rowwise", "blockwise")


HELD_OUT = 8  # evaluation batches, from a stream no training run draws from
EVAL_STREAM = 0  # training seeds start at 1
CLASSES = 512
TEMPERATURE = 4.0  # times the teacher's logits normalized to unit deviation: ~2 nats where those are Gaussian


def batch(stream, step, tokens, hidden, experts, device):
    """Batch ``step`` of stream ``stream``: tokens sorted by expert, and the group sizes."""
    gen = torch.Generator(device=device).manual_seed(1_000_003 * stream + step)
    x = torch.randn(tokens, hidden, device=device, generator=gen)
    expert = torch.randint(0, experts, (tokens,), device=device, generator=gen)
    order = torch.argsort(expert, stable=True)
    sizes = torch.bincount(expert, minlength=experts).to(torch.int32)
    return x[order].to(torch.bfloat16), sizes, gen


class Block(torch.nn.Module):
    def __init__(self, experts, hidden, ffn, recipe, device, backend="auto"):
        super().__init__()
        kw = dict(dtype=torch.bfloat16, device=device, fp8_recipe=recipe, backend=backend)
        self.fc1 = GroupedLinear(experts, hidden, ffn, **kw)
        self.fc2 = GroupedLinear(experts, ffn, hidden, **kw)

    def forward(self, x, sizes):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x, sizes)), sizes)


class Model(torch.nn.Module):
    """The block, then (classification) a BF16 head to CLASSES logits."""

    def __init__(self, args, recipe, device):
        super().__init__()
        self.block = Block(args.experts, args.hidden, args.ffn, recipe, device, args.backend)
        self.head = None
        if args.task == "classification":
            self.head = torch.nn.Linear(args.hidden, CLASSES, bias=False, dtype=torch.bfloat16, device=device)

    def forward(self, x, sizes):
        y = self.block(x, sizes)
        return y if self.head is None else self.head(y)


def targets(teacher, x, sizes, gen, task):
    """The teacher's output (regression), or a label a token drawn from its softmax (classification)."""
    out = teacher(x, sizes).float()
    if task == "regression":
        return out
    logits = TEMPERATURE * (out - out.mean(-1, keepdim=True)) / out.std(-1, keepdim=True)
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)


def loss_fn(out, target, task):
    if task == "regression":
        return torch.nn.functional.mse_loss(out.float(), target)
    return torch.nn.functional.cross_entropy(out.float(), target)


def train(recipe, seed, args, device):
    """(training losses a step, held-out loss of the trained weights in BF16)."""
    torch.manual_seed(0)
    teacher = Model(args, None, device)
    torch.manual_seed(seed)
    model = Model(args, recipe, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        x, sizes, gen = batch(seed, step, args.tokens, args.hidden, args.experts, device)
        with torch.no_grad():
            target = targets(teacher, x, sizes, gen, args.task)
        loss = loss_fn(model(x, sizes), target, args.task)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    bf16 = Model(args, None, device)
    with torch.no_grad():
        for mine, theirs in zip(bf16.parameters(), model.parameters(), strict=True):
            mine.copy_(theirs)
        held_out = 0.0
        for step in range(HELD_OUT):
            x, sizes, gen = batch(EVAL_STREAM, step, args.tokens, args.hidden, args.experts, device)
            held_out += loss_fn(bf16(x, sizes), targets(teacher, x, sizes, gen, args.task), args.task).item()
    return losses, held_out / HELD_OUT


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--task", choices=("regression", "classification"), default="regression")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--backend", default="auto", help="GroupedLinear's backend (reference: the plain twins)")
    p.add_argument("--seeds", type=int, default=3, help="initial weights per recipe (BF16's spread needs 2+)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/fp8-loss"))
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seeds = range(1, args.seeds + 1)
    runs = {
        f"{recipe or 'bf16'}/{seed}": train(recipe, seed, args, device) for seed in seeds for recipe in RUNS
    }
    curves = {name: run[0] for name, run in runs.items()}
    metrics = {
        "final": {name: sum(c[-20:]) / len(c[-20:]) for name, c in curves.items()},  # the last 20 steps
        "held_out_bf16": {name: run[1] for name, run in runs.items()},
    }
    summary = {}
    for metric, values in metrics.items():
        bf16 = [values[f"bf16/{seed}"] for seed in seeds]
        spread = max(bf16) - min(bf16)
        summary[metric] = {"bf16": bf16, "bf16_spread": spread}
        print(f"{metric}: bf16 over {args.seeds} seeds {min(bf16):.6f}-{max(bf16):.6f} (spread {spread:.2e})")
        for recipe in RUNS[1:]:
            gaps = [values[f"{recipe}/{seed}"] - values[f"bf16/{seed}"] for seed in seeds]
            within = all(abs(gap) <= spread for gap in gaps)
            summary[metric][recipe] = {
                "values": [values[f"{recipe}/{seed}"] for seed in seeds],
                "gap_to_bf16": gaps,
                "within_bf16_spread": within,
            }
            print(
                f"  {recipe:10s} minus bf16's, per seed: {', '.join(f'{g:+.2e}' for g in gaps)}  within: {within}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {"args": vars(args) | {"out": str(args.out)}, "summary": summary, "curves": curves}, indent=1
        )
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"bf16": "k", "tensorwise": "C0", "rowwise": "C1", "blockwise": "C2"}
    for name, curve in curves.items():
        recipe, seed = name.split("/")
        ax.plot(curve, color=colors[recipe], label=recipe if seed == "1" else None, lw=0.8, alpha=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss" if args.task == "regression" else "cross-entropy (nats)")
    ax.set_title(f"GroupedLinear MoE block, {args.experts} experts, {args.tokens} tokens/step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
