"""DirectLaunch: when a launch may skip JITFunction.run, and that it then calls the bound kernel right.

The key logic runs everywhere against a recording stand-in for a Triton kernel; on a GPU the real
kernels are launched through both paths and checked against the fp64 reference.
"""

from __future__ import annotations

import types

import pytest
import torch
import triton
from conftest import DEVICE

from moegemm._src.torch import launch as _launch
from moegemm.testing import assert_rel_close
from moegemm.torch import k_grouped_mm, m_grouped_mm
from moegemm.torch.reference import k_grouped_mm_reference, m_grouped_mm_reference


class RecordingKernel:
    """Stands in for a @triton.jit kernel: ``kernel[grid](...)`` is a Triton-bound launch (recorded in
    ``bound``), and the CompiledKernel it returns records direct calls of its launcher in ``direct``."""

    params = [
        types.SimpleNamespace(name=name, is_constexpr=name.isupper())
        for name in ("a_ptr", "b_ptr", "n", "stride", "BLOCK", "FLAG")
    ]

    def __init__(self) -> None:
        self.bound: list[tuple] = []
        self.direct: list[tuple] = []

    def __getitem__(self, grid):
        def bind(*args, **meta):
            self.bound.append((grid, args, meta))
            return types.SimpleNamespace(
                function="function-handle", packed_metadata="packed", run=lambda *a: self.direct.append(a)
            )

        return bind


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(_launch, "INTERPRET", False)
    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(_launch, "current_stream", lambda index: "stream")
    kernel = RecordingKernel()
    return kernel, _launch.DirectLaunch(kernel)


def _launch_once(direct, a, b, ints=(7, 1), spec=("spec",), flag=False):
    # Meta in another order than the kernel's parameters: the direct call must use the parameter order.
    describe = lambda: types.SimpleNamespace(grid=(5,), meta={"FLAG": flag, "num_warps": 4, "BLOCK": 64})
    direct.launch(spec, (a, b), ints, describe)


def test_second_identical_launch_is_direct(recording):
    kernel, direct = recording
    a, b = torch.randn(8), torch.randn(8)
    _launch_once(direct, a, b)
    _launch_once(direct, a, b)
    assert len(kernel.bound) == 1
    assert kernel.bound[0] == ((5,), (a, b, 7, 1), {"FLAG": False, "num_warps": 4, "BLOCK": 64})
    assert kernel.direct == [
        (5, 1, 1, "stream", "function-handle", "packed", None, None, None, a, b, 7, 1, 64, False)
    ]


@pytest.mark.parametrize(
    "change",
    ["misaligned-pointer", "dtype", "int-value", "spec"],
)
def test_what_triton_specializes_on_rebinds(recording, change):
    kernel, direct = recording
    a, b = torch.randn(16), torch.randn(16)
    _launch_once(direct, a, b)
    if change == "misaligned-pointer":  # 4 bytes past a 16-byte aligned allocation
        _launch_once(direct, a[1:], b)
    elif change == "dtype":
        _launch_once(direct, a.double(), b)
    elif change == "int-value":  # divisibility by 16 and == 1 are specialized; the key keeps the value
        _launch_once(direct, a, b, ints=(16, 1))
    else:  # e.g. HAS_BIAS with a bias of strides (0, 0): same tensors and ints, other constexprs
        _launch_once(direct, a, b, spec=("other-spec",), flag=True)
    assert len(kernel.bound) == 2 and kernel.direct == []
    _launch_once(direct, a, b)
    assert len(kernel.bound) == 2 and len(kernel.direct) == 1


@pytest.mark.parametrize("hook", ["hook-chain-entry", "plain-callable"])
def test_launch_hook_or_switch_keeps_triton_path(recording, monkeypatch, hook):
    """A profiler's launch hook (proton adds to triton's HookChain) must see every launch."""
    kernel, direct = recording
    a, b = torch.randn(8), torch.randn(8)
    chain = triton.knobs.HookChain()
    chain.add(lambda metadata: None)
    monkeypatch.setattr(
        triton.knobs.runtime, "launch_enter_hook", chain if hook == "hook-chain-entry" else print
    )
    _launch_once(direct, a, b)
    _launch_once(direct, a, b)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", triton.knobs.HookChain())  # empty: no hook
    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", False)
    _launch_once(direct, a, b)
    assert len(kernel.bound) == 3 and kernel.direct == []
    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)
    _launch_once(direct, a, b)
    _launch_once(direct, a, b)
    assert len(kernel.bound) == 4 and len(kernel.direct) == 1


def test_clear_forgets_bound_launches(recording):
    kernel, direct = recording
    a, b = torch.randn(8), torch.randn(8)
    _launch_once(direct, a, b)
    direct.clear()
    _launch_once(direct, a, b)
    assert len(kernel.bound) == 2 and kernel.direct == []


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the direct path exists for compiled kernels only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_direct_launches_compute_the_same_on_gpu(dtype):
    """Fresh inputs of one shape, launched repeatedly: every call after the first goes direct, and each
    result matches the fp64 reference (a stale binding or argument order would not)."""
    _launch.clear_launch_cache()
    M, K, N, sizes = 77, 40, 24, [30, 0, 41]
    gs = torch.tensor(sizes, device=DEVICE, dtype=torch.int32)
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(M, K, device=DEVICE, dtype=dtype)
        w = torch.randn(len(sizes), N, K, device=DEVICE, dtype=dtype).mT
        bias = torch.randn(len(sizes), N, device=DEVICE, dtype=dtype)
        out = m_grouped_mm(x, w, gs, bias=bias)
        want = m_grouped_mm_reference(x.double().cpu(), w.double().cpu(), gs.cpu(), bias.double().cpu())
        assert_rel_close(out.cpu(), want, dtype, what=f"m_grouped call {seed}")
        dw = k_grouped_mm(x, out, gs)
        want_dw = k_grouped_mm_reference(
            x.double().cpu(), out.double().cpu(), gs.cpu(), out_dtype=torch.float64
        )
        assert_rel_close(dw.cpu(), want_dw, dtype, what=f"k_grouped call {seed}")
    # A problem this small stores from registers (TMA_STORE_MIN_FLOPS); test_m_grouped and test_k_grouped
    # cover the TMA-store launches.
    assert _launch.M_GROUPED.bound and _launch.K_GROUPED.bound
