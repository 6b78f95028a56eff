"""``python -m moegemm.bench`` / ``moegemm-bench``: the grouped-GEMM benchmark CLI.

On a GPU it times every (case, op, impl) after checking it, and writes the canonical result of that
benchmark and device, ``benchmarks/results/<device>/<benchmark>.json`` and ``.png`` (benchmark: bf16,
bf16-balanced, jax, fp8, fp8-jax, ep, tune; ``--name`` renames it, ``--out`` puts it elsewhere).

Without a GPU it is a correctness job, not a benchmark: the CLI sets TRITON_INTERPRET=1 before anything
imports triton, moegemm's kernels run under the interpreter on the tiny suite (``shapes.TINY``), and
every (case, op, impl) is checked against the fp64 oracle. Interpreter timings are not performance, so
nothing is timed and no ratio, TF/s or roofline floor is printed. The exit status is 1 when a check
fails. Results go to ``benchmarks/results/cpu-<machine>/``, which git ignores.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

OPS = ("fwd", "dgrad", "wgrad")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="moegemm-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--cases",
        help="comma-separated case names from moegemm.shapes (default: SUITE on "
        "CUDA, TINY on CPU); 'suite', 'heldout', 'tiny' and 'all' name whole sets",
    )
    p.add_argument("--ops", default="fwd,dgrad,wgrad", help="comma-separated subset of fwd,dgrad,wgrad")
    p.add_argument("--impls", help="comma-separated impl names (default: all registered)")
    p.add_argument(
        "--split",
        default="dirichlet",
        choices=["dirichlet", "balanced", "one-hot"],
        help="group sizes via shapes.group_sizes (dirichlet: seeded skew, G/16 experts empty)",
    )
    p.add_argument("--jagged-splits", help="explicit group sizes, e.g. 100,0,28: G=len, M=sum; K, N per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--seeds",
        help="comma-separated routing seeds, each case run once per seed (default on CUDA: 0,1,2; on CPU: --seed)",
    )
    te = p.add_argument_group("TransformerEngine-style case (replaces --cases; runs fc1 and fc2)")
    te.add_argument("--num-experts", type=int)
    te.add_argument("--ep-size", type=int, default=1)
    te.add_argument("--hidden-dim", type=int)
    te.add_argument("--expert-dim", type=int)
    te.add_argument("--tokens", type=int, help="routed tokens per rank (M)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if available")
    p.add_argument(
        "--quick", action="store_true", help="shorter timing budgets (warm-up 10 ms, 40 ms of reps)"
    )
    p.add_argument(
        "--paired",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the headline clock (default on): each case-op's implementations timed taking turns call by call, "
        "L2 flushed (ms = paired_ms); immune to clock drift between one implementation's block and the next",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="JSON path (default: the canonical benchmarks/results/<device>/<benchmark>.json, overwritten; "
        "without a GPU benchmarks/results/cpu-<machine>/<benchmark>.json, ignored by git)",
    )
    p.add_argument(
        "--name",
        help="benchmark name in the default --out path (default from the mode: bf16, bf16-balanced, jax, "
        "fp8, fp8-jax, ep, tune; e.g. --name fp8-step for a GroupedLinear step run)",
    )
    p.add_argument("--plot", type=Path, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--tune",
        action="store_true",
        help="time every moegemm candidate config per case/op and "
        "write the best into src/moegemm/_src/tuned_configs/<device>.json",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        help="where --tune writes <device>.json (default: the committed "
        "src/moegemm/_src/tuned_configs/; elsewhere, the file starts as a copy of the committed one)",
    )
    model = p.add_argument_group("config cost model (moegemm/cost_model.py; no GPU needed)")
    model.add_argument(
        "--fit-model",
        nargs="+",
        type=Path,
        metavar="TUNE_JSON",
        help="fit the model to these --tune result files and write it (--out, default the committed "
        "src/moegemm/_src/tuned_configs/model-sm90.json)",
    )
    model.add_argument(
        "--extend-model",
        nargs="+",
        type=Path,
        metavar="TUNE_JSON",
        help="calibrate only the configs of these --tune files that the committed model lacks (a new "
        "candidate), everything else held, and write the model (--out, default the committed one)",
    )
    model.add_argument(
        "--eval-model",
        nargs="+",
        type=Path,
        metavar="TUNE_JSON",
        help="score the committed model's picks against the measured candidates of these --tune files "
        "(e.g. a held-out set's): model pick and table default as a share of the fastest",
    )
    model.add_argument("--sms", type=int, default=132, help="SM count of the tuned device, for --fit-model")
    p.add_argument("--overhead", action="store_true", help="also measure host time per call on a tiny shape")
    fz = p.add_argument_group("performance fuzz (moegemm.bench.fuzz; replaces --cases; --fp8: FP8)")
    fz.add_argument("--fuzz", type=int, metavar="N", help="draw N shapes from --seed's fuzz distribution")
    fz.add_argument(
        "--fuzz-twins",
        default="refused",
        choices=["refused", "all"],
        help="time the aligned twin only where it is the reference (torch refuses the shape), or always",
    )
    fz.add_argument("--fuzz-timing", default="quick", choices=["quick", "full"], help="timing budgets")
    fz.add_argument("--fuzz-max-gib", type=float, default=6.0, help="redraw cases whose bytes exceed this")
    fz.add_argument(
        "--workers",
        type=int,
        help="processes that compile the fuzz's kernels before the timing (default min(16, CPUs); 0: none)",
    )
    moe = p.add_argument_group("MoE expert block (moegemm.bench.moe): moe_experts against its peers")
    moe.add_argument("--moe", action="store_true", help="run the expert-block benchmark instead")
    moe.add_argument("--moe-shapes", help="shape names or tags (gpu, sonic, model, tiny, all); default gpu")
    moe.add_argument("--moe-routing", default="balanced,skewed", help="subset of balanced,skewed,hot")
    moe.add_argument("--moe-peers", help="impls (default: moe.DEFAULT_PEERS); see moe.IMPLS")
    ep = p.add_argument_group("expert parallelism (moegemm.bench.ep): moe_experts(ep_group=) vs torchtitan")
    ep.add_argument("--ep", action="store_true", help="run the PyTorch EP benchmark (torchrun, or spawns)")
    ep.add_argument("--ep-sizes", default="2,4", help="comma-separated EP group sizes")
    ep.add_argument("--ep-shapes", help="shape names or tags (gpu, tiny, all; default gpu, CPU: tiny)")
    fp8 = p.add_argument_group("FP8 mode (moegemm.bench.fp8): scaled grouped GEMMs with their peers")
    fp8.add_argument("--fp8", action="store_true", help="run the FP8 benchmark instead of the BF16 one")
    fp8.add_argument("--fp8-recipes", default="tensorwise,rowwise,blockwise")
    fp8.add_argument(
        "--fp8-tune-modes",
        default="promoted,fast",
        help="with --tune: accumulation modes to tune (promoted: fp32 every 128 of K; fast: fast_accum)",
    )
    fp8.add_argument(
        "--fp8-jax",
        action="store_true",
        help="with --fp8: the FP8 kernels from JAX against the same from PyTorch (device time), instead",
    )
    fp8.add_argument(
        "--fp8-step-cases", default="", help="cases for a GroupedLinear fwd+bwd step, BF16 vs each recipe"
    )
    return p.parse_args(argv)


DEFAULT_SEEDS = (0, 1, 2)


def seeds_arg(args, cuda: bool) -> tuple[int, ...]:
    """The routing seeds of a run: ``--seeds``, else three on CUDA (``DEFAULT_SEEDS``), else ``--seed``."""
    if args.seeds:
        return tuple(int(s) for s in _csv(args.seeds))
    return DEFAULT_SEEDS if cuda else (args.seed,)


def _csv(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def select_cases(args, shapes, cuda: bool):
    te = [args.num_experts, args.hidden_dim, args.expert_dim, args.tokens]
    if any(v is not None for v in te):
        if not all(v is not None for v in te):
            raise SystemExit("TE-style cases need --num-experts, --hidden-dim, --expert-dim and --tokens")
        if args.cases:
            raise SystemExit("give either --cases or the TE-style options, not both")
        return [
            shapes.te_case(args.num_experts, args.ep_size, args.hidden_dim, args.expert_dim, args.tokens, fc)
            for fc in (1, 2)
        ]
    names = _csv(args.cases)
    if not names:
        return list(shapes.SUITE if cuda else shapes.TINY)
    try:
        return shapes.select(names)
    except KeyError as exc:
        raise SystemExit(str(exc)) from None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fit_model or args.eval_model or args.extend_model:
        return _model_cli(args)
    import torch

    cuda = args.device != "cpu" and torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    if not cuda:
        # Must precede the first triton import: @triton.jit picks the interpreter at decoration time.
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped or captured: do not fold the table to 80 columns
    from moegemm.bench import report

    if not cuda:
        console.print(report.CPU_NOTICE, style="bold yellow", highlight=False)

    from moegemm import shapes
    from moegemm.bench import harness, registry, timing

    device = torch.device("cuda" if cuda else "cpu")
    env = harness.Environment.detect(device)
    ops = _csv(args.ops)
    if not ops or set(ops) - set(OPS):
        raise SystemExit(f"--ops takes a comma-separated subset of {OPS}, got {args.ops!r}")
    jagged = shapes.parse_jagged(args.jagged_splits) if args.jagged_splits else None
    if jagged is not None and (not jagged or min(jagged) < 0):
        raise SystemExit(f"--jagged-splits needs non-negative sizes, got {args.jagged_splits!r}")
    if args.tune and not (cuda and torch.cuda.get_device_capability(device) == (9, 0)):
        raise SystemExit("--tune writes sm90 configs and needs a Hopper (sm90) GPU")
    if args.fuzz:
        from moegemm.bench import fuzz

        return fuzz.main(args, argv, env, device, console)
    if args.moe:
        from moegemm.bench import moe

        return moe.main(args, argv, env, device, console)
    if args.ep:
        from moegemm.bench import ep

        return ep.main(args, argv, env, device, console)
    if args.fp8 and args.fp8_jax:
        from moegemm.bench import fp8_jax

        out = args.out or report.default_out(env.device, args.name or "fp8-jax")
        fp8_jax.run(select_cases(args, shapes, cuda), ops, _csv(args.fp8_recipes), device, out)
        return 0
    if args.fp8:
        from moegemm._src import configs
        from moegemm.bench import fp8

        out = args.out or report.default_out(env.device, args.name or "fp8")
        result = fp8.run(
            select_cases(args, shapes, cuda),
            ops,
            _csv(args.fp8_recipes),
            device,
            timing.TimingConfig.quick() if args.quick else timing.TimingConfig(),
            out,
            [shapes.get(name) for name in _csv(args.fp8_step_cases)],
            tune_dir=(args.cache_dir or configs.CACHE_DIR) if args.tune else None,
            tune_modes=_csv(args.fp8_tune_modes),
            name=args.name or "fp8",
        )
        return 1 if result.get("failed") else 0
    impls = registry.select(_csv(args.impls) or (["moegemm"] if args.tune else None))
    spec = harness.RunSpec(
        cases=select_cases(args, shapes, cuda),
        ops=ops,
        impls=impls,
        device=device,
        dtype=harness.DTYPES[args.dtype],
        split=args.split,
        seed=args.seed,
        seeds=seeds_arg(args, cuda),
        jagged=jagged,
        timing=timing.TimingConfig.quick() if args.quick else timing.TimingConfig(),
        paired=args.paired and cuda,
        check_only=not cuda,
    )

    name = args.name or report.bf16_benchmark_name(
        args.dtype, args.split, _csv(args.impls) or None, jagged=jagged is not None, tune=args.tune
    )
    out = args.out or report.default_out(env.device, name)
    meta = _meta(args, argv, env, spec, registry, timing, name)

    def checkpoint(records: list[dict]) -> None:
        """After every case: a run cut short (a time limit) still leaves its finished cases on disk."""
        report.write_json(out, {**meta, "partial": True}, records)
        last = [r for r in records if r["case"] == records[-1]["case"]]
        failed = sorted({f"{r['op']}/{r['impl']}" for r in last if r["status"] == "failed"})
        console.print(
            f"[{time.perf_counter() - started:5.0f} s] {records[-1]['case']}: {len(last)} records"
            + (f", failed: {', '.join(failed)}" if failed else "")
        )

    started = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        n = harness.steps(spec)
        if args.tune:
            from moegemm._src import configs
            from moegemm.bench import tune

            n = len(spec.cases) * sum(len(configs.candidates(tune.OP_KIND[op], "sm90")) for op in ops)
        task = bar.add_task("benchmark", total=n)
        calls = [0]

        def progress(desc: str) -> None:
            if desc.startswith("note:"):
                bar.console.print(desc)
                return
            bar.update(task, description=desc[:70], completed=calls[0])
            calls[0] += 1

        cache_path = None
        if args.tune:
            cache_dir = args.cache_dir or configs.CACHE_DIR
            records, cache_path = tune.tune(
                spec, env, cache_dir=cache_dir, progress=progress, on_case=checkpoint
            )
        else:
            records = harness.run(spec, env, progress, on_case=checkpoint)
    elapsed = time.perf_counter() - started

    split = records[0]["split"] if records else args.split
    title = f"{env.device} | {args.dtype} | split {split} | torch {env.torch} triton {env.triton}"
    meta.update(correctness=report.correctness(records), elapsed_s=elapsed, split=split)
    if spec.check_only:
        return _finish_check(console, args, out, meta, records, f"{title} | correctness only")
    console.print(report.table(records, title))
    meta.update(summary=report.summary(records))
    if not args.tune:
        console.print(report.summary_line(meta["summary"]))
    if args.overhead:
        from moegemm.bench import overhead

        meta["overhead"] = overhead.measure(device, spec.dtype)
        console.print(overhead.line(meta["overhead"], device))
    if args.tune:
        meta["tuned_cache"] = str(cache_path)
        meta["tuned"] = {r["cache_key"]: r["config"] for r in records if r.get("best")}
    path = report.write_json(out, meta, records)
    console.print(f"wrote {path}")
    if cache_path is not None and cache_path.exists():
        console.print(f"wrote tuned configs to {cache_path}")
    if not args.no_plot and records:
        console.print(f"wrote {report.plot(args.plot or path.with_suffix('.png'), records, title)}")
    console.print(f"done in {elapsed:.0f} s")
    return 0


def _finish_check(console, args, out: Path, meta: dict, records: list[dict], title: str) -> int:
    """The end of a check-only (CPU) run: the correctness table and verdict, the JSON; 1 on a failure."""
    from moegemm.bench import report

    console.print(report.check_table(records, title))
    console.print(report.correctness_line(meta["correctness"]), highlight=False)
    if args.overhead:
        console.print("--overhead: not run without a GPU (it would time the interpreter)")
    console.print(f"wrote {report.write_json(out, meta, records)}")
    console.print(f"done in {meta['elapsed_s']:.0f} s")
    return 1 if meta["correctness"]["failed"] else 0


def _model_cli(args) -> int:
    import json

    from moegemm._src import cost_model
    from moegemm.bench import fit_model

    if args.fit_model:
        fit_model.run(args.fit_model, args.out, sms=args.sms)
        return 0
    if args.extend_model:
        fit_model.run_extend(args.extend_model, args.out)
        return 0
    model = cost_model.load("sm90")
    if model is None:
        raise SystemExit(f"no committed model at {cost_model.model_path('sm90')}")
    rows = fit_model.evaluate(model, fit_model.samples(fit_model.load_records(args.eval_model)))
    for r in rows:
        print(f"{r['launch']:<36} model {r['model_vs_best']:.3f}  default {r['default_vs_best']:.3f} of best")
    summary = fit_model.summarize(rows)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(
            json.dumps(
                {"sources": [str(p) for p in args.eval_model], "summary": summary, "rows": rows}, indent=1
            )
            + "\n"
        )
    return 0


def _meta(args, argv, env, spec, registry, timing, name: str) -> dict:
    from moegemm.bench import report, roofline

    check_only = spec.check_only
    return {
        **report.run_meta(env, check_only, argv, benchmark=name, tcfg=spec.timing, seeds=spec.all_seeds()),
        "dtype": args.dtype,
        "ops": spec.ops,
        "split": args.split,
        "seed": args.seed,
        "impls": [i.name for i in spec.impls],
        "impls_unavailable": dict(registry.UNAVAILABLE),
        "timing": None if check_only else timing.method(spec.device) + (" (--quick)" if args.quick else ""),
        "timing_config": None if check_only else dataclasses.asdict(spec.timing),
        "paired": spec.paired and not check_only,
        "roofline": None
        if check_only
        else {"peak_flops": roofline.PEAK_FLOPS, "peak_bytes_per_s": roofline.PEAK_BYTES_PER_S},
        "cases": {c.name: {"G": c.G, "M": c.M, "K": c.K, "N": c.N} for c in spec.cases},
        "summary": None,
        "correctness": None,
        "overhead": None,
        "elapsed_s": None,
        "partial": False,
    }


if __name__ == "__main__":
    sys.exit(main())
