"""Test set-up: pick the execution mode before triton is imported, and poison library outputs.

Without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1 must be set before
triton is imported, because @triton.jit decides at decoration time). With a GPU they run compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moegemm._src import plan  # noqa: E402
from moegemm._src.torch import ops as _ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Backends of the tests parametrized by backend: "triton" runs the kernels (compiled on a GPU, where
# `pytest -m gpu` selects it, and under the interpreter on CPU); "reference" the plain-torch twin.
BACKENDS = [pytest.param("triton", marks=pytest.mark.gpu), "reference"]

# For tests that only make sense on a GPU (CUDA graphs, stream races, > 2^31 elements); mark them gpu too.
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")


def _nan_empty(*size, dtype=None, device=None, **kwargs):
    out = torch.empty(*size, dtype=dtype, device=device, **kwargs)
    return out.fill_(float("nan")) if out.is_floating_point() else out


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every output buffer the library allocates starts as NaN, so unwritten elements fail the tests."""
    monkeypatch.setattr(_ops, "empty", _nan_empty)


@pytest.fixture(autouse=True)
def unconstrained_plan():
    """Each test starts from the planner's rules alone; constraints a test sets (``plan.constrain``) end
    with it."""
    plan.reset()
    yield
    plan.reset()


@pytest.fixture
def device() -> str:
    return DEVICE


def spy_store_paths(monkeypatch, op: str) -> list[tuple[str, tuple]]:
    """For the TMA-store test classes of ``op`` ("m_grouped" or "k_grouped"): the TMA store on at any
    problem size, and, where the picked config leaves no shared memory for the staging tile (it then stores
    from registers, by design; on a GPU), the table's default config instead. Returns the list that
    records (launch name, spec) per launch: "M_GROUPED"/"K_GROUPED" (register store) or the "_TMA" one."""
    import dataclasses

    from moegemm._src import configs
    from moegemm._src.kernels import k_grouped, m_grouped

    fits = {
        "m_grouped": lambda c: m_grouped.tma_store_fits(c, 2),
        "k_grouped": lambda c: k_grouped.tma_store_fits(c, 2),
    }[op]
    step = "block_k" if op == "m_grouped" else "block_r"

    def pick(kind, problem, target, config):
        if kind == op and not fits(config):
            config = configs.candidates(kind, target.name)[0]
            if problem.dtype == "float32":  # as pick_config: 4-byte operands take half the step
                config = dataclasses.replace(config, **{step: getattr(config, step) // 2})
        return config

    # The tests' problems are tiny: the store at any size.
    plan.constrain(tma_store=True, tma_store_min_flops=0, config=then(plan.active().config, pick))
    return record_launches(monkeypatch, op)


def then(first, second):
    """Constraints.config: ``second`` applied to what ``first`` (None: the pick itself) gives."""
    if first is None:
        return second
    return lambda op, problem, target, config: second(op, problem, target, first(op, problem, target, config))


def record_launches(monkeypatch, op: str) -> list[tuple[str, tuple]]:
    """Records (store path, spec) of every direct launch of ``op`` ("m_grouped" or "k_grouped"), each still
    launching: "M_GROUPED"/"K_GROUPED" for the register store, "M_GROUPED_TMA"/"K_GROUPED_TMA" for the TMA
    store (one launch per op, whose meta says which store its kernel makes)."""
    from moegemm._src.torch import launch as _launch

    calls = []

    name, describe = {
        "m_grouped": ("M_GROUPED", _launch._m_launch),
        "k_grouped": ("K_GROUPED", _launch._k_launch),
    }[op]
    direct = getattr(_launch, name)

    def record(spec, *rest, inner=direct.launch):
        calls.append((name + "_TMA" if describe(*spec).meta["TMA_STORE"] else name, spec))
        inner(spec, *rest)

    monkeypatch.setattr(direct, "launch", record)
    return calls


def flat_configs(monkeypatch, tma_load: bool = False) -> None:
    """Every k_grouped launch takes the flat loop (whichever config the target's table or model picks),
    with config.tma_load as given."""
    import dataclasses

    def flat(op, problem, target, config):
        return dataclasses.replace(config, flat=True, tma_load=tma_load) if op == "k_grouped" else config

    plan.constrain(config=then(plan.active().config, flat))
