"""The warp-specialized BF16/FP16 m-grouped kernel (kernels/m_grouped_ws.py) on an sm90 GPU, forced on
(it is opt-in, MOEGEMM_WS=1), against the fp64 oracle: both loaders (TMA, cp.async), both tile widths,
both weight layouts (fwd: K-contiguous, dgrad: N-contiguous), bias, fp16, edge cases and bad sizes; a
spy makes sure the kernel that ran is the one under test. The CPU side of this kernel is the compile
test (test_sm90_compile.py); it has no interpreter mode (Gluon does not run under TRITON_INTERPRET).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from test_m_grouped import want

from moegemm import configs, shapes
from moegemm.testing import assert_rel_close, oracle
from moegemm.torch import _launch, m_grouped_mm

pytestmark = pytest.mark.gpu

CASES = [
    (300, 256, 384, [100, 0, 150, 20]),
    (777, 1040, 208, list(shapes.group_sizes(770, 6, seed=5, empty=2))),
    (640, 512, 256, [0, 0, 640, 0]),
    (64, 128, 128, [0, 0, 0]),
    (129, 48, 48, [64, 1, 64]),
    (4096, 2048, 1024, list(shapes.group_sizes(4000, 32, seed=1))),
]
CASE_IDS = ["skew-empty-tail", "k1040-n208-dirichlet", "one-hot", "all-empty", "odd-rows", "many-tiles"]


@pytest.fixture
def forced_ws(monkeypatch):
    """force(block_n, tma) routes m-grouped launches to the warp-specialized kernel with that config
    and returns the list the spy appends "tma" or "cp.async" to for each launch it took."""
    if not _launch._ws_device(torch.device(DEVICE)):
        pytest.skip("the warp-specialized kernel needs Gluon and an sm90 GPU")
    calls: list[str] = []
    for kind, direct in (("cp.async", _launch.M_GROUPED_WS), ("tma", _launch.M_GROUPED_WS_TMA)):
        monkeypatch.setattr(
            direct, "launch", lambda *a, kind=kind, f=direct.launch: (calls.append(kind), f(*a))
        )

    def force(block_n: int, tma: bool) -> list[str]:
        config = configs.WsConfig(block_n, 64, 4 if block_n == 256 else 6, tma=tma)
        monkeypatch.setattr(_launch, "WS", True)
        monkeypatch.setattr(_launch.configs, "pick_ws_config", lambda **_: config)
        _launch.clear_launch_cache()
        return calls

    yield force
    _launch.clear_launch_cache()


@pytest.mark.parametrize("loader", ["tma", "cp.async"])
@pytest.mark.parametrize("block_n", [256, 128])
@pytest.mark.parametrize(
    "M,K,N,sizes,dtype",
    [(*case, torch.bfloat16) for case in CASES] + [(*CASES[0], torch.float16)],
    ids=CASE_IDS + ["fp16"],
)
def test_m_grouped_ws(M, K, N, sizes, dtype, block_n, loader, forced_ws):
    """fwd (K-contiguous weight, bias) and dgrad (N-contiguous weight) against the oracle; rows past the
    groups exactly 0 (outputs start as NaN: conftest)."""
    calls = forced_ws(block_n, loader == "tma")
    G = len(sizes)
    gen = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=gen).to(dtype=dtype, device=DEVICE)
    w = torch.randn(G, N, K, generator=gen).to(dtype=dtype, device=DEVICE)
    dy = torch.randn(M, N, generator=gen).to(dtype=dtype, device=DEVICE)
    bias = (torch.randn(G, N, generator=gen) + 3).to(dtype=dtype, device=DEVICE)
    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    owned = sum(sizes)
    out = m_grouped_mm(x, w.mT, gs, bias=bias)
    assert_rel_close(out.cpu(), want(x, w.mT, sizes, bias), dtype, what=f"fwd {loader} {block_n}")
    dx = m_grouped_mm(dy, w, gs)
    assert_rel_close(dx.cpu(), want(dy, w, sizes), dtype, what=f"dgrad {loader} {block_n}")
    for t in (out, dx):
        assert torch.equal(t[owned:].cpu(), torch.zeros(M - owned, t.shape[1], dtype=dtype)), "unowned rows"
    # The TMA loader takes the N-contiguous weight only where K is a multiple of BLOCK_K (64).
    dgrad_loader = "tma" if loader == "tma" and N % 64 == 0 else "cp.async"
    assert calls == [loader, dgrad_loader], calls


@pytest.mark.parametrize("loader", ["tma", "cp.async"])
@pytest.mark.parametrize("name,M,sizes", shapes.INVALID_SIZES, ids=[c[0] for c in shapes.INVALID_SIZES])
def test_m_grouped_ws_clamps_bad_sizes(name, M, sizes, loader, forced_ws):
    """Device-side sizes that break the contract: clamped as the oracle's rule says, nothing out of bounds."""
    calls = forced_ws(256, loader == "tma")
    x = torch.randn(M, 128, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(len(sizes), 128, 128, device=DEVICE, dtype=torch.bfloat16)
    gs = torch.tensor(sizes, dtype=torch.int64, device=DEVICE)
    out = m_grouped_mm(x, w.mT, gs)
    assert_rel_close(out.cpu(), want(x, w.mT, sizes), torch.bfloat16, what=name)
    assert calls == [loader]


def test_m_grouped_ws_gradients(forced_ws):
    """Autograd through the op with the warp-specialized forward and dgrad: dx, dw against the oracle."""
    calls = forced_ws(256, True)
    M, K, N, sizes = 700, 256, 320, [300, 0, 250, 100]
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(len(sizes), N, K, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    m_grouped_mm(x, w.mT, gs).backward(dy)
    assert_rel_close(x.grad.cpu(), want(dy, w.detach(), sizes), torch.bfloat16, what="dx")
    dw = oracle.k_grouped_mm(dy.double().cpu(), x.detach().double().cpu(), sizes)
    assert_rel_close(w.grad.float().cpu(), torch.from_numpy(dw), torch.bfloat16, what="dw")
    assert calls == ["tma", "tma"], calls
