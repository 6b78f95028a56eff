"""JAX front end: a ``jax.lax.ragged_dot`` drop-in, grouped GEMMs with custom_vjp, and a Flax hook.

The Triton kernels in ``moegemm._src.kernels`` run on the GPU through jax-triton; see ``moegemm.jax.api``
for the backends. Flax modules live in ``moegemm.jax.flax`` (imported on demand: flax is optional).
"""

from moegemm.jax.api import k_grouped_mm, m_grouped_mm, ragged_dot, resolve_backend
from moegemm.jax.reference import k_grouped_mm_reference, m_grouped_mm_reference, ragged_dot_reference

__all__ = [
    "k_grouped_mm",
    "m_grouped_mm",
    "ragged_dot",
    "resolve_backend",
    "k_grouped_mm_reference",
    "m_grouped_mm_reference",
    "ragged_dot_reference",
]
