"""The examples run end to end on CPU (the reference backend), with tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_fp8_training_compares_every_recipe_with_bf16(tmp_path, task):
    example = _load("fp8_training")
    out = tmp_path / "loss"
    example.main(
        ["--task", task, "--steps", "6", "--tokens", "128", "--hidden", "64", "--ffn", "128", "--seeds", "2",
         "--backend", "reference", "--out", str(out)]
    )  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    curves = result["curves"]
    assert sorted(curves) == sorted(f"{r or 'bf16'}/{s}" for r in example.RUNS for s in (1, 2))
    for curve in curves.values():
        assert len(curve) == 6 and all(math.isfinite(v) and v > 0 for v in curve)
    if task == "classification":
        # an untrained student's cross-entropy is near log(CLASSES); the teacher's labels are not uniform
        first = [c[0] for c in curves.values()]
        assert all(abs(v - math.log(example.CLASSES)) < 1.0 for v in first), first
    for metric in ("final", "held_out_bf16"):
        summary = result["summary"][metric]
        assert len(summary["bf16"]) == 2 and summary["bf16_spread"] >= 0
        for recipe in example.RUNS[1:]:
            gaps = summary[recipe]["gap_to_bf16"]
            values = summary[recipe]["values"]
            assert [v - b for v, b in zip(values, summary["bf16"], strict=True)] == pytest.approx(gaps)
            # the FP8 numerics move the loss, but by far less than the loss itself
            assert all(0 < abs(g) < 0.05 * b for g, b in zip(gaps, summary["bf16"], strict=True)), (
                recipe,
                gaps,
            )
