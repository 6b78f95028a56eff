"""Expert parallelism (docs/design.md, 'Expert parallelism'): ``moe_experts(ep_group=)``, ``MoE(ep_group=)`` and the
dispatchers, on P spawned CPU processes over gloo. Every rank's forward and every gradient (x, topk_weights, its
slices of w13 and w2) against the single-process block in fp64 on the concatenation of all ranks' tokens. Triton
runs under the interpreter (TRITON_INTERPRET=1 is inherited by the children from conftest, before any import).

Each test spawns its P processes once and runs its cases inside them (a spawn costs seconds of imports)."""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 150  # a deadlock fails the test instead of hanging CI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nan_empty(*size, dtype=None, device=None, **kwargs):
    out = torch.empty(*size, dtype=dtype, device=device, **kwargs)
    return out.fill_(float("nan")) if out.is_floating_point() else out


def _worker(rank, P, port, fn, args, backend="gloo"):
    torch.set_num_threads(1)  # P processes share the machine's cores
    from moegemm._src.torch import ops as _ops

    _ops.empty = _nan_empty  # as conftest's poison_outputs: unwritten outputs show up as NaN
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    try:
        fn(rank, P, *args)
        # Every rank past its last collective before any tears gloo down: a rank that exited first once
        # aborted its peer ("terminate called without an active exception", SIGABRT) in CI's second leg.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn, P: int, *args, timeout: float = TIMEOUT_S, backend: str = "gloo") -> None:
    """Runs fn(rank, P, *args) on P ranks (gloo on CPU; "nccl": rank r on cuda:r); a failure on any rank fails
    the test with its traceback, and ranks still running after ``timeout`` seconds (a deadlock) are killed and
    fail it too."""
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device hosts' rule)
    ctx = mp.start_processes(
        _worker, args=(P, _free_port(), fn, args, backend), nprocs=P, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:  # the processes this test started
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{fn.__name__} on {P} ranks did not finish in {timeout} s (deadlock?)")


# ---------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """P ranks with ``tokens[r]`` tokens each, E = P * E_local experts, top-k; ``ids``: "random" (k distinct
    experts a token), "hot" (every token's first choice is expert E - 1), "empty expert" (expert 1 gets none),
    "out of range" (one id past E and one below 0: clamped, as the single-process block does)."""

    name: str
    tokens: tuple[int, ...]
    E_local: int = 2
    k: int = 2
    chunks: int = 1
    ids: str = "random"
    max_tokens_per_rank: int | None = None
    d: int = 32
    n: int = 16


def make(case: Case, P: int, seed: int = 0):
    """The whole problem (the same on every rank: one seed): x [T, d], ids [T, k], weights [T, k], w13, w2, dout."""
    g = torch.Generator().manual_seed(seed)
    T, E, k = sum(case.tokens), P * case.E_local, case.k
    x = torch.randn(T, case.d, generator=g)
    pool = torch.arange(E)
    if case.ids == "empty expert":
        pool = pool[pool != 1]
    elif case.ids == "hot":
        pool = pool[pool != E - 1]
    ids = torch.zeros(T, k, dtype=torch.long)
    for t in range(T):
        ids[t] = pool[torch.randperm(len(pool), generator=g)[:k]]
    if case.ids == "hot":
        ids[:, 0] = E - 1
    elif case.ids == "out of range" and T:
        ids[0, 0] = E + 5
        ids[-1, -1] = -3
    weights = torch.rand(T, k, generator=g) + 0.1
    w13 = torch.randn(E, 2 * case.n, case.d, generator=g) / case.d**0.5
    w2 = torch.randn(E, case.d, case.n, generator=g) / case.n**0.5
    dout = torch.randn(T, case.d, generator=g)
    return x, ids, weights, w13, w2, dout


def oracle(x, ids, weights, w13, w2, dout):
    """(out, dx, dweights, dw13, dw2) of the single-process reference twin in fp64."""
    from moegemm.torch import moe_experts_reference

    leaves = [t.double().requires_grad_() for t in (x, weights, w13, w2)]
    out = moe_experts_reference(leaves[0], ids, leaves[1], leaves[2], leaves[3], compute_dtype=torch.float64)
    if not out.requires_grad:
        return out, *[torch.zeros_like(t) for t in leaves]
    return out.detach(), *torch.autograd.grad(out, leaves, dout.double(), allow_unused=False)


def _check_cases(rank, P, backend, cases):
    from moegemm.testing import assert_rel_close
    from moegemm.torch import moe_experts

    dev = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    for case in cases:
        x, ids, weights, w13, w2, dout = make(case, P)
        want = oracle(x, ids, weights, w13, w2, dout)
        x, ids, weights, w13, w2, dout = (t.to(dev) for t in (x, ids, weights, w13, w2, dout))
        a = sum(case.tokens[:rank])
        rows = slice(a, a + case.tokens[rank])
        experts = slice(rank * case.E_local, (rank + 1) * case.E_local)
        leaves = [t.clone().requires_grad_() for t in (x[rows], weights[rows], w13[experts], w2[experts])]
        out = moe_experts(
            leaves[0],
            ids[rows],
            leaves[1],
            leaves[2],
            leaves[3],
            backend=backend,
            ep_group=dist.group.WORLD,
            chunks=case.chunks,
            max_tokens_per_rank=case.max_tokens_per_rank,
        )
        out.backward(dout[rows])
        got = (out.detach(), *[t.grad for t in leaves])
        want_r = (want[0][rows], want[1][rows], want[2][rows], want[3][experts], want[4][experts])
        for name, g_, w_ in zip(("out", "dx", "dweights", "dw13", "dw2"), got, want_r):
            assert_rel_close(g_.cpu(), w_, torch.float32, what=f"rank {rank} {backend} {case.name}: {name}")


CASES = [
    Case("even", (6,) * 4),
    Case("even, 2 chunks", (6,) * 4, chunks=2),
    Case("k=1", (5,) * 4, k=1, chunks=2),
    Case("one hot expert", (6,) * 4, ids="hot"),
    Case("an expert with no token", (6,) * 4, ids="empty expert", chunks=2),
    Case("ids out of range", (4,) * 4, ids="out of range"),
    Case("a rank with no token", (5, 0, 3, 7), max_tokens_per_rank=7),
    Case("a rank with no token, 2 chunks", (5, 0, 3, 7), max_tokens_per_rank=8, chunks=2),
    Case("more chunks than rows", (3,) * 4, chunks=4),
    Case("uneven chunks", (5,) * 4, chunks=3, E_local=1),
]


def _for(P, cases):
    """The cases on P ranks: their token counts repeated to P entries."""
    return [dataclasses.replace(c, tokens=(c.tokens * P)[:P]) for c in cases]


@pytest.mark.parametrize("P", [2, 4])
def test_ep_block_matches_single_process_reference(P):
    spawn(_check_cases, P, "reference", _for(P, CASES))


TRITON_CASES = [
    Case("a rank with no token, 2 chunks", (0, 9), max_tokens_per_rank=9, chunks=2, ids="hot"),
    Case("k=1, an expert with no token", (4, 4), k=1, ids="empty expert"),
]


def test_ep_block_triton_interpreter_matches_single_process_reference():
    spawn(_check_cases, 2, "triton", TRITON_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [2, 4, 8])
def test_ep_block_on_gpus_over_nccl(P):
    """The cases on P GPUs over NCCL with the compiled kernels (fp32 operands: the oracle's tolerance)."""
    if torch.cuda.device_count() < P:
        pytest.skip(f"needs {P} CUDA devices, found {torch.cuda.device_count()}")
    spawn(_check_cases, P, "triton", _for(P, CASES + TRITON_CASES), backend="nccl", timeout=400)


def test_ep_block_on_8_ranks():
    """Tiny shapes on 8 ranks, the reference backend (cheap): uneven tokens, one idle rank, chunks."""
    cases = [
        Case("8 ranks", (2, 0, 3, 1, 2, 2, 1, 3), E_local=1, d=8, n=4, max_tokens_per_rank=3, chunks=2),
    ]
    spawn(_check_cases, 8, "reference", cases)


# ---------------------------------------------------------------- MoE(ep_group=)


def _check_moe_layer(rank, P, backend):
    from moegemm.testing import assert_rel_close
    from moegemm.torch import MoE

    dim, hidden, E, k, T = 32, 16, 4 * P, 2, 5
    torch.manual_seed(0)
    whole = MoE(dim, hidden, E, k, shared_experts=1, backend=backend)  # the same on every rank: one seed
    ep = MoE(dim, hidden, E, k, shared_experts=1, backend=backend, ep_group=dist.group.WORLD, chunks=2)
    El = E // P
    assert ep.w13.shape == (El, 2 * hidden, dim) and ep.w2.shape == (El, dim, hidden)
    with torch.no_grad():
        ep.router.load_state_dict(whole.router.state_dict())
        ep.shared.load_state_dict(whole.shared.state_dict())
        ep.w13.copy_(whole.w13[rank * El : (rank + 1) * El])
        ep.w2.copy_(whole.w2[rank * El : (rank + 1) * El])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(P, T, dim, generator=g)
    dout = torch.randn(P, T, dim, generator=g)
    x_whole = x.clone().requires_grad_()
    whole(x_whole).backward(dout)  # all ranks' tokens, all experts, one process
    x_r = x[rank].clone().requires_grad_()
    out = ep(x_r)
    out.backward(dout[rank])
    want = whole(x[rank])
    assert_rel_close(out.detach(), want.detach(), torch.float32, what=f"rank {rank} MoE out")
    assert_rel_close(x_r.grad, x_whole.grad[rank], torch.float32, what=f"rank {rank} MoE dx")
    experts = slice(rank * El, (rank + 1) * El)
    assert_rel_close(ep.w13.grad, whole.w13.grad[experts], torch.float32, what=f"rank {rank} MoE dw13")
    assert_rel_close(ep.w2.grad, whole.w2.grad[experts], torch.float32, what=f"rank {rank} MoE dw2")
    # The router's gradient is this rank's tokens' share: summed over ranks (data parallel), the whole one.
    grad = ep.router.gate.weight.grad.clone()
    dist.all_reduce(grad)
    assert_rel_close(grad, whole.router.gate.weight.grad, torch.float32, what=f"rank {rank} MoE drouter")


def test_moe_layer_with_ep_group_matches_the_whole_layer():
    spawn(_check_moe_layer, 2, "reference")


def _check_compiled_moe_layer(rank, P):
    """torch.compile of an MoE(ep_group=) (the EP call is one autograd.Function holding the collectives) gives
    the eager forward and input gradient."""
    from moegemm.testing import assert_rel_close
    from moegemm.torch import MoE

    torch.manual_seed(0)
    layer = MoE(32, 16, 4 * P, 2, backend="reference", ep_group=dist.group.WORLD)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    want = layer(x)
    want.sum().backward()
    want_dx, x.grad = x.grad.clone(), None
    got = torch.compile(layer)(x)
    got.sum().backward()
    assert_rel_close(got.detach(), want.detach(), torch.float32, what=f"rank {rank} compiled MoE out")
    assert_rel_close(x.grad, want_dx, torch.float32, what=f"rank {rank} compiled MoE dx")


def test_compiled_moe_layer_with_ep_group_matches_eager():
    spawn(_check_compiled_moe_layer, 2)


# ---------------------------------------------------------------- torchtitan's contract


def _check_torchtitan_dispatcher(rank, P):
    """torchtitan's RoutedExperts.forward with its contract: dispatch -> grouped experts on contiguous rows with
    per-expert counts -> combine; here the grouped experts are a per-expert loop (their rows past the counts
    are left NaN: combine must never read them)."""
    import torch.nn.functional as F

    from moegemm.testing import assert_rel_close
    from moegemm.torch import TorchtitanTokenDispatcher

    case = Case("torchtitan", (6, 4), max_tokens_per_rank=6)
    x, ids, weights, w13, w2, dout = make(case, P)
    want = oracle(x, ids, weights, w13, w2, dout)
    a = sum(case.tokens[:rank])
    rows = slice(a, a + case.tokens[rank])
    experts = slice(rank * case.E_local, (rank + 1) * case.E_local)
    disp = TorchtitanTokenDispatcher(
        P * case.E_local, case.k, ep_mesh=dist.group.WORLD, max_tokens_per_rank=6
    )
    leaves = [t.clone().requires_grad_() for t in (x[rows], weights[rows], w13[experts], w2[experts])]
    x_r, w_r, w13_r, w2_r = leaves
    routed, counts, meta = disp.dispatch(x_r, w_r, ids[rows], None)
    assert counts.shape == (case.E_local,)
    outs, start = [], 0
    for e, c in enumerate(counts.tolist()):
        g, u = (routed[start : start + c] @ w13_r[e].T).chunk(2, dim=-1)
        outs.append((F.silu(g) * u) @ w2_r[e].T)
        start += c
    outs.append(torch.full((routed.shape[0] - start, case.d), float("nan")))
    out = disp.combine(torch.cat(outs), meta, x_r)
    out.backward(dout[rows])
    got = (out.detach(), *[t.grad for t in leaves])
    want_r = (want[0][rows], want[1][rows], want[2][rows], want[3][experts], want[4][experts])
    for name, g_, w_ in zip(("out", "dx", "dweights", "dw13", "dw2"), got, want_r):
        assert_rel_close(g_, w_, torch.float32, what=f"rank {rank} torchtitan dispatcher: {name}")


def test_torchtitan_dispatcher_contract():
    spawn(_check_torchtitan_dispatcher, 2)


# ---------------------------------------------------------------- errors


def _check_errors(rank, P):
    from moegemm.torch import MoE, moe_experts

    group = dist.group.WORLD
    # P does not divide E: raised on every rank before any collective.
    with pytest.raises(ValueError, match=f"EP group size {P} does not divide num_experts=3"):
        MoE(32, 16, 3, 2, ep_group=group)
    # E_local differs across ranks: check mode makes every rank raise, naming the values; nothing waits.
    El = 2 + rank
    x, ids, w = torch.randn(4, 32), torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2)
    w13, w2 = torch.randn(El, 32, 32), torch.randn(El, 32, 16)
    with pytest.raises(ValueError, match=r"num_local_experts \(E/P\) per rank = \[2, 3\]"):
        moe_experts(x, ids, w, w13, w2, ep_group=group, check=True, backend="reference")
    # A bad input on one rank only (an id past E on rank 1): check mode makes every rank raise.
    ids_bad = ids.clone()
    if rank == 1:
        ids_bad[2, 1] = 99
    w13, w2 = torch.randn(2, 32, 32), torch.randn(2, 32, 16)
    with pytest.raises(ValueError, match=r"bad input on rank\(s\) \[1\].*topk_ids\[2, 1\] = 99"):
        moe_experts(x, ids_bad, w, w13, w2, ep_group=group, check=True, backend="reference")
    # More tokens than the declared bound on rank 0 only.
    with pytest.raises(ValueError, match=r"rank\(s\) \[0\].*more than max_tokens_per_rank=3"):
        moe_experts(
            x[: 4 - rank], ids[: 4 - rank], w[: 4 - rank], w13, w2,
            ep_group=group, check=True, backend="reference", max_tokens_per_rank=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match="chunks must be an int >= 1, got 0"):
        moe_experts(x, ids, w, w13, w2, ep_group=group, chunks=0, backend="reference")
    # MoE(ep_group=) checks the ranks' configurations once at construction.
    with pytest.raises(ValueError, match=r"hidden_dim per rank = \[16, 17\]"):
        MoE(32, 16 + rank, 4, 2, ep_group=group)
    # After all that the group still works (no rank was left inside a collective).
    out = moe_experts(x, ids, w, w13, w2, ep_group=group, backend="reference")
    assert out.shape == x.shape


def test_errors_raise_on_every_rank_without_deadlock():
    spawn(_check_errors, 2)


# ---------------------------------------------------------------- no host sync (GPU only)


def _check_no_sync(rank, P):
    from moegemm.torch import moe_experts

    torch.cuda.set_device(rank)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 4 * P, (64, 2), device="cuda")
    w = torch.rand(64, 2, device="cuda", requires_grad=True)
    w13 = torch.randn(4, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for chunks in (1, 2):
        moe_experts(x, ids, w, w13, w2, ep_group=dist.group.WORLD, chunks=chunks).sum().backward()  # warm up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        out = moe_experts(x, ids, w, w13, w2, ep_group=dist.group.WORLD, chunks=chunks)
        out.backward(torch.ones_like(out))
        torch.cuda.set_sync_debug_mode("default")


def _nccl_worker(rank, P, port):
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    try:
        _check_no_sync(rank, P)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_no_host_sync_on_gpu():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device hosts' rule)
    ctx = mp.start_processes(_nccl_worker, args=(2, _free_port()), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail("no-sync test did not finish (deadlock?)")
