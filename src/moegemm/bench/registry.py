"""The implementation registry: every peer benchmarked in the same process and run.

An ``Impl`` names the ops it serves and a ``prepare(problem, op)`` that does all set-up outside the
timing (layout views, offsets, host-side splits, framework conversion) and returns a zero-argument
callable. The callable runs the op on device-resident inputs, cycling through ``problem.copies`` one
call at a time (starting at copy 0, which the correctness check relies on), and returns the output.

Adding a framework: write ``impls_<framework>.py`` that calls ``register(Impl(...))`` at import and
list it in ``IMPL_MODULES`` with the package it needs. JAX plugs in like this:

- inputs: convert ``problem.copies`` once in ``prepare`` (``jax.dlpack.from_dlpack`` or via numpy);
- timing: set ``clock="wall"`` and have the callable end with ``.block_until_ready()``; the harness
  then takes the median of perf_counter wall times (after the same warm-up), because CUDA events on
  torch's stream do not see XLA's stream. The output may be a jax.Array: the harness converts it with
  ``torch.from_dlpack`` for the correctness check.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

# Modules whose import registers impls, each with the package it needs (None: always importable).
# A module whose package is missing is left out; the run's meta lists it under "impls_unavailable".
IMPL_MODULES: tuple[tuple[str, str | None], ...] = (
    ("moegemm.bench.impls_torch", None),
    ("moegemm.bench.impls_jax", "jax"),
)
# Set (unless the user did) before a framework is first imported. JAX would otherwise grab 75% of
# the GPU at start-up and starve torch's allocations of the large cases in the same process.
IMPORT_ENV = {"jax": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}}


@dataclasses.dataclass(frozen=True)
class Impl:
    """One benchmarked implementation.

    name: label in tables and JSON. ops: subset of ("fwd", "dgrad", "wgrad").
    prepare(problem, op) -> fn: fn() runs the op once and returns its output.
    available(problem, op) -> reason or None: why this impl cannot serve the case (reported "skipped").
    reference(problem, op) -> tensor: a custom oracle, for impls that compute a different product
      with the same FLOPs (dense-cublas); None means the grouped oracle ``problem.reference(op)``.
    clock: "events" (CUDA events on the current torch stream) or "wall" (perf_counter; fn must block).
    """

    name: str
    ops: tuple[str, ...]
    prepare: Callable[[Any, str], Callable[[], Any]]
    available: Callable[[Any, str], str | None] = lambda problem, op: None
    reference: Callable[[Any, str], Any] | None = None
    clock: str = "events"


REGISTRY: dict[str, Impl] = {}
UNAVAILABLE: dict[str, str] = {}


def register(impl: Impl) -> Impl:
    if impl.name in REGISTRY:
        raise ValueError(f"impl {impl.name!r} is registered twice")
    if impl.clock not in ("events", "wall"):
        raise ValueError(f"impl {impl.name!r}: clock must be 'events' or 'wall', got {impl.clock!r}")
    REGISTRY[impl.name] = impl
    return impl


def load_impls() -> dict[str, Impl]:
    """Imports every module in IMPL_MODULES whose package is installed; returns the registry."""
    for module, needs in IMPL_MODULES:
        if needs is not None and importlib.util.find_spec(needs) is None:
            UNAVAILABLE[module] = f"{needs} is not installed"
            continue
        if importlib.util.find_spec(module) is None:
            UNAVAILABLE[module] = "module not written yet"
            continue
        for key, value in IMPORT_ENV.get(needs or "", {}).items():
            os.environ.setdefault(key, value)
        if needs is None:
            importlib.import_module(module)
            continue
        try:  # an optional framework that is installed but broken must not take the torch impls down
            importlib.import_module(module)
        except ImportError as exc:
            UNAVAILABLE[module] = f"import failed: {exc}"
    return REGISTRY


def select(names: list[str] | None) -> list[Impl]:
    impls = load_impls()
    if not names:
        return list(impls.values())
    unknown = [n for n in names if n not in impls]
    if unknown:
        raise SystemExit(f"unknown impls {unknown}; registered: {list(impls)}; unavailable: {UNAVAILABLE}")
    return [impls[n] for n in names]
