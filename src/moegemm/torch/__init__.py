"""PyTorch front end: custom ops with fake impls and autograd, and the GroupedLinear module."""

from moegemm.torch.api import k_grouped_mm, m_grouped_mm
from moegemm.torch.grouped_linear import GroupedLinear
from moegemm.torch.reference import k_grouped_mm_reference, m_grouped_mm_reference

__all__ = [
    "GroupedLinear",
    "k_grouped_mm",
    "m_grouped_mm",
    "k_grouped_mm_reference",
    "m_grouped_mm_reference",
]
