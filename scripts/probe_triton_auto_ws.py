"""GPU probe: does Triton's automatic warp specialization (tl.range(warp_specialize=True)) run on Hopper?

A dense persistent TMA matmul, each variant in its own process with a timeout (a warp-specialized
kernel can deadlock). perf-notes 19 has the H100 results (3.6: host descriptors hang, in-kernel ones
ran with a wrong product).

    python scripts/probe_triton_auto_ws.py
"""

import subprocess
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def dense_ws(
    a, b, c, N, T, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, VAR: tl.constexpr,
    DEVICE_DESC: tl.constexpr,
):  # fmt: skip
    """c [M, N] = a [M, K] @ b [N, K]^T, persistent over T 128x128 tiles. VAR: 0 warp-specializes the K loop,
    1 the tile loop, 2 neither. a and b are host TensorDescriptors, or with DEVICE_DESC plain pointers
    whose descriptors the kernel makes (Triton's global scratch, from triton.set_allocator)."""
    pid = tl.program_id(0)
    n_t = tl.cdiv(N, BN)
    if DEVICE_DESC:
        ad = tl.make_tensor_descriptor(a, [T * BM // (N // BN), K], [K, 1], [BM, BK])
        bd = tl.make_tensor_descriptor(b, [N, K], [K, 1], [BN, BK])
    else:
        ad = a
        bd = b
    for tile in tl.range(pid, T, tl.num_programs(0), warp_specialize=VAR == 1):
        acc = tl.zeros((BM, BN), tl.float32)
        m0 = (tile // n_t) * BM
        n0 = (tile % n_t) * BN
        for k in tl.range(0, K // BK, warp_specialize=VAR == 0):
            x = ad.load([m0, k * BK])
            y = bd.load([n0, k * BK])
            acc = tl.dot(x, tl.trans(y), acc)
        rm = m0 + tl.arange(0, BM)
        rn = n0 + tl.arange(0, BN)
        tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


def dense(var, progs, dev=False):
    M = N = K = 4096
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    T = (M // 128) * (N // 128)
    if dev:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
        ad, bd = a, b
    else:
        ad = TensorDescriptor.from_tensor(a, [128, 64])
        bd = TensorDescriptor.from_tensor(b, [128, 64])
    meta = dict(BM=128, BN=128, BK=64, K=K, VAR=var, DEVICE_DESC=dev, num_warps=4, num_stages=3)
    k = dense_ws[(progs,)](ad, bd, c, N, T, **meta)
    print("launched", k.metadata.shared, flush=True)
    torch.cuda.synchronize()
    ref = a @ b.T
    print("ok relerr", float((c.float() - ref.float()).norm() / ref.float().norm()), flush=True)
    ms = triton.testing.do_bench(lambda: dense_ws[(progs,)](ad, bd, c, N, T, **meta), return_mode="median")
    print("tflops", 2 * M * N * K / ms / 1e9, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        dense(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
    else:
        for var, progs, dev in (
            (2, 132, 0),
            (2, 132, 1),
            (0, 132, 1),
            (1, 132, 1),
            (0, 132, 0),
            (0, 1024, 1),
        ):
            print("== dense var", var, "programs", progs, "device descriptors", dev, flush=True)
            try:
                r = subprocess.run(
                    [sys.executable, __file__, str(var), str(progs), str(dev)],
                    timeout=45,
                    capture_output=True,
                    text=True,
                )
                print(r.stdout[-600:], r.stderr[-600:], flush=True)
            except subprocess.TimeoutExpired:
                print("TIMEOUT", flush=True)
