"""JAX front end: grouped GEMMs with custom_vjp, a ``jax.lax.ragged_dot`` drop-in, FP8 through the same ops.

One public op per GEMM shape, each taking high-precision arrays or quantized ones (``Fp8Array`` from
``quantize_fp8``): ``m_grouped_mm`` (forward, dgrad), ``k_grouped_mm`` (wgrad), ``ragged_dot``
(``fp8_recipe=`` trains in FP8). The Triton kernels in ``moegemm._src.kernels`` run on the GPU as XLA custom calls
of jaxlib's Triton launcher; see ``moegemm.jax.api`` for the backends. The jax.numpy twins (``*_reference``) are the
oracle and CPU fallback. Sharded operands: ``moegemm.jax.sharding``; Flax modules:
``moegemm.jax.flax`` (imported on demand: flax is optional). The fused expert block: ``moe_experts``
(``moegemm.jax.moe``), its Flax module ``moegemm.jax.moe_layer.MoE``.
"""

from moegemm.jax.api import (
    Backend,
    Fp8Array,
    k_grouped_mm,
    m_grouped_mm,
    quantize_fp8,
    ragged_dot,
    resolve_backend,
)
from moegemm.jax.moe import moe_experts
from moegemm.jax.reference import (
    k_grouped_mm_reference,
    m_grouped_mm_reference,
    moe_experts_reference,
    ragged_dot_reference,
)

__all__ = [
    "Backend",
    "Fp8Array",
    "k_grouped_mm",
    "k_grouped_mm_reference",
    "m_grouped_mm",
    "m_grouped_mm_reference",
    "moe_experts",
    "moe_experts_reference",
    "quantize_fp8",
    "ragged_dot",
    "ragged_dot_reference",
    "resolve_backend",
]
