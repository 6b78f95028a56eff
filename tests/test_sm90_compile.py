"""The GPU kernels compile for sm_90a with this Triton (no GPU needed): the warp-specialized Gluon
kernels and the BF16 Triton kernels of the default launches.

CI runs this on both Triton legs: triton 3.9 removed the Gluon copy entry points the kernels first
used (cp/tma ``async_copy_global_to_shared`` -> ``async_load``), which only a compile shows, and the
interpreter never runs Triton's GPU code generator. The compile runs in a child process without
TRITON_INTERPRET (moegemm.testing.sm90 says why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moegemm._src.kernels import gluon_hopper, m_grouped_fp8_ws
from moegemm.testing import sm90

# Dynamic shared memory a block may use on sm90 (227 KB); an SM has 228 KB, 1 KB of it reserved per CTA.
SM90_MAX_SHARED = 232448
SM90_SHARED_PER_SM = 233472


@pytest.mark.skipif(not gluon_hopper.supported(), reason="this Triton has no Gluon Hopper API")
def test_kernels_compile_for_sm90(tmp_path):
    # A fresh Triton cache: its key does not cover module-level aliases such as gluon_hopper.async_load,
    # so a cached kernel could hide a compile error.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "TRITON_CACHE_DIR": str(tmp_path)
    }
    result = subprocess.run(
        [sys.executable, "-m", "moegemm.testing.sm90"], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = {r["kernel"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert set(compiled) == set(sm90.KERNELS), compiled
    for name, r in compiled.items():
        # The split reduction and the row staging are element-wise: no shared memory.
        elementwise = name.startswith(
            ("split-reduce", "split-stage_rows", "moe-combine", "moe-gather-rows", "moe-swiglu")
        )
        assert (elementwise or r["shared"] > 0) and r["shared"] <= SM90_MAX_SHARED, (name, r)
        # A config's CTAs per SM all fit (the TMA-store candidates' estimate is checked here).
        assert r["ctas_per_sm"] * (r["shared"] + 1024) <= SM90_SHARED_PER_SM, (name, r)
        if name.startswith("quantize-pair"):
            # The one-read quantize reads x in 16-byte copies and holds its tile without spilling.
            assert r["loads"].get("cp.async-16") and not r["spill_bytes"], (name, r)
        if name.startswith("k_grouped_fp8_ws"):
            # The FP8 wgrad's loader keeps two descriptor pairs across its loop, taken in turns group by group, each
            # in its own scratch slot: 4 descriptors made before the loop, 4 in it (and out's, made on the device).
            # A kernel whose pairs Triton merged into one slot rewrites a descriptor under in-flight copies
            # (docs/design.md, 'The FP8 wgrad').
            assert r["descriptors"] >= 8 and r["scratch"] >= 128 * r["descriptors"], (name, r)
        if name.startswith("moe-"):
            # The expert block's epilogues hold z, the activation and the gradients beside the accumulator: a
            # tile too wide for them spills kilobytes (docs/design.md, 'Fused expert block').
            # The FP8 block's promoted tiles run 2 CTAs an SM (128 registers a thread) holding the accumulator and
            # a step's partial product: 24-76 bytes spill there (sm_90a compile, 2026-11-27).
            limit = 128 if name.startswith("moe-fp8") else 64
            assert r["spill_bytes"] is None or r["spill_bytes"] <= limit, (name, r)
        if name.startswith("m_grouped_fp8_ws"):
            # The planner's fit check for the epilogue's staging tiles (plan.fp8_ws_store) uses shared_bytes: it
            # must be what the kernel allocates, give or take its ring's mbarriers; a staged store makes out's
            # descriptor on the device (x's, w's and out's: 3) only with TMA.
            _, meta, _ = sm90.KERNELS[name]()
            estimate = m_grouped_fp8_ws.shared_bytes(meta["BLOCK_N"], meta["NUM_STAGES"], meta["STORE"])
            assert 0 <= r["shared"] - estimate <= 1024, (name, r["shared"], estimate)
            assert r["descriptors"] == 2 + (meta["STORE"] == m_grouped_fp8_ws.STORE_TMA), (name, r)


def test_unaligned_rows_keep_wide_accesses(tmp_path):
    """Rows of 1000 or 1400 bf16 are 16-byte aligned but not 16-element aligned: a launch on them must keep
    16-byte asynchronous copies (8-byte for FP8 rows of 1000) and vector stores. With the strides, N and K as
    runtime ints Triton knew their alignment only at multiples of 16 elements, and these launches loaded and
    stored element by element, 3-10x slower than torch._grouped_mm on the H100 (docs/design.md,
    'Compiled-in sizes'). Runs on both Triton legs (the Gluon-free kernels need no Gluon)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "TRITON_CACHE_DIR": str(tmp_path)
    }
    result = subprocess.run(
        [sys.executable, "-m", "moegemm.testing.sm90", *sm90.UNALIGNED],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = {r["kernel"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert set(compiled) == set(sm90.UNALIGNED)
    for name, r in compiled.items():
        widest = 8 if "fp8" in name else 16  # an FP8 row of 1000 bytes is 8-byte aligned
        copies = {k: v for k, v in r["loads"].items() if k.startswith("cp.async")}
        assert copies == {f"cp.async-{widest}": copies.get(f"cp.async-{widest}", 0)} and copies, (name, r)
        narrow = {k: v for k, v in r["loads"].items() if k in ("ld-8", "ld-16", "st-8", "st-16")}
        assert not narrow, (name, r)
        assert r["shared"] > 64 * 1024, (name, r)  # a multi-stage operand ring: the loads are pipelined


_JAX_LAUNCHES = """
import json, jax, jax.numpy as jnp
from moegemm._src import fp8
from moegemm._src.jax import gpu, launch_fp8 as lf
from moegemm._src.jax.launch import Target

target = Target("sm90", "NVIDIA H100 80GB HBM3", 132)
G, M, K, N = 32, 32768, 7168, 4096
sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
f8, f32 = jnp.float8_e4m3fn, jnp.float32
M_t = fp8.transposed_columns(M, G)
gs = sds((G,), jnp.int32)
calls = {
    "fwd": lf.m_grouped_mm_fp8_call(
        sds((M, K), f8), sds((M,), f32), sds((G, N, K), f8), sds((G, N), f32), gs, recipe="rowwise",
        out_dtype=jnp.bfloat16, target=target,
    ),
    "wgrad": lf.k_grouped_mm_fp8_call(
        M, sds((K, M_t), f8), sds((G,), f32), sds((N, M_t), f8), sds((G,), f32), gs, None, recipe="tensorwise",
        out_dtype=jnp.bfloat16, target=target,
    ),
}
gpu._compute_capability = lambda: 90  # no GPU here: compile for the H100
for op, call in calls.items():
    launch, out_avals = gpu.launch_of(call)
    compiled = gpu._compiled(launch, (*call.args, *out_avals[: launch.outs]))
    params = gpu.kernel_parameters(launch, call.args, out_avals, compiled.metadata.global_scratch_align)
    runtime = gpu._runtime_ints(call.kernel, len(call.args) + 1, call.meta)
    print(json.dumps(dict(
        op=op, kernel=compiled.metadata.name, scratch=compiled.metadata.global_scratch_size, grid=launch.grid,
        scratch_bytes=out_avals[-1].shape[0] if len(out_avals) > launch.outs else 0, arrays=len(call.args) + 1,
        runtime=[name for name, _ in runtime], params=[p[0] if p[0] == "scalar" else f"array/{p[2]}" for p in params],
        desc_on_device=call.meta.get("OUT_DESC_ON_DEVICE"),
    )))
"""


@pytest.mark.skipif(not gluon_hopper.supported(), reason="this Triton has no Gluon Hopper API")
def test_jax_gpu_executor_compiles_the_warp_specialized_fp8_launches(tmp_path):
    """JAX's GPU executor (``_src/jax/gpu.py``) compiles the KernelCalls the FP8 glue builds for an H100: the
    warp-specialized kernels, their sizes as runtime ints (compiled in, they broke the compile: 'JAX front end'),
    Triton's global scratch for the descriptors they make, the wgrad's out descriptor made on the device."""
    pytest.importorskip("jax")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "TRITON_CACHE_DIR": str(tmp_path),
        "JAX_PLATFORMS": "cpu",
    }
    result = subprocess.run(
        [sys.executable, "-c", _JAX_LAUNCHES], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = {r["op"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert got["fwd"]["kernel"] == "m_grouped_mm_fp8_ws_kernel" and got["fwd"]["scratch"] > 0, got
    assert got["wgrad"]["kernel"] == "k_grouped_mm_fp8_ws_kernel" and got["wgrad"]["scratch"] > 0, got
    assert got["wgrad"]["desc_on_device"] is True, got
    for r in got.values():
        assert {"M", "N", "K", "G"} <= set(r["runtime"]), r
        # jaxlib's order: the buffers, the runtime ints, then the scratch (the slot after the kernel's own
        # parameters), 128-byte aligned for the descriptors made in it, grid x global_scratch_size bytes.
        n = r["arrays"]
        assert r["params"] == ["array/16"] * n + ["scalar"] * len(r["runtime"]) + ["array/128"], r
        assert r["scratch_bytes"] == r["grid"][0] * r["scratch"], r
