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
  ``report.py``      rich table, summary line, JSON file, PNG plot.

JSON output: ``{"meta": {...}, "records": [...]}``. ``meta`` holds the run-wide facts (device, date,
versions, driver, argv, timing method, roofline constants). Each record repeats device, date, torch,
triton, driver and split, so records stay self-describing when files are concatenated; its fields are
``report.RECORD_FIELDS``. ``status`` is "ok" (checked, then timed), "failed" (wrong output or an error,
not timed; ``reason`` says which) or "skipped" (the impl cannot serve this case; ``reason`` says why).

This package's ``__init__`` imports nothing heavy on purpose: the CLI must set TRITON_INTERPRET=1 on
machines without CUDA before triton is first imported.
"""
