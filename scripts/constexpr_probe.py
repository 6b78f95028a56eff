"""Which sizes/strides, compiled in as constants, make the grouped kernels faster? (GPU only)

The JAX front end passes every size and stride as a constexpr (jax-triton); the PyTorch launcher passed
them as runtime ints that Triton specializes only on ``== 1`` and ``% 16 == 0``, and on the H100 the JAX
k-grouped kernel ran 10-20% faster on compute-bound wgrad (the probe's findings are now in the kernels:
docs/perf-notes.md, 9). This probe builds variants of the kernel modules in which the sizes and strides
are runtime ints except the chosen ones, declared ``tl.constexpr`` (text substitution in the signature,
written to a temporary package), checks each against a float32 torch loop and times it with CUDA
events (triton.testing.do_bench, median), with the library's own launch descriptions.

    python scripts/constexpr_probe.py [--json PATH]           # without a GPU: TRITON_INTERPRET=1, tiny cases
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

from moegemm import kernels, shapes
from moegemm.bench.problem import make_problem
from moegemm.torch import _launch

KERNEL_DIR = Path(kernels.__file__).parent
K_VARIANTS = {
    "runtime": (),
    "N,K,G": ("N", "K", "G"),
    "strides": ("stride_am", "stride_ak", "stride_bm", "stride_bn", "stride_og", "stride_ok", "stride_on"),
    "N,K,G+strides": ("N", "K", "G", "stride_am", "stride_ak", "stride_bm", "stride_bn", "stride_og",
                      "stride_ok", "stride_on"),  # fmt: skip
    "all incl. M (as JAX)": ("M", "N", "K", "G", "stride_am", "stride_ak", "stride_bm", "stride_bn",
                             "stride_og", "stride_ok", "stride_on", "stride_sg", "stride_sk"),  # fmt: skip
}
M_VARIANTS = {
    "runtime": (),
    "N,K,G": ("N", "K", "G"),
    "N,K,G+strides": ("N", "K", "G", "stride_xm", "stride_xk", "stride_wg", "stride_wk", "stride_wn",
                      "stride_om", "stride_on"),  # fmt: skip
    "all incl. M (as JAX)": ("M", "N", "K", "G", "stride_xm", "stride_xk", "stride_wg", "stride_wk",
                             "stride_wn", "stride_om", "stride_on", "stride_bg", "stride_bn"),  # fmt: skip
}


def variant_module(tmp: Path, module: str, names: tuple[str, ...], tag: str):
    """kernels/<module>.py with ``names`` made constexpr in the kernel signature, imported from tmp."""
    src = (KERNEL_DIR / f"{module}.py").read_text()
    prefix, sep, rest = src.partition(f"def {module}_mm_kernel(")
    signature, end, body = rest.partition("):  # fmt: skip")
    lines = [line.partition("#")[0] for line in signature.splitlines()]  # comments mention names too
    signature = "\n".join(lines)
    # Start from all-runtime sizes and strides (the shipped kernels declare some of them constexpr).
    probed = {name for variants in (K_VARIANTS, M_VARIANTS) for group in variants.values() for name in group}
    for name in probed:
        signature = re.sub(rf"(?<=[\s(,]){name}: tl\.constexpr,", f"{name},", signature)
    for name in names:
        signature, n = re.subn(rf"(?<=[\s(,]){name},", f"{name}: tl.constexpr,", signature)
        assert n == 1, (module, name, n)
    path = tmp / f"{module}_{tag}.py"
    path.write_text(prefix + sep + signature + end + body)
    spec = importlib.util.spec_from_file_location(f"probe_{module}_{tag}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_wgrad(mod, names, problem):
    inp = problem.copies[0]
    a, b = inp.dy, inp.x  # wgrad as the library runs it: dW [G, N, K] = dy_g^T x_g
    M, K = a.shape
    N = b.shape[1]
    G = problem.case.G
    out = torch.empty(G, K, N, device=a.device, dtype=a.dtype)
    # The shipped launch description (config, grid, meta): the variants differ only in constexpr-ness.
    launch = _launch._k_launch(M, N, K, G, a.dtype, a.device, max(K, N), True, False, False)
    values = dict(a_ptr=a, b_ptr=b, group_sizes_ptr=problem.group_sizes, c_ptr=out, a_colsum_ptr=out, out_ptr=out,
                  M=M, N=N, K=K, G=G, stride_am=a.stride(0), stride_ak=a.stride(1), stride_bm=b.stride(0),
                  stride_bn=b.stride(1), stride_og=out.stride(0), stride_ok=out.stride(1), stride_on=out.stride(2),
                  stride_sg=0, stride_sk=0)  # fmt: skip

    def fn():  # all by keyword: which parameters are constexprs depends on the variant
        mod.k_grouped_mm_kernel[launch.grid](**values, **launch.meta)

    ref = torch.stack([
        s.float().T @ t.float() for s, t in zip(a.split(problem.sizes), b.split(problem.sizes), strict=True)
    ]) if sum(problem.sizes) == M else None  # fmt: skip
    return fn, out, ref


def run_fwd(mod, names, problem):
    inp = problem.copies[0]
    x, w = inp.x, inp.w.mT  # [G, K, N] view of the [G, N, K] nn.Linear weight
    M, K = x.shape
    G, _, N = w.shape
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    launch = _launch._m_launch(M, N, K, G, x.dtype, x.device, max(K, N), True, False)
    values = dict(x_ptr=x, w_ptr=w, group_sizes_ptr=problem.group_sizes, bias_ptr=x, out_ptr=out,
                  M=M, N=N, K=K, G=G, stride_xm=x.stride(0), stride_xk=x.stride(1), stride_wg=w.stride(0),
                  stride_wk=w.stride(1), stride_wn=w.stride(2), stride_om=out.stride(0), stride_on=out.stride(1),
                  stride_bg=0, stride_bn=0)  # fmt: skip

    def fn():
        mod.m_grouped_mm_kernel[launch.grid](**values, **launch.meta)

    ref = torch.cat([s.float() @ w[g].float() for g, s in enumerate(x.split(problem.sizes))])
    return fn, out, ref


def _wall_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--cases", default="dsv3-ep8-fc1,dsv3-ep8-fc2,mixtral-fc1,qwen3-30b-fc1,finegrain-e64-fc1")
    args = parser.parse_args()
    # Without a GPU (TRITON_INTERPRET=1): the same code on CPU tensors, to check the script itself.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bench = triton.testing.do_bench if device.type == "cuda" else lambda fn, **_: _wall_ms(fn)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for module, variants, runner, op in (("k_grouped", K_VARIANTS, run_wgrad, "wgrad"),
                                             ("m_grouped", M_VARIANTS, run_fwd, "fwd")):  # fmt: skip
            mods = {label: (variant_module(Path(tmp), module, names, f"v{i}"), names)
                    for i, (label, names) in enumerate(variants.items())}  # fmt: skip
            for case_name in args.cases.split(","):
                problem = make_problem(shapes.get(case_name), device=device)
                flops = 2 * problem.case.M * problem.case.K * problem.case.N
                base = None
                for label, (mod, names) in mods.items():
                    fn, out, ref = runner(mod, names, problem)
                    fn()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    err = float((out.float() - ref).norm() / ref.norm())
                    ms = bench(fn, warmup=50, rep=300, return_mode="median")
                    base = base or ms
                    row = {"op": op, "case": case_name, "variant": label, "ms": ms, "tflops": flops / ms / 1e9,
                           "speedup_vs_runtime": base / ms, "relerr": err}  # fmt: skip
                    rows.append(row)
                    print(f"{op:5s} {case_name:20s} {label:24s} {ms:8.4f} ms {row['tflops']:6.1f} TF/s "
                          f"x{base / ms:.3f} relerr {err:.1e}", flush=True)  # fmt: skip
    if args.json:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
        Path(args.json).write_text(json.dumps({"device": name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
