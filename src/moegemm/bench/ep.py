"""``python -m moegemm.bench --ep``: the expert block under expert parallelism (EP) in PyTorch, moegemm against
a torchtitan-style all-to-all block, on P ranks of one host (issue 42, 'Benchmark').

Launch. Without ``torchrun`` the run spawns P processes per EP size (``--ep-sizes``, default 2,4) with
torch.multiprocessing: NCCL on a host with >= P GPUs (``NCCL_NVLS_ENABLE=0``: NVLink multicast stays off), gloo on
CPU without a GPU. Under ``torchrun`` (WORLD_SIZE set) it runs in the launched processes: EP size P uses ranks
[0, P) of the world. Rank 0 gathers every rank's numbers, prints the tables and writes the JSON
(``benchmarks/results/<device>/ep.json``).

Layout. Rank r of an EP group of size P holds experts [r*E/P, (r+1)*E/P) (w13 [E/P, 2n, d], w2 [E/P, d, n]) and
its own T tokens (x [T, d], topk_ids [T, k] global ids). Every rank draws the same global inputs from the seed
(``moe.make_inputs`` on P*T tokens and E experts, ``moe.route`` for the routing: "skewed" ramps the logits
across the expert ids, so the last rank's experts are the hottest) and keeps its slice.

Peers (``PEERS``), each ``block(x, ids, weights, w13_local, w2_local) -> out [T, d]`` with autograd:

- ``torchtitan-a2a``: torchtitan's all-to-all token dispatcher and grouped experts
  (torchtitan/models/common/token_dispatcher.py, moe.py): per-expert counts (histc), an all_to_all of the counts,
  the split sizes copied to the host (one host sync), tokens sorted by expert, ``all_to_all_single`` with those
  splits, a permute from rank-major to expert-major order, ``torch._grouped_mm`` fc1, SwiGLU, ``_grouped_mm`` fc2,
  the unpermute, the reverse ``all_to_all_single``, and the weighted scatter-add back to tokens;
- ``moegemm-c{1,2,4}``: ``moegemm.torch.moe_experts(..., ep_group=pg, chunks=C)``: all_gather of x, ids and
  weights, the fused local block on the gathered tokens, reduce_scatter of the partial outputs; C > 1 overlaps
  the collectives of one chunk of tokens with the GEMMs of another.

Per (shape, routing, EP size, peer), in this order:

- correctness: out and every gradient (dx, dw13 and dw2 of the local experts, dweights) of one fwd+bwd on every
  rank against ``moegemm.torch.moe_experts_reference`` in fp32 (fp64 on CPU, ``moe.oracle``) run on that rank's
  tokens with all E experts, its expert gradients summed over the group (all_reduce) and sliced to the rank's
  experts. Relative Frobenius error (``harness.relerr``), the worst rank's, against ``moe.REL_TOL``. A peer above
  it on any rank is failed and not timed;
- host syncs of one fwd+bwd: the warnings of ``torch.cuda.set_sync_debug_mode("warn")`` (``moe.count_syncs``),
  the most of any rank; peak memory of one fwd+bwd above the inputs (``timing.call_with_peak_mb``), the most of any
  rank;
- times: the forward (autograd on, as in training) and the fwd+bwd. Each timed call starts after a barrier (an
  all_reduce and a device sync) and sits between two CUDA events; per call the slowest rank's time, then the
  median over the calls. ``bwd_ms`` = ``step_ms`` - ``fwd_ms``.

FLOPs per GPU: the routed rows average R = T*k per rank (P*T*k rows over P ranks, whatever the skew), and a
forward is fc1 2*R*d*2n plus fc2 2*R*n*d = 6*R*d*n = 6*T*k*d*n FLOPs (``moe.fwd_flops``); the backward twice
that. ``fwd_tflops`` = 6Tkdn / fwd time, ``bwd_tflops`` = 12Tkdn / bwd time, ``step_tflops`` = 18Tkdn / step
time. ``vs_torchtitan``: torchtitan-a2a's step time over the peer's (the target: >= 1.5 at EP 4).

Collectives alone (``kind: "comm"`` records): the dispatch and combine each peer moves, at its sizes, timed the
same way: moegemm's all_gather of x, ids and weights (dispatch) and reduce_scatter of the [P*T, d] partial
output (combine, in x's dtype); torchtitan's token ``all_to_all_single`` with the run's split sizes, both ways.
``gbps`` = bytes a rank receives from the other ranks (averaged over ranks) / time. The NVLink reference
(``kind: "nvlink"``): ``all_to_all_single`` of a ``NVLINK_REF_BYTES`` buffer per rank in equal splits, the same
GB/s; ``pct_nvlink`` = a collective's GB/s over it (the target: >= 70%).

Without a GPU this is a correctness job: gloo on CPU, tiny shapes, the kernels under the Triton interpreter (or
the backend given), every check run and nothing timed; the collectives run once unchecked, so the code runs.
The exit status is 1 on a failed check.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from moegemm.bench import moe
from moegemm.bench.moe import _csv
from moegemm.bench.report import _fmt

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# ---------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class EPShape:
    """T tokens per rank of width d, top-k of E experts of hidden width n: E fixed, or ``E_local`` per rank."""

    name: str
    T: int
    d: int
    n: int
    k: int
    E: int | None = None
    E_local: int | None = None
    tags: tuple[str, ...] = ()
    source: str = ""

    def experts(self, P: int) -> int:
        E = self.E if self.E is not None else self.E_local * P
        if E % P:
            raise ValueError(f"{self.name}: E={E} experts do not split over an EP group of {P} ranks")
        return E


SHAPES = {
    s.name: s
    for s in (
        EPShape("qwen3-30b-a3b", 8192, 2048, 768, 8, E=128, tags=("gpu",), source="Qwen3-30B-A3B config"),
        EPShape(
            "deepseek-v3-like",
            8192,
            7168,
            2048,
            8,
            E_local=8,
            tags=("gpu",),
            source="DeepSeek-V3, 8 experts/rank",
        ),
        # d and n multiples of 8: torch._grouped_mm wants 16-byte strides in bf16.
        EPShape("tiny-E8-k2", 24, 32, 16, 2, E=8, tags=("tiny",), source="CI"),
        EPShape("tiny-El2-k3", 20, 32, 16, 3, E_local=2, tags=("tiny",), source="CI: 2 experts per rank"),
    )
}
NVLINK_REF_BYTES = 256 << 20  # per rank, the all-to-all bandwidth reference
DEFAULT_SIZES = (2, 4)


def select_shapes(text: str | None, cuda: bool) -> list[EPShape]:
    """Comma-separated names or tags ("gpu", "tiny", "all"); default gpu on CUDA, tiny on CPU."""
    names = [t.strip() for t in (text or "").split(",") if t.strip()] or ["gpu" if cuda else "tiny"]
    picked: list[EPShape] = []
    for name in names:
        hits = (
            [SHAPES[name]]
            if name in SHAPES
            else [s for s in SHAPES.values() if name == "all" or name in s.tags]
        )
        if not hits:
            raise SystemExit(f"--ep-shapes: unknown shape or tag {name!r}; shapes: {', '.join(SHAPES)}")
        picked += [s for s in hits if s not in picked]
    return picked


# ---------------------------------------------------------------- peers


Block = Callable[..., torch.Tensor]


@dataclasses.dataclass(frozen=True)
class EPPeer:
    """``build(group, backend) -> block``; ``build`` must be importable by name (the ranks are spawned)."""

    name: str
    label: str
    build: Callable[[object, str], Block]


def _expert_major(recv_counts: torch.Tensor, P: int, E_l: int, total: int) -> torch.Tensor:
    """Index that reorders rows received rank-major [(r0,e0), (r0,e1), .., (r1,e0), ..] into expert-major
    [(r0,e0), (r1,e0), .., (r0,e1), ..]; ``total`` (the row count, known on the host) keeps it free of syncs."""
    starts = (recv_counts.cumsum(0) - recv_counts).view(P, E_l).t().reshape(-1)
    lens = recv_counts.view(P, E_l).t().reshape(-1)
    seg = torch.repeat_interleave(torch.arange(P * E_l, device=lens.device), lens, output_size=total)
    out_starts = lens.cumsum(0) - lens
    return starts[seg] + torch.arange(total, device=lens.device) - out_starts[seg]


def _torchtitan(group, backend: str) -> Block:
    """torchtitan's AllToAllTokenDispatcher + GroupedExperts on one fused w13 (``backend`` unused)."""
    import torch.distributed._functional_collectives as fc

    if not hasattr(torch, "_grouped_mm"):
        raise moe.Unavailable(f"torch {torch.__version__} has no torch._grouped_mm")
    P = dist.get_world_size(group)

    def block(x, ids, weights, w13, w2):
        E_l, n = w13.shape[0], w2.shape[2]
        E, k = E_l * P, ids.shape[1]
        flat = ids.reshape(-1)
        counts = torch.histc(flat.float(), bins=E, min=0, max=E - 1).to(torch.int64)  # bincount syncs on CUDA
        order = torch.argsort(flat, stable=True)
        token = order // k
        scores = weights.reshape(-1)[order]
        with torch.no_grad():
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=group)  # rank j's counts for my experts, rank-major
            # torchtitan: the local splits copied without blocking, the received ones blocking (the host sync).
            in_splits = counts.view(P, E_l).sum(1).to("cpu", non_blocking=True)
            out_splits = recv.view(P, E_l).sum(1).to("cpu").tolist()
            in_splits = in_splits.tolist()
        routed = fc.all_to_all_single_autograd(x[token], out_splits, in_splits, group)
        perm = _expert_major(recv, P, E_l, sum(out_splits))
        routed = routed[perm]
        offs = torch.cumsum(recv.view(P, E_l).sum(0), 0, dtype=torch.int32)
        h = torch._grouped_mm(routed, w13.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(torch.nn.functional.silu(h[:, :n]) * h[:, n:], w2.transpose(-2, -1), offs=offs)
        back = y.new_empty(y.shape)
        back[perm] = y
        y = fc.all_to_all_single_autograd(back, in_splits, out_splits, group)
        y = (y.float() * scores.float()[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)

    return block


def _moegemm(group, backend: str, chunks: int) -> Block:
    from moegemm.torch import moe_experts

    def block(x, ids, weights, w13, w2):
        return moe_experts(x, ids, weights, w13, w2, ep_group=group, chunks=chunks, backend=backend)

    return block


TORCHTITAN = "torchtitan-a2a"
PEERS = {
    p.name: p
    for p in (
        EPPeer(TORCHTITAN, "all_to_all_single, host-synced splits, permute, torch._grouped_mm", _torchtitan),
        *(
            EPPeer(
                f"moegemm-c{c}", f"moe_experts(ep_group, chunks={c})", functools.partial(_moegemm, chunks=c)
            )
            for c in (1, 2, 4)
        ),
    )
}


# ---------------------------------------------------------------- one EP group


@dataclasses.dataclass(frozen=True)
class Spec:
    """What every rank runs; pickled to the spawned ranks."""

    shapes: tuple[EPShape, ...]
    routings: tuple[str, ...]
    peers: tuple[EPPeer, ...]
    dtype: str = "bfloat16"
    seed: int = 0
    backend: str = "auto"
    warmup: int = 3
    reps: int = 20
    timeout_s: float = 300.0  # a rank stuck in a collective this long fails the run


class _Group:
    """The EP group as one rank sees it, with the cross-rank reductions the records need."""

    def __init__(self, pg, device: torch.device):
        self.pg, self.device = pg, device
        self.P, self.rank = dist.get_world_size(pg), dist.get_rank(pg)
        self.cuda = device.type == "cuda"

    def gather(self, obj) -> list:
        out = [None] * self.P
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def barrier(self) -> None:
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.pg)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def times(self, fn: Callable, warmup: int, reps: int) -> float | None:
        """Median over ``reps`` calls of the slowest rank's ms per call (each call after a barrier, between two
        CUDA events); None off CUDA."""
        if not self.cuda:
            return None
        for _ in range(warmup):
            fn()
        mine = []
        for _ in range(reps):
            self.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            mine.append(start.elapsed_time(end))
        every = self.gather(mine)
        return statistics.median(max(ts) for ts in zip(*every))


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@dataclasses.dataclass
class _Case:
    """One rank's inputs (``moe.Inputs`` of its tokens and experts) and the oracle's answers for them."""

    inp: moe.Inputs
    ref: tuple[torch.Tensor, ...]
    E: int
    rows_per_rank: list[int]


def _case(g: _Group, shape: EPShape, routing: str, spec: Spec) -> _Case:
    P, r, device = g.P, g.rank, g.device
    E = shape.experts(P)
    E_l = E // P
    dtype = getattr(torch, spec.dtype)
    whole = moe.MoEShape(shape.name, P * shape.T, shape.d, shape.n, E, shape.k, shape.tags)
    full = moe.make_inputs(whole, routing, spec.seed, device, dtype)
    rows = slice(r * shape.T, (r + 1) * shape.T)
    experts = slice(r * E_l, (r + 1) * E_l)
    rows_per_rank = torch.bincount(full.ids.reshape(-1).long().cpu() // E_l, minlength=P).tolist()

    def leaf(t):
        return t.detach().clone().requires_grad_()

    x, weights, ids, dy = (
        leaf(full.x[rows]),
        leaf(full.weights[rows]),
        full.ids[rows].clone(),
        full.dy[rows].clone(),
    )
    compute = torch.float32 if g.cuda else torch.float64
    # The oracle: this rank's tokens through all E experts; the expert gradients summed over the group.
    out, dx, dw13, dw2, dweights = moe.oracle(moe.Inputs(x, ids, weights, full.w13, full.w2, dy), compute)
    for t in (dw13, dw2):
        dist.all_reduce(t, group=g.pg)
    ref = (out, dx, dw13[experts].clone(), dw2[experts].clone(), dweights)
    inp = moe.Inputs(x, ids, weights, leaf(full.w13[experts]), leaf(full.w2[experts]), dy)
    del full, dw13, dw2
    _free(device)
    return _Case(inp, ref, E, rows_per_rank)


def _check(peer: EPPeer, g: _Group, case: _Case, spec: Spec) -> tuple[dict, Block | None]:
    """This rank's verdict on one fwd+bwd against the oracle: {"status", "reason", "relerr"}."""
    from moegemm.bench import harness

    try:
        block = peer.build(g.pg, spec.backend)
    except moe.Unavailable as exc:
        return {"status": "skipped", "reason": str(exc)}, None
    except Exception as exc:  # noqa: BLE001
        return {"status": "failed", "reason": moe._reason(exc)}, None
    try:
        got = moe.step(block, case.inp)
    except Exception as exc:  # noqa: BLE001
        return {"status": "failed", "reason": moe._reason(exc)}, None
    errs = {name: harness.relerr(o, r) for name, o, r in zip(moe.GRADS, got, case.ref)}
    return {"status": "ok", "reason": None, "relerr": errs}, block


def _merge_checks(mine: list[dict], tol: float) -> dict:
    """One record's status from every rank's verdict: failed if any rank failed or is above ``tol``, skipped if
    all skipped; relerr: the worst rank's per output."""
    failed = [f"rank {r}: {v['reason']}" for r, v in enumerate(mine) if v["status"] == "failed"]
    if failed:
        return {"status": "failed", "reason": "; ".join(failed)[:400]}
    if any(v["status"] == "skipped" for v in mine):
        return {"status": "skipped", "reason": next(v["reason"] for v in mine if v["status"] == "skipped")}
    relerr = {name: max(v["relerr"][name] for v in mine) for name in moe.GRADS}
    rec = {"relerr": relerr, "max_relerr": max(relerr.values()), "tol": tol}
    worst = max(relerr, key=relerr.get)
    if not relerr[worst] <= tol:  # NaN fails too
        rank = max(range(len(mine)), key=lambda r: mine[r]["relerr"][worst])
        return {
            **rec,
            "status": "failed",
            "reason": f"relerr above {tol:.0e}: {worst} {relerr[worst]:.2e} on rank {rank}",
        }
    return {**rec, "status": "ok", "reason": None}


def add_flops(rec: dict) -> None:
    """Per-GPU TF/s of a timed record (module docstring): 6Tkdn per forward, twice that per backward."""
    fwd = moe.fwd_flops(rec["T"], rec["d"], rec["n"], rec["k"])
    rec["fwd_flops_per_gpu"] = fwd
    if rec.get("fwd_ms") and rec.get("step_ms"):
        rec["bwd_ms"] = rec["step_ms"] - rec["fwd_ms"]
        rec["fwd_tflops"] = fwd / rec["fwd_ms"] / 1e9
        rec["bwd_tflops"] = 2 * fwd / rec["bwd_ms"] / 1e9 if rec["bwd_ms"] > 0 else None
        rec["step_tflops"] = 3 * fwd / rec["step_ms"] / 1e9


def _measure(peer: EPPeer, g: _Group, case: _Case, base: dict, spec: Spec) -> dict:
    mine, block = _check(peer, g, case, spec)
    rec = {**base, "impl": peer.name, **_merge_checks(g.gather(mine), moe.REL_TOL[case.inp.x.dtype])}
    if rec["status"] == "ok" and g.cuda:
        from moegemm.bench import timing

        inp = case.inp

        def fwd():
            return block(inp.x, inp.ids, inp.weights, inp.w13, inp.w2)

        run = functools.partial(moe.step, block, inp)
        syncs = moe.count_syncs(run, g.device)
        _, peak_mb = timing.call_with_peak_mb(run, g.device)
        mem = g.gather((syncs, peak_mb))
        rec["host_syncs"] = max(s for s, _ in mem)
        rec["host_syncs_per_rank"] = [s for s, _ in mem]
        rec["peak_gib"] = max(m for _, m in mem) / 1024
        rec["fwd_ms"] = g.times(fwd, spec.warmup, spec.reps)
        rec["step_ms"] = g.times(run, spec.warmup, spec.reps)
        add_flops(rec)
    else:
        add_flops(rec)
    return rec  # the caller frees the device memory once block and its closures are gone


# ---------------------------------------------------------------- collectives alone


def _gbps(nbytes: float, ms: float | None) -> float | None:
    return nbytes / ms / 1e6 if ms else None


def _comm(g: _Group, case: _Case, base: dict, spec: Spec) -> list[dict]:
    """The dispatch and combine collectives of each peer at this case's sizes (module docstring)."""
    P, r = g.P, g.rank
    inp = case.inp
    T, d = inp.x.shape
    k = inp.ids.shape[1]
    x, ids, weights = inp.x.detach(), inp.ids, inp.weights.detach()
    gathered = [t.new_empty((P * t.shape[0], *t.shape[1:])) for t in (x, ids, weights)]
    partial = x.new_zeros(P * T, d)  # finite: a reduction of garbage could meet NaNs
    out = x.new_empty(T, d)

    def ag():
        for dst, src in zip(gathered, (x, ids, weights)):
            _all_gather(dst, src, group=g.pg)

    def rs():
        _reduce_scatter(out, partial, group=g.pg)

    # torchtitan's splits: rows of mine going to each rank, rows coming from each (one sync, outside the timing)
    E_l = case.E // P
    send = torch.bincount(ids.reshape(-1).long() // E_l, minlength=P)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=g.pg)
    in_splits, out_splits = send.tolist(), recv.tolist()
    tokens = x.new_zeros(T * k, d)
    routed = x.new_zeros(sum(out_splits), d)

    def a2a_dispatch():
        dist.all_to_all_single(routed, tokens, out_splits, in_splits, group=g.pg)

    def a2a_combine():
        dist.all_to_all_single(tokens, routed, in_splits, out_splits, group=g.pg)

    es = x.element_size()
    row_bytes = d * es + k * ids.element_size() + k * weights.element_size()
    received = {  # bytes this rank receives from the other ranks
        ("moegemm", "dispatch"): (P - 1) * T * row_bytes,
        ("moegemm", "combine"): (P - 1) * T * d * es,
        (TORCHTITAN, "dispatch"): (sum(out_splits) - out_splits[r]) * d * es,
        (TORCHTITAN, "combine"): (sum(in_splits) - in_splits[r]) * d * es,
    }
    fns = {
        ("moegemm", "dispatch"): ag,
        ("moegemm", "combine"): rs,
        (TORCHTITAN, "dispatch"): a2a_dispatch,
        (TORCHTITAN, "combine"): a2a_combine,
    }
    collective = {"moegemm": "all_gather x, ids, weights / reduce_scatter", TORCHTITAN: "all_to_all_single"}
    every = g.gather(received)
    records = []
    for key, fn in fns.items():
        if not g.cuda:
            fn()  # runs once unchecked: the code path works; nothing is timed
        ms = g.times(fn, spec.warmup, spec.reps)
        mean_bytes = sum(e[key] for e in every) / P
        records.append(
            {
                **base,
                "kind": "comm",
                "impl": key[0],
                "op": key[1],
                "collective": collective[key[0]],
                "status": "ok" if g.cuda else "ran (not timed)",
                "ms": ms,
                "bytes_received_per_rank": [e[key] for e in every],
                "gbps": _gbps(mean_bytes, ms),
            }
        )
    return records


def _nvlink_ref(g: _Group, spec: Spec) -> dict:
    """all_to_all_single of NVLINK_REF_BYTES per rank in equal splits: the bandwidth the collectives are read
    against (CPU: 1 MiB, run once, not timed)."""
    nbytes = NVLINK_REF_BYTES if g.cuda else 1 << 20
    nbytes -= nbytes % (g.P * 2)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=g.device)
    dst = torch.empty_like(src)

    def fn():
        dist.all_to_all_single(dst, src, group=g.pg)

    if not g.cuda:
        fn()
    ms = g.times(fn, spec.warmup, spec.reps)
    received = nbytes * (g.P - 1) // g.P
    return {
        "kind": "nvlink",
        "ep": g.P,
        "impl": "nccl" if g.cuda else "gloo",
        "op": "all_to_all_single, equal splits",
        "status": "ok" if g.cuda else "ran (not timed)",
        "bytes_per_rank": nbytes,
        "bytes_received_per_rank": received,
        "ms": ms,
        "gbps": _gbps(received, ms),
    }


def run_group(
    pg, device: torch.device, spec: Spec, on_case: Callable[[list[dict]], None] = lambda _: None
) -> list[dict]:
    """Every (shape, routing, peer) on this EP group; the records (complete on every rank). ``on_case(records so
    far)`` after each (shape, routing)."""
    g = _Group(pg, device)
    say = (
        (lambda s: print(f"[ep {g.P}] {s}", file=sys.stderr, flush=True)) if g.rank == 0 else (lambda s: None)
    )
    nvlink = _nvlink_ref(g, spec)
    _free(device)
    records = [nvlink]
    say(f"all-to-all reference: {_fmt(nvlink['gbps'], '.0f')} GB/s")
    for shape in spec.shapes:
        for routing in spec.routings:
            start = time.perf_counter()
            try:
                E = shape.experts(g.P)
            except ValueError as exc:
                records.append(
                    {
                        "kind": "block",
                        "shape": shape.name,
                        "routing": routing,
                        "ep": g.P,
                        "status": "skipped",
                        "reason": str(exc),
                    }
                )
                continue
            case = _case(g, shape, routing, spec)
            base = {
                "kind": "block",
                "shape": shape.name,
                "routing": routing,
                "ep": g.P,
                "T": shape.T,
                "d": shape.d,
                "n": shape.n,
                "E": E,
                "E_local": E // g.P,
                "k": shape.k,
                "rows_per_rank": case.rows_per_rank,
                "oracle": "fp32" if g.cuda else "fp64",
            }
            for peer in spec.peers:
                records.append(_measure(peer, g, case, base, spec))
                _free(device)
                say(f"{shape.name} {routing} {peer.name}: {records[-1]['status']}")
            comm_base = {k: base[k] for k in ("shape", "routing", "ep", "T", "d", "k", "rows_per_rank")}
            records += _comm(g, case, comm_base, spec)
            _free(device)
            for rec in records:
                if rec.get("kind") == "comm" and rec.get("gbps") and nvlink["gbps"]:
                    rec["pct_nvlink"] = 100 * rec["gbps"] / nvlink["gbps"]
            del case
            _free(device)
            say(f"{shape.name} {routing}: {time.perf_counter() - start:.1f} s")
            add_vs_torchtitan(records)
            on_case(records)
    return records


def add_vs_torchtitan(records: list[dict]) -> None:
    """Each timed block record gets ``vs_torchtitan``: torchtitan-a2a's step ms (and fwd ms) over its own."""
    titan = {
        (r["shape"], r["routing"], r["ep"]): r
        for r in records
        if r.get("kind") == "block" and r.get("impl") == TORCHTITAN and r.get("step_ms")
    }
    for r in records:
        t = titan.get((r.get("shape"), r.get("routing"), r.get("ep")))
        if r.get("kind") == "block" and t and r.get("step_ms"):
            r["vs_torchtitan"] = t["step_ms"] / r["step_ms"]
            r["fwd_vs_torchtitan"] = t["fwd_ms"] / r["fwd_ms"]


# ---------------------------------------------------------------- launching the ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, P: int, port: int, spec: Spec, out: str, cuda: bool) -> None:
    """One spawned rank: join the group, run it; rank 0 writes the records to ``out`` after every case."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (the hosts' NCCL set-up)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=P,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
        **({"device_id": device} if cuda else {}),
    )

    def write(records):
        if rank == 0:
            Path(out).write_text(json.dumps(records, default=str))

    try:
        write(run_group(dist.group.WORLD, device, spec, on_case=write))
    finally:
        dist.destroy_process_group()


def spawn(P: int, spec: Spec, cuda: bool, scratch: Path | None = None) -> list[dict]:
    """Runs one EP size in P spawned processes; the records rank 0 wrote (and a failed one if a rank died).
    ``scratch``: where rank 0 writes its records after every case (a temporary file if None), removed once read:
    a run killed mid-way leaves its finished cases there."""
    import torch.multiprocessing as mp

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(scratch or Path(tmp) / "records.json")
        error = None
        try:
            mp.spawn(_rank_main, args=(P, _free_port(), spec, str(out), cuda), nprocs=P, join=True)
        except Exception as exc:  # noqa: BLE001
            error = moe._reason(exc)
        records = json.loads(out.read_text()) if out.exists() else []
        out.unlink(missing_ok=True)
    if error is not None:
        records.append({"kind": "run", "ep": P, "status": "failed", "reason": f"a rank died: {error}"})
    return records


def run_torchrun(spec: Spec, sizes: list[int]) -> list[dict] | None:
    """Under torchrun: each EP size P on world ranks [0, P); the records on world rank 0, None on the others."""
    cuda = torch.cuda.is_available()
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            timeout=datetime.timedelta(seconds=spec.timeout_s),
            **({"device_id": device} if cuda else {}),
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    records = []
    for P in sizes:
        if P > world:
            records.append(
                {"kind": "run", "ep": P, "status": "skipped", "reason": f"world size {world} < {P}"}
            )
            continue
        pg = dist.group.WORLD if P == world else dist.new_group(list(range(P)))
        if rank < P:
            got = run_group(pg, device, spec)
            if rank == 0:
                records += got
        dist.barrier()
    return records if rank == 0 else None


def run(
    spec: Spec,
    sizes: list[int],
    cuda: bool,
    out: Path | None = None,
    on_size: Callable[[list[dict]], None] = lambda _: None,
) -> list[dict] | None:
    """Every EP size: in this process group under torchrun, else spawned (a size needing more GPUs than the
    host has is skipped; ``on_size(records so far)`` after each). None on a torchrun rank other than 0."""
    if "WORLD_SIZE" in os.environ:
        return run_torchrun(spec, sizes)
    records = []
    for P in sizes:
        if cuda and torch.cuda.device_count() < P:
            reason = f"EP {P} needs {P} GPUs, the host has {torch.cuda.device_count()}"
            records.append({"kind": "run", "ep": P, "status": "skipped", "reason": reason})
        else:
            scratch = out.with_name(f"{out.stem}.partial-ep{P}.json") if out else None
            records += spawn(P, spec, cuda, scratch)
        on_size(records)
    return records


# ---------------------------------------------------------------- CLI, table, JSON


def table(records: list[dict], title: str, check_only: bool):
    from rich.table import Table

    t = Table(title=title)
    cols = ["shape", "routing", "EP", "impl"]
    if check_only:
        cols += ["relerr out", "dx", "dw13", "dw2", "dweights", "tol", "check", "note"]
    else:
        cols += [
            "fwd ms",
            "bwd ms",
            "f+b ms",
            "fwd TF/s",
            "bwd TF/s",
            "vs titan",
            "peak GiB",
            "syncs",
            "max relerr",
            "note",
        ]
    for c in cols:
        t.add_column(c, justify="left" if c in ("shape", "routing", "impl", "note", "check") else "right")
    t.caption = (
        "relerr: worst rank's ||got - oracle|| / ||oracle|| (fp64 oracle, gloo, nothing timed)"
        if check_only
        else "ms: median over calls of the slowest rank (barrier, CUDA events); TF/s per GPU: 6Tkdn fwd, 12Tkdn bwd; "
        "vs titan: torchtitan-a2a's f+b ms / this one's; syncs: host syncs per fwd+bwd (most of any rank)"
    )
    previous = None
    for r in records:
        if r.get("kind") not in ("block", "run"):
            continue
        key = (r.get("shape"), r.get("routing"), r.get("ep"))
        first = key != previous
        if first and previous is not None:
            t.add_section()
        previous = key
        head = [str(r.get("shape") or "-"), str(r.get("routing") or "-"), str(r["ep"]), r.get("impl") or "-"]
        note = "" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
        style = {"ok": None, "failed": "bold red", "skipped": "dim"}.get(r["status"])
        errs = r.get("relerr") or {}
        if check_only:
            row = [_fmt(errs.get(n), ".1e") for n in moe.GRADS] + [_fmt(r.get("tol"), ".0e")]
            verdict = {"ok": "pass", "failed": "FAIL"}.get(r["status"], r["status"])
            t.add_row(*head, *row, verdict, note, style=style)
            continue
        row = [
            _fmt(r.get("fwd_ms"), ".2f"),
            _fmt(r.get("bwd_ms"), ".2f"),
            _fmt(r.get("step_ms"), ".2f"),
            _fmt(r.get("fwd_tflops"), ".0f"),
            _fmt(r.get("bwd_tflops"), ".0f"),
            _fmt(r.get("vs_torchtitan"), ".2f"),
            _fmt(r.get("peak_gib"), ".2f"),
            _fmt(r.get("host_syncs"), "d"),
            _fmt(r.get("max_relerr"), ".1e"),
        ]
        t.add_row(*head, *row, note, style=style)
    return t


def comm_table(records: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title)
    for c in ("shape", "routing", "EP", "impl", "op", "collective", "ms", "GB/s", "% NVLink a2a"):
        t.add_column(c, justify="left" if c in ("shape", "routing", "impl", "op", "collective") else "right")
    t.caption = "GB/s: bytes a rank receives from the others (mean over ranks) / ms (slowest rank, median)"
    for r in records:
        if r.get("kind") == "nvlink":
            t.add_row(
                "-",
                "-",
                str(r["ep"]),
                r["impl"],
                "reference",
                r["op"],
                _fmt(r.get("ms"), ".3f"),
                _fmt(r.get("gbps"), ".0f"),
                "100" if r.get("gbps") else "-",
                style="cyan",
            )
        elif r.get("kind") == "comm":
            t.add_row(
                r["shape"],
                r["routing"],
                str(r["ep"]),
                r["impl"],
                r["op"],
                r["collective"],
                _fmt(r.get("ms"), ".3f"),
                _fmt(r.get("gbps"), ".0f"),
                _fmt(r.get("pct_nvlink"), ".0f"),
            )
    return t


def failures(records: list[dict]) -> list[str]:
    return [
        f"{r.get('shape', '-')} {r.get('routing', '-')} ep {r['ep']} {r.get('impl', '-')}: {r['reason']}"
        for r in records
        if r["status"] == "failed"
    ]


def main(args, argv, env, device: torch.device, console) -> int:
    """``--ep``: the run, the tables and ``benchmarks/results/<device>/ep.json``; 1 on a failed check off CUDA."""
    from moegemm.bench import report

    cuda = device.type == "cuda"
    sizes = [int(v) for v in _csv(args.ep_sizes)] or list(DEFAULT_SIZES)
    routings = tuple(_csv(args.moe_routing) or ["balanced", "skewed"])
    if set(routings) - set(moe.ROUTINGS):
        raise SystemExit(f"--moe-routing takes a comma-separated subset of {moe.ROUTINGS}, got {routings}")
    spec = Spec(
        shapes=tuple(select_shapes(args.ep_shapes, cuda)),
        routings=routings,
        peers=tuple(PEERS.values()),
        dtype={"bf16": "bfloat16", "fp16": "float16"}[args.dtype],
        seed=args.seed,
        backend="auto",
        **({"warmup": 2, "reps": 8} if args.quick else {}),
    )
    out = Path(args.out or report.default_out(env.device, args.name or "ep"))
    rc = report_run(spec, sizes, cuda, out, env, argv, console)
    if cuda and importlib.util.find_spec("jax") is not None:
        # The JAX EP bench (bench/ep_jax.py) in a child process: JAX and PyTorch would share one process's GPU
        # memory. Its JSON sits beside this one (ep-jax.json).
        cmd = [sys.executable, "-m", "moegemm.bench.ep_jax", "--ep-sizes", ",".join(map(str, sizes))]
        cmd += ["--out", str(out.with_name(out.stem + "-jax.json"))]
        if args.ep_shapes:
            cmd += ["--ep-shapes", args.ep_shapes]
        child_env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        rc = max(rc, subprocess.run(cmd, env=child_env, check=False).returncode)
    return rc


def report_run(spec: Spec, sizes: list[int], cuda: bool, out: Path, env, argv, console) -> int:
    """Runs ``spec`` over ``sizes``, prints the tables and writes ``out`` (on torchrun rank 0 only); 1 on a failed
    check off CUDA."""
    started = time.perf_counter()
    check_only = not cuda
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(records: list[dict], partial: bool) -> dict:
        """After every EP size too (partial): a run cut short by a time limit keeps its finished sizes."""
        meta = _meta(spec, sizes, records, env, check_only, argv, time.perf_counter() - started)
        doc = {"meta": {**meta, "partial": partial}, "records": records}
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        return meta

    records = run(spec, sizes, cuda, out, on_size=lambda rs: write(rs, True))
    if records is None:  # a torchrun rank other than 0
        return 0
    meta = write(records, False)
    title = f"{env.device} | expert parallelism | {spec.dtype} | torch {env.torch} triton {env.triton}"
    console.print(table(records, title + (" | correctness only" if check_only else ""), check_only))
    if not check_only:
        console.print(comm_table(records, title + " | dispatch and combine alone"))
    console.print(f"wrote {out}")
    for f in meta["failed"]:
        console.print(f"  failed: {f}", style="red", highlight=False)
    console.print(f"done in {meta['elapsed_s']:.0f} s")
    return 1 if check_only and meta["failed"] else 0


def _meta(
    spec: Spec, sizes: list[int], records: list[dict], env, check_only: bool, argv, elapsed: float
) -> dict:
    from moegemm.bench import report

    return {
        **report.run_meta(env, check_only, argv),
        "benchmark": "ep",
        "ep_sizes": sizes,
        "dtype": spec.dtype,
        "seed": spec.seed,
        "backend": spec.backend,
        "shapes": {s.name: dataclasses.asdict(s) for s in spec.shapes},
        "routings": list(spec.routings),
        "routing_params": {"skew": moe.SKEW, "hot_bias": moe.HOT_BIAS},
        "impls": {p.name: p.label for p in spec.peers},
        "flops": "per GPU: fwd 6*T*k*d*n (T tokens per rank), bwd 2x, fwd+bwd 3x",
        "timing": None
        if check_only
        else f"per call: barrier, CUDA events, slowest rank; median of {spec.reps} calls after {spec.warmup} warm-up",
        "rel_tol": moe.REL_TOL[getattr(torch, spec.dtype)],
        "oracle": "moe_experts_reference per rank on its tokens with all experts, expert grads all_reduced; "
        + ("fp64" if check_only else "fp32, TF32 off"),
        "launch": "torchrun" if "WORLD_SIZE" in os.environ else "torch.multiprocessing.spawn",
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "nvlink_a2a": {str(r["ep"]): r.get("gbps") for r in records if r.get("kind") == "nvlink"},
        "elapsed_s": elapsed,
        "failed": failures(records),
    }
