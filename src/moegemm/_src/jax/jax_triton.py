"""GPU executor: runs a ``KernelCall`` through jax-triton's ``triton_call`` (an XLA custom call).

jax-triton is imported lazily: it cannot be imported with a CPU-only jaxlib.
"""

from __future__ import annotations

import functools
import os

from moegemm._src.jax.launch import Executor, KernelCall, gpu_target


def _import_jax_triton():
    """Imports jax_triton without letting it disable Triton's on-disk cache for the whole process.

    jax-triton 0.3.1 sets ``os.environ["TRITON_CACHE_DIR"] = ""`` at import (jax_triton/triton_lib.py,
    line 68); every later Triton launch from PyTorch in the same process then fails with
    "Could not create or locate cache dir". Restore the variable as it was.
    """
    before = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if before is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = before
    return jax_triton


@functools.cache
def available() -> str | None:
    """None when the GPU path can run, else the reason it cannot."""
    import jax
    import triton

    if bool(triton.knobs.runtime.interpret):
        return "TRITON_INTERPRET=1 is set, so the kernels are interpreter objects jax-triton cannot compile"
    if not any(d.platform == "gpu" for d in jax.devices()):
        return f"JAX has no GPU device (default backend: {jax.default_backend()})"
    try:
        _import_jax_triton()
    except ImportError as e:
        return f"jax-triton is not importable ({e}); pip install jax-triton"
    return None


def run(call: KernelCall):
    return _import_jax_triton().triton_call(
        *call.args,
        kernel=call.kernel,
        out_shape=call.out_shape,
        grid=call.grid,
        input_output_aliases=call.input_output_aliases or None,
        zeroed_outputs=call.zeroed_outputs,
        **call.meta,
    )


EXECUTOR = Executor("triton", available, gpu_target, run)
