"""Do the JAX and PyTorch front ends compile the same kernel for the same op? (issue 14)

For a few suite case-ops, runs the op once from each front end, then compares what each compiled:
the PyTorch launch's CompiledKernel (from the JITFunction's cache) against jax-triton's dump
(JAX_TRITON_DUMP_DIR, set here before jax-triton is imported): launch metadata (num_warps,
num_stages, shared memory), the constexprs each bound, and the PTX with the kernel name normalized.
Then both front ends' device time for the op (CUPTI, bench/timing.py). Usage:
python scripts/compare_jax_torch_kernels.py --out result.json
"""

# ruff: noqa: B023  (the lambdas run inside the iteration that made them)
from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

DUMP = Path(tempfile.mkdtemp(prefix="jax-triton-dump-"))
os.environ["JAX_TRITON_DUMP_DIR"] = str(DUMP)

CASES = [("qwen3-30b-fc2", "fwd"), ("finegrain-e64-fc1", "fwd"), ("gptoss-120b-fc1", "wgrad")]


def normalized_ptx(ptx: str) -> str:
    ptx = re.sub(r"\b(m_grouped_mm_kernel|k_grouped_mm_kernel)\w*", r"\1", ptx)
    return "\n".join(line for line in ptx.splitlines() if not line.startswith("//"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import jax
    import torch

    from moegemm import shapes
    from moegemm.bench import timing
    from moegemm.bench.problem import make_problem
    from moegemm.jax import _jax_triton
    from moegemm.jax import api as mj
    from moegemm.kernels.k_grouped import k_grouped_mm_kernel
    from moegemm.kernels.m_grouped import m_grouped_mm_kernel
    from moegemm.torch import api as mt

    _jax_triton._import_jax_triton()
    dev = torch.device("cuda")
    results = []
    for name, op in CASES:
        case = shapes.get(name)
        problem = make_problem(case, device=dev, ops=(op,))
        x, w, dy = problem.copies[0]
        gs = problem.group_sizes
        kernel = m_grouped_mm_kernel if op != "wgrad" else k_grouped_mm_kernel
        before = {k for c in kernel.device_caches.values() for k in c[0]}
        if op == "fwd":
            torch_fn = lambda: mt.m_grouped_mm(x, w.mT, gs)
        else:
            torch_fn = lambda: mt.k_grouped_mm(dy, x, gs, out_dtype=x.dtype)
        torch_fn()
        torch.cuda.synchronize()
        compiled = [c for c in kernel.device_caches.values() for k, c in c[0].items() if k not in before]
        jx, jw, jdy = (jax.dlpack.from_dlpack(t.contiguous()) for t in (x, w, dy))
        jgs = jax.numpy.asarray(problem.sizes, jax.numpy.int32)
        dumps_before = set(DUMP.iterdir())
        if op == "fwd":
            jax_fn = jax.jit(lambda x, w, gs: mj.m_grouped_mm(x, w, gs, transpose_w=True))
            jax_call = lambda: jax_fn(jx, jw, jgs)
        else:
            jax_fn = jax.jit(lambda dy, x, gs: mj.k_grouped_mm(dy, x, gs, out_dtype=x.dtype))
            jax_call = lambda: jax_fn(jdy, jx, jgs)
        jax.block_until_ready(jax_call())
        new_dumps = sorted(set(DUMP.iterdir()) - dumps_before)
        rec = dict(case=name, op=op, torch_kernels=len(compiled), jax_kernels=len(new_dumps))
        if compiled and new_dumps:
            ck = compiled[-1]
            torch_ptx = normalized_ptx(ck.asm["ptx"])
            jax_ptx = normalized_ptx(next(new_dumps[-1].glob("*.ptx")).read_text())
            rec["torch_meta"] = dict(
                num_warps=ck.metadata.num_warps, num_stages=ck.metadata.num_stages, shared=ck.metadata.shared
            )
            src = getattr(ck, "src", None)
            rec["torch_constants"] = {str(k): str(v) for k, v in getattr(src, "constants", {}).items()}
            rec["jax_config"] = (new_dumps[-1] / "config").read_text()[:4000]
            rec["jax_compile_info"] = next(new_dumps[-1].glob("*.compile_info")).read_text().strip()
            rec["ptx_sha256"] = dict(
                torch=hashlib.sha256(torch_ptx.encode()).hexdigest()[:16],
                jax=hashlib.sha256(jax_ptx.encode()).hexdigest()[:16],
            )
            rec["ptx_identical"] = torch_ptx == jax_ptx
            rec["ptx_lines"] = dict(torch=torch_ptx.count("\n"), jax=jax_ptx.count("\n"))
            diff = list(difflib.unified_diff(torch_ptx.splitlines(), jax_ptx.splitlines(), lineterm="", n=0))
            rec["ptx_diff_lines"] = len(diff)
            rec["ptx_diff_head"] = diff[:80]
        rec["device_ms"] = dict(
            torch=timing.device_ms(torch_fn, dev, 20), jax=timing.device_ms(jax_call, dev, 20)
        )
        results.append(rec)
        print(
            name,
            op,
            "identical PTX"
            if rec.get("ptx_identical")
            else f"PTX differs ({rec.get('ptx_diff_lines')} diff lines)",
            rec["device_ms"],
        )
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
