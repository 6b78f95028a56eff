"""Interpreter executor: runs a ``KernelCall`` through the Triton interpreter inside ``jax.pure_callback``.

For tests on CPU. The callback turns the numpy arrays into torch CPU tensors and launches the same
``@triton.jit`` kernel with the same positional arguments and meta as the GPU path. Outputs start
as NaN so unwritten elements show up, except an output aliased to an input (``input_output_aliases``),
which starts as that input, as in XLA. Needs TRITON_INTERPRET=1 set before triton is imported.
"""

from __future__ import annotations

import collections
import threading

import jax
import numpy as np
import triton

from moegemm._src.jax.launch import INTERPRET, Executor, KernelCall

# Launches per kernel name, so tests can prove they went through the interpreter.
CALLS: collections.Counter[str] = collections.Counter()
# The interpreter patches triton.language globally while a kernel runs: callbacks of several devices (shard_map
# over XLA host devices) run on several threads and must take turns.
_LOCK = threading.Lock()


def available() -> str | None:
    """None when the interpreter path can run, else the reason it cannot."""
    if not bool(triton.knobs.runtime.interpret):
        return "TRITON_INTERPRET=1 must be set before triton is first imported"
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"the interpreter path launches on torch CPU tensors, and torch is not importable ({e})"
    return None


# numpy (ml_dtypes) types torch reads through their bits: (same-width integer view, torch dtype name).
_BIT_VIEWS = {
    "bfloat16": (np.int16, "bfloat16"),
    "float8_e4m3fn": (np.uint8, "float8_e4m3fn"),
    "float8_e5m2": (np.uint8, "float8_e5m2"),
}


def _to_torch(array: np.ndarray):
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype.name in _BIT_VIEWS:
        int_type, name = _BIT_VIEWS[array.dtype.name]
        return torch.from_numpy(array.view(int_type).copy()).view(getattr(torch, name))
    return torch.from_numpy(array.copy())


def _to_numpy(tensor, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.name in _BIT_VIEWS:
        int_type, _ = _BIT_VIEWS[dtype.name]
        view = {np.int16: "int16", np.uint8: "uint8"}[int_type]
        import torch

        return tensor.view(getattr(torch, view)).numpy().view(dtype)
    return tensor.numpy()


def _poisoned(shape, dtype):
    """A fresh output: NaN for floats, all ones bits for integers, so unwritten elements show up."""
    import torch

    name = np.dtype(dtype).name
    if name in ("uint8", "int8", "int16", "int32", "int64"):
        return torch.full(shape, -1 if name != "uint8" else 255, dtype=getattr(torch, name))
    return torch.full(shape, float("nan"), dtype=getattr(torch, name))


def run(call: KernelCall):
    array_slots = [i for i, arg in enumerate(call.args) if isinstance(arg, jax.Array)]
    single = not isinstance(call.out_shape, tuple)
    out_shapes = (call.out_shape,) if single else call.out_shape

    def callback(*arrays):
        import torch

        args = list(call.args)
        for slot, array in zip(array_slots, arrays):
            args[slot] = _to_torch(np.asarray(array))
        outs = []
        for index, shape in enumerate(out_shapes):
            aliased = [i for i, o in call.input_output_aliases.items() if o == index]
            if aliased:  # as XLA does: the output buffer starts as the aliased input
                outs.append(args[aliased[0]].clone())
            elif index in call.zeroed_outputs:
                outs.append(torch.zeros(shape.shape, dtype=getattr(torch, np.dtype(shape.dtype).name)))
            else:
                outs.append(_poisoned(shape.shape, shape.dtype))
        with _LOCK:
            CALLS[call.kernel.fn.__name__] += 1
            call.kernel[call.grid](*args, *outs, **call.meta)
        results = tuple(_to_numpy(out, shape.dtype) for out, shape in zip(outs, out_shapes))
        return results[0] if single else results

    return jax.pure_callback(callback, call.out_shape, *(call.args[i] for i in array_slots))


EXECUTOR = Executor("interpret", available, lambda: INTERPRET, run)
