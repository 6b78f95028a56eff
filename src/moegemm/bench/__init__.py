"""Benchmark harness: moegemm next to its peers on the shared shape registry, in one process and run.

Run ``python -m moegemm.bench`` (or ``moegemm-bench``); ``--help`` lists the options.

Files, one role each:
  ``problem.py``     inputs of one case (group sizes, device-resident copies) and the fp32/fp64 oracle;
  ``registry.py``    ``Impl(name, ops, prepare, ...)`` and the one list of impl modules;
  ``impls_torch.py`` moegemm, torch._grouped_mm, loop-torch.mm, dense-cublas;
  ``roofline.py``    FLOPs, bytes and the per-case floor;
  ``timing.py``      CUDA-event / wall-clock medians and peak memory;
  ``harness.py``     check-then-time one (case, op, impl) into a record; the suite loop;
  ``tune.py``        ``--tune``: time every candidate config, write the committed per-device cache;
  ``report.py``      rich table, summary line, JSON file, PNG plot; the CPU correctness table; paths;
  ``fp8.py``, ``fp8_jax.py``, ``ep.py``, ``overhead.py``  the ``--fp8``, ``--fp8-jax``, ``--ep``, ``--overhead`` modes.

Output: on a GPU, ``benchmarks/results/<device>/<benchmark>.json`` and ``.png``, the canonical file of
that benchmark (bf16, bf16-balanced, jax, fp8, fp8-jax, ep; ``report.default_out``), overwritten by each
run. Without a GPU the run is a correctness job (``RunSpec.check_only``): every output checked against
the fp64 oracle under the Triton interpreter, nothing timed, no ratio or roofline floor, exit status 1
on a failed check; it writes to ``benchmarks/results/cpu-<machine>/``, which git ignores.

JSON: ``{"meta": {...}, "records": [...]}``. ``meta`` holds the run-wide facts (device, date,
versions, driver, argv, timing method, roofline constants); ``meta.mode`` is "benchmark" or
"correctness" (then ``meta.performance`` is false and ``meta.notice`` says why), and
``meta.correctness`` counts the checks. Each record repeats device, date, torch, triton, driver and
split, so records stay self-describing when files are concatenated; its fields are
``report.RECORD_FIELDS``. ``status`` is "ok" (checked, then timed unless check-only), "failed" (wrong
output or an error, not timed; ``reason`` says which) or "skipped" (the impl cannot serve this case;
``reason`` says why).

This package's ``__init__`` imports nothing heavy on purpose: the CLI must set TRITON_INTERPRET=1 on
machines without CUDA before triton is first imported.
"""
