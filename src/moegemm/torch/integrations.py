"""Drop-ins where MoE users already are: torchtitan's GroupedExperts and Hugging Face transformers' experts.

torchtitan (``torchtitan.models.moe.GroupedExperts``; not a dependency)::

    model = swap_grouped_experts(model)       # each GroupedExperts -> moegemm's, parameters shared
    experts = from_torchtitan(module)         # one module

transformers (>= 5, whose MoE models decorate their experts with ``@use_experts_implementation``)::

    register_transformers()                                   # "moegemm" in transformers' ExpertsInterface
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="moegemm")
    model.set_experts_implementation("moegemm")               # or switch a built model

Both run SwiGLU experts: torchtitan's on rows already grouped by expert (``m_grouped_mm``), transformers' on
(token, top-k) routing (``moe_experts``, reading the experts' ``gate_up_proj`` [E, 2n, d] and ``down_proj``
[E, d, n] as they are stored: they are moe_experts' w13 and w2 layouts, so nothing is copied).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from moegemm._src.torch.args import Backend
from moegemm.torch.api import m_grouped_mm
from moegemm.torch.moe import moe_experts

__all__ = [
    "GroupedExperts",
    "from_torchtitan",
    "register_transformers",
    "swap_grouped_experts",
    "transformers_experts_forward",
]

# torchtitan's GroupedExperts weights: w1/w2/w3 (releases to v0.2) or w1_EFD/w2_EDF/w3_EFD (main, 2026).
TORCHTITAN_NAMES = (("w1", "w2", "w3"), ("w1_EFD", "w2_EDF", "w3_EFD"))


def _local(t: torch.Tensor) -> torch.Tensor:
    # Expert-parallel shards arrive as DTensors; the ragged rows cannot be one, so the GEMMs take the local
    # shard, as torchtitan does.
    return t.to_local() if hasattr(t, "to_local") else t


class GroupedExperts(nn.Module):
    """torchtitan's ``GroupedExperts`` on moegemm: same parameters and forward, rows grouped by expert.

    Parameters (names as the torchtitan version they replace, ``names``): w1 [E, hidden, dim] (gate), w2
    [E, dim, hidden] (down), w3 [E, hidden, dim] (up).
    ``forward(x [R, dim], num_tokens_per_expert [E]) -> [R, dim]`` with rows(e) = [offset_e, offset_e + n_e),
    offset = exclusive prefix sum of num_tokens_per_expert::

        for e: out[rows(e)] = (silu(x[rows(e)] @ w1[e]^T) * (x[rows(e)] @ w3[e]^T)) @ w2[e]^T
        rows at or past sum(num_tokens_per_expert) (torchtitan's alignment padding): out = 0

    Computed in x's dtype (the weights are cast to it if they differ; torchtitan casts both to bf16), fp32
    accumulation, three ``m_grouped_mm`` calls; counts may be int or float (torchtitan's histc) and stay on
    the device.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        use_grouped_mm: bool = True,
        *,
        names: tuple[str, str, str] = TORCHTITAN_NAMES[0],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        backend: Backend = "auto",
    ):
        super().__init__()
        if names not in TORCHTITAN_NAMES:
            raise ValueError(f"GroupedExperts: names must be one of {TORCHTITAN_NAMES}, got {names}")
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm  # kept for torchtitan's configs; moegemm always runs grouped
        self.backend = backend
        self._names = names
        factory = {"dtype": dtype, "device": device}
        setattr(self, names[0], nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory)))
        setattr(self, names[1], nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **factory)))
        setattr(self, names[2], nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **factory)))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3), whatever their names."""
        return tuple(getattr(self, name) for name in self._names)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(w).to(x.dtype) for w in self.weights())
        sizes = num_tokens_per_expert
        if sizes.is_floating_point():  # torchtitan's histc counts are float32, exact integers
            sizes = sizes.to(torch.int32)
        # Weights are [E, out, in] (nn.Linear); m_grouped_mm takes [E, in, out]: the transposed view, no copy.
        h = F.silu(m_grouped_mm(x, w1.mT, sizes, backend=self.backend))
        h = h * m_grouped_mm(x, w3.mT, sizes, backend=self.backend)
        return m_grouped_mm(h, w2.mT, sizes, backend=self.backend)

    def init_weights(self, init_std: float = 0.02) -> None:
        """torchtitan's: truncated normal, w1 std 0.02, w2 and w3 ``init_std``."""
        w1, w2, w3 = self.weights()
        nn.init.trunc_normal_(w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(w3, mean=0.0, std=init_std)

    def extra_repr(self) -> str:
        w1 = self.weights()[0]
        E, hidden, dim = w1.shape
        return f"num_experts={E}, hidden_dim={hidden}, dim={dim}, names={self._names}"


def _torchtitan_names(module: nn.Module) -> tuple[str, str, str] | None:
    params = dict(module.named_parameters(recurse=False))
    for names in TORCHTITAN_NAMES:
        if all(name in params for name in names):
            return names
    return None


def from_torchtitan(module: nn.Module, *, backend: Backend = "auto") -> GroupedExperts:
    """A moegemm ``GroupedExperts`` holding ``module``'s own Parameter objects (no copy: optimizer state,
    FSDP/DTensor sharding and checkpoints keep working under the same names). ``module`` is a torchtitan
    ``GroupedExperts`` (either naming, ``TORCHTITAN_NAMES``)."""
    names = _torchtitan_names(module)
    if names is None:
        raise TypeError(
            f"from_torchtitan: {type(module).__name__} has none of the weight sets {TORCHTITAN_NAMES}; "
            "is it torchtitan's GroupedExperts?"
        )
    w1, w2, w3 = (getattr(module, name) for name in names)
    E, hidden, dim = w1.shape
    if tuple(w2.shape) != (E, dim, hidden) or tuple(w3.shape) != (E, hidden, dim):
        raise ValueError(
            f"from_torchtitan: want w1, w3 [E, hidden, dim] and w2 [E, dim, hidden]; got {tuple(w1.shape)}, "
            f"{tuple(w2.shape)}, {tuple(w3.shape)}"
        )
    new = GroupedExperts(
        dim, hidden, E, getattr(module, "use_grouped_mm", True), names=names, device="meta", backend=backend
    )
    for name, param in zip(names, (w1, w2, w3), strict=True):
        setattr(new, name, param)  # the same Parameter object
    new.train(module.training)
    return new


def swap_grouped_experts(model: nn.Module, *, backend: Backend = "auto") -> nn.Module:
    """Replaces, in place, every submodule whose class is named ``GroupedExperts`` (torchtitan's; matched by
    name so that torchtitan need not be importable) with ``from_torchtitan(it)``. Returns ``model`` (or the
    new module when ``model`` itself is one). Raises if none is found: a silent no-op would hide a typo."""
    if _is_torchtitan_experts(model):
        return from_torchtitan(model, backend=backend)
    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if _is_torchtitan_experts(child):
                setattr(parent, child_name, from_torchtitan(child, backend=backend))
                swapped += 1
    if not swapped:
        raise ValueError(f"swap_grouped_experts: no torchtitan GroupedExperts in {type(model).__name__}")
    return model


def _is_torchtitan_experts(module: nn.Module) -> bool:
    return type(module).__name__ == "GroupedExperts" and not isinstance(module, GroupedExperts)


def _is_silu(act_fn) -> bool:
    return act_fn is F.silu or type(act_fn).__name__ in ("SiLU", "SiLUActivation")


def transformers_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """transformers' experts forward (the ``ExpertsInterface`` signature) on ``moe_experts``:
    hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k] -> [T, d] in hidden_states' dtype.

    Serves gated SiLU experts with concatenated, untransposed, bias-free weights (Qwen2/3-MoE, Mixtral,
    DeepSeek, ...); any other experts class raises naming what it lacks. Expert-parallel sentinel ids (>= E,
    weight 0) are clamped by moe_experts and contribute 0. The compute runs in the weights' dtype
    (hidden_states is cast, as transformers' grouped_mm does under autocast).
    """
    unsupported = [
        flag
        for flag, bad in (
            ("has_gate=False", not getattr(self, "has_gate", True)),
            ("has_bias=True", getattr(self, "has_bias", False)),
            ("is_transposed=True", getattr(self, "is_transposed", False)),
            ("is_concatenated=False (interleaved gate/up)", not getattr(self, "is_concatenated", True)),
            (f"act_fn={type(getattr(self, 'act_fn', None)).__name__} (not SiLU)", not _is_silu(self.act_fn)),
            ("a custom _apply_gate", type(self)._apply_gate.__name__ != "_default_apply_gate"),
        )
        if bad
    ]
    if unsupported:
        raise NotImplementedError(
            f"moegemm experts implementation: {type(self).__name__} has {', '.join(unsupported)}; "
            "moegemm runs SwiGLU experts with gate_up_proj [E, 2n, d] (gate rows then up rows) and "
            "down_proj [E, d, n]"
        )
    w13, w2 = self.gate_up_proj, self.down_proj
    out = moe_experts(hidden_states.to(w13.dtype), top_k_index, top_k_weights, w13, w2, backend=backend)
    return out.to(hidden_states.dtype)


def register_transformers(name: str = "moegemm", *, backend: Backend = "auto") -> str:
    """Registers ``transformers_experts_forward`` (with ``backend``) in transformers' ``ExpertsInterface`` as
    ``name`` and returns ``name``: pass it as ``experts_implementation=`` to ``from_config`` or
    ``from_pretrained``, or to ``model.set_experts_implementation``. Needs transformers >= 5 (else raises
    ImportError naming it)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError(
            "register_transformers needs transformers >= 5 (transformers.integrations.moe.ExpertsInterface)"
        ) from e
    forward = functools.partial(transformers_experts_forward, backend=backend)
    ExpertsInterface.register(name, forward)
    return name
