"""GPU probe (perf-notes 29): the HBM write rate a plain kernel reaches on this card, for the floor of output-bound
wgrads (gpt-oss-120b fc1 writes a 4.25 GB bf16 dW). torch's fill (write only) and copy (read + write) of buffers that
size, CUDA-event medians (triton.testing.do_bench), printed as TB/s of bytes moved.

    python scripts/write_ceiling.py
"""

from __future__ import annotations

import json

import torch
import triton


def main() -> None:
    n = 128 * 5760 * 2880  # gpt-oss-120b fc1's dW elements
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    src = torch.empty(n // 4, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    rows = {
        "fill_write_tbs": 2 * n / triton.testing.do_bench(lambda: out.fill_(1.0), warmup=5, rep=200) / 1e9,
        "zero_write_tbs": 2 * n / triton.testing.do_bench(out.zero_, warmup=5, rep=200) / 1e9,
        "copy_rw_tbs": 4
        * (n // 4)
        / triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=200)
        / 1e9,
        "bytes_written": 2 * n,
        "device": torch.cuda.get_device_name(),
    }
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
