"""Static instruction count of the k-grouped flat loop's per-step path in sm_90a SASS (no GPU needed).

    python scripts/sass_step_path.py [CANDIDATE_INDEX ...]   # default: 11 (flat, cp.async) and 12 (flat, TMA loads)

Compiles ``k_grouped_mm_kernel`` for one k_grouped sm90 candidate at dsv3 sizes with the TMA store
(``moegemm.testing.sm90._k_grouped``), disassembles the cubin with the bundled cuobjdump, takes the innermost loop
around the first HGMMA, and drops the blocks that forward conditional branches skip (the tile-change code and the
epilogue). On gpt-oss-20b's profile (perf-notes 27) the count matched the instructions Nsight Compute saw executed
once per step (211 vs 212).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton

from moegemm import configs
from moegemm.testing import sm90

LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")


def compile_candidate(index: int):
    config = configs.candidates("k_grouped", "sm90")[index]
    fn, meta, pointers, values = sm90._k_grouped(config, tma_store=True, tma_load=config.tma_load)
    return config, sm90.compile_source(fn, meta, pointers, values)


def sass(compiled) -> list[str]:
    cuobjdump = os.path.join(os.path.dirname(triton.knobs.nvidia.ptxas.path), "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    return [line for line in text.splitlines() if LINE.match(line)]


def step_path(lines: list[str]) -> list[str]:
    addr = [int(LINE.match(line).group(1), 16) for line in lines]
    first = next(i for i, line in enumerate(lines) if "HGMMA" in line)
    loop = None  # the shortest backward branch around the first HGMMA
    for i, line in enumerate(lines):
        m = re.search(r"BRA (0x[0-9a-f]+)", line)
        if m and i > first and int(m.group(1), 16) <= addr[first]:
            j = addr.index(int(m.group(1), 16))
            if loop is None or i - j < loop[1] - loop[0]:
                loop = (j, i)
    begin, end = loop
    skipped = set()
    for k in range(begin, end):
        m = re.search(r"@!?P\w+\s+BRA (0x[0-9a-f]+)", lines[k])
        if m and addr[k] < int(m.group(1), 16) <= addr[end]:
            skipped.update(range(k + 1, addr.index(int(m.group(1), 16))))
    return [lines[k] for k in range(begin, end + 1) if k not in skipped]


def main() -> int:
    for index in map(int, sys.argv[1:] or ["11", "12"]):
        config, compiled = compile_candidate(index)
        path = step_path(sass(compiled))
        ops = collections.Counter(
            re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0]
            for line in path
        )
        print(f"{index} {config}: {len(path)} instructions a step; {dict(ops.most_common(8))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
