"""GPU executor: runs a ``KernelCall`` through jax-triton's ``triton_call`` (an XLA custom call).

jax-triton is imported lazily: it cannot be imported with a CPU-only jaxlib.
"""

from __future__ import annotations

import functools

from moegemm.jax._launch import KernelCall


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
        import jax_triton  # noqa: F401
    except ImportError as e:
        return f"jax-triton is not importable ({e}); pip install jax-triton"
    return None


def run(call: KernelCall):
    import jax_triton

    return jax_triton.triton_call(
        *call.args,
        kernel=call.kernel,
        out_shape=call.out_shape,
        grid=call.grid,
        input_output_aliases=call.input_output_aliases or None,
        **call.meta,
    )
