"""Argument handling shared by the PyTorch entry points: backend choice, group_sizes placement, checks.

Backends: ``"triton"`` runs the Triton kernels (compiled for CUDA tensors; under the interpreter for
CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was imported); ``"reference"`` runs the
plain PyTorch twin; ``"auto"`` picks triton for CUDA tensors and for CPU tensors under the
interpreter, reference otherwise. An explicit choice that cannot be served raises.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import Literal

import torch

from moegemm._src import plan
from moegemm._src.torch import launch as _launch

Backend = Literal["auto", "triton", "reference"]
GroupSizes = torch.Tensor | Sequence[int]
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that serves ``backend`` for tensors on ``device`` (raises if none can)."""
    return _resolve_backend(backend, device.type)


@functools.cache  # _launch.INTERPRET is fixed when triton is imported, so the answer never changes
def _resolve_backend(backend: str, device_type: str) -> str:
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "auto":
        return "triton" if device_type == "cuda" or _launch.INTERPRET else "reference"
    if backend == "triton" and device_type != "cuda" and not _launch.INTERPRET:
        raise ValueError(
            f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported; "
            f"got tensors on {device_type}"
        )
    return backend


def as_group_sizes(group_sizes: GroupSizes, G: int | None, device: torch.device) -> torch.Tensor:
    """group_sizes as a 1-D int32/int64 tensor on ``device``, without a host sync.

    Host values (a list or a CPU tensor, pinned or not) are first copied on the host into a pinned
    buffer the library owns, and that buffer is sent with an async copy. The caller may overwrite its
    own tensor as soon as the call returns: the kernels never read it. (Copying the caller's pinned
    tensor directly with non_blocking=True let a later write race the copy behind a busy stream.)
    PyTorch's pinned-memory allocator keeps the staging buffer alive until the copy has run.
    """
    staged = False
    if not isinstance(group_sizes, torch.Tensor):
        values = list(group_sizes)
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
            raise TypeError(f"group_sizes must hold integers, got {values[:8]}")
        group_sizes = torch.tensor(values, dtype=torch.int32, pin_memory=device.type == "cuda")
        staged = True
    if group_sizes.dtype not in INDEX_DTYPES:
        raise TypeError(f"group_sizes must be int32 or int64, got {group_sizes.dtype}")
    if group_sizes.dim() != 1:
        raise ValueError(f"group_sizes must be 1-D [G], got shape {tuple(group_sizes.shape)}")
    count = group_sizes.shape[0]
    if G is not None and isinstance(count, int) and count != G:
        raise ValueError(f"group_sizes has {count} entries but the weight has G={G} groups")
    if G is not None and not isinstance(count, int):
        # A data-dependent length under torch.compile (e.g. from bincount): a runtime assertion, since
        # an `if` on it cannot be traced.
        torch._check_value(count == G, lambda: f"group_sizes must have one entry per group, G={G}")
    if group_sizes.device != device:
        if device.type == "cuda" and group_sizes.device.type == "cpu":
            if not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
                raise ValueError(
                    "group_sizes must be a CUDA tensor under CUDA graph capture: a list or CPU tensor would "
                    "be frozen into the graph, and every replay would reuse this call's sizes"
                )
            if not staged:
                group_sizes = _stage_pinned(group_sizes)
        group_sizes = group_sizes.to(device, non_blocking=True)
    return group_sizes if group_sizes.is_contiguous() else group_sizes.contiguous()


def _stage_pinned(host: torch.Tensor) -> torch.Tensor:
    """A pinned copy of a host tensor that only the library holds (see as_group_sizes)."""
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    return staged.copy_(host)


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")


def check_same(names: str, *tensors: torch.Tensor) -> None:
    if len({t.dtype for t in tensors}) > 1:
        raise TypeError(f"{names} must share a dtype, got {[t.dtype for t in tensors]}")
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"{names} must be on one device, got {[str(t.device) for t in tensors]}")


# The default of ``check``: MOEGEMM_CHECK=1 in the environment when moegemm is imported (read once by
# moegemm._src.plan.SWITCHES, with the other switches).
CHECK_BY_DEFAULT = plan.SWITCHES.check


def check_out_buffer(op: str, out: torch.Tensor, **inputs: torch.Tensor | None) -> None:
    """Refuses an ``out=`` buffer whose elements alias each other or may share memory with an input:
    the kernels read the inputs while they write ``out``, so either would be silently wrong."""
    if torch.compiler.is_compiling():  # fake tensors have no memory to compare
        return
    if torch._debug_has_internal_overlap(out) == 1:
        raise ValueError(
            f"{op}: out= has elements that share memory (shape {tuple(out.shape)}, strides {out.stride()}, "
            f"e.g. an expanded tensor); pass a buffer where every element is distinct"
        )
    for name, t in inputs.items():
        if t is not None and torch._C._overlaps(out, t):
            raise ValueError(
                f"{op}: out= may share memory with {name} (shape {tuple(t.shape)}); the kernel reads {name} "
                f"while it writes out, so pass a separate buffer"
            )


def checks_enabled(check: bool | None) -> bool:
    return check if check is not None else CHECK_BY_DEFAULT


def check_group_sizes_values(group_sizes: torch.Tensor, M: int) -> None:
    """The syncing check: every size >= 0 and sum <= M. Raises ValueError with the values."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("check=True syncs the host and cannot run inside CUDA graph capture")
    sizes = group_sizes.tolist()
    negative = [(g, s) for g, s in enumerate(sizes) if s < 0]
    if negative:
        raise ValueError(f"group_sizes has negative entries (group, size): {negative[:8]}")
    if sum(sizes) > M:
        raise ValueError(f"sum(group_sizes) = {sum(sizes)} exceeds the {M} rows of the input; sizes={sizes}")
