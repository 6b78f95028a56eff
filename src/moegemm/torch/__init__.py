"""PyTorch front end: the grouped GEMM ops (high precision or FP8), their reference twins, and GroupedLinear.

m_grouped_mm(x, w, group_sizes)     for g: out[rows(g)] = x[rows(g)] @ w[g]        (fprop, dgrad)
k_grouped_mm(a, b, group_sizes)     for g: out[g] = a[rows(g)]^T @ b[rows(g)]      (wgrad)
GroupedLinear(G, K, N)              G nn.Linear experts over contiguous row groups (fp8_recipe=...)
quantize_fp8(x, recipe, ...)        an Fp8Tensor, which the ops and the twins take in place of a tensor
moe_experts(x, ids, weights, w13, w2)  the routed expert block: gather, fc1 + SwiGLU, fc2, weighted combine
                                    (fp8_recipe=...; Fp8WeightCache keeps the weights' FP8 copies)
MoE(dim, hidden_dim, E, top_k)      router (+ shared experts) + moe_experts
TokenDispatcher(ep_group, E_local)  expert parallelism: dispatch (all_gather) / combine (reduce_scatter)
"""

from moegemm._src.torch.ep import TokenDispatcher, TorchtitanTokenDispatcher
from moegemm._src.torch.fp8_tensor import Fp8Tensor
from moegemm.torch.api import k_grouped_mm, m_grouped_mm, quantize_fp8
from moegemm.torch.grouped_linear import Fp8WeightCache, GroupedLinear
from moegemm.torch.moe import moe_experts
from moegemm.torch.moe_layer import MoE, Router
from moegemm.torch.reference import k_grouped_mm_reference, m_grouped_mm_reference, moe_experts_reference

__all__ = [
    "Fp8Tensor",
    "Fp8WeightCache",
    "GroupedLinear",
    "MoE",
    "Router",
    "TokenDispatcher",
    "TorchtitanTokenDispatcher",
    "k_grouped_mm",
    "k_grouped_mm_reference",
    "m_grouped_mm",
    "m_grouped_mm_reference",
    "moe_experts",
    "moe_experts_reference",
    "quantize_fp8",
]
