"""FP8 recipes and their scale layouts, framework-free (the launchers and both front ends share them).

A quantized tensor is ``data`` (float8) and ``scale`` (float32), with ``x ~= data * scale`` (the
dequantization factor, as ``torch._scaled_mm`` and DeepGEMM take it), and optionally a transposed
copy ``data_t`` with its own ``scale_t`` for the GEMM that contracts over the other dimension.
``scale = amax / FP8_MAX`` over the scaling block (current scaling); a block of zeros gets scale 1;
``data = cast(clamp(x * inv))`` with ``inv = min(1 / scale, FLT_MAX)`` rounded once per block (a multiply an
element, where dividing by the scale cost a division: docs/design.md, 'Quantize').

Activations x [M, K], rows split into G groups by ``group_sizes`` (G = 1 without them); rows past
sum(group_sizes) quantize to 0. ``data`` [M, K] feeds fprop/dgrad. ``data_t`` [K, M_t] feeds the
wgrad: group g's rows are its columns [t_g, t_g + rows_g), where t_g = 16 * sum_{h<g} cdiv(rows_h, 16),
so each group starts 16-byte aligned (the wgrad's loads run along tokens), and the columns up to the
next multiple of 16 after a group are 0 (the wgrad reads them: 16-wide loads); M_t = transposed_columns(M, G).
Rows past the last group have no columns in data_t.

==========  =========================  ==============================================================
recipe      scale                      scale_t
==========  =========================  ==============================================================
tensorwise  [G] one per group          the same tensor
rowwise     [M] one per row            [G, K] one per (group, column): the wgrad's per-output scale
blockwise   [M, cdiv(K,128)] 1x128     [cdiv(M,128) + G, K] 128x1 blocks that start at each group's
            (M-major storage)          first row; group g's blocks follow those of groups < g
==========  =========================  ==============================================================

Weights w [G, N, K] (nn.Linear layout; the experts are the groups). ``data_t`` is [G, K, N] for dgrad.

==========  =========================  ==============================================================
tensorwise  [G]                        the same tensor
rowwise     [G, N]                     [G, K]
blockwise   [G, cdiv(N,128), cdiv(K,128)] 128x128 blocks   ``scale.transpose(1, 2)``
==========  =========================  ==============================================================
"""

from __future__ import annotations

from typing import Literal

Recipe = Literal["tensorwise", "rowwise", "blockwise"]
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "blockwise")
SCALE_BLOCK = 128  # the DeepSeek-V3 block: 1x128 activation tiles, 128x128 weight blocks
# Largest finite value of each format (float8_e4m3fn has no inf; its 0x7f/0xff are NaN).
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
# Rows of fp8 data are padded to this many bytes in storage so every row starts 16-byte aligned
# (vectorized loads); the padding is never read.
ROW_ALIGN = 16


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe must be one of {RECIPES}, got {recipe!r}")
    return recipe


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded(n: int) -> int:
    """n rounded up to ROW_ALIGN (the row stride of fp8 storage)."""
    return cdiv(max(n, 1), ROW_ALIGN) * ROW_ALIGN


def activation_scale_shapes(recipe: str, M: int, K: int, G: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(scale shape, scale_t shape) of activations [M, K] in G groups (see the table above)."""
    if recipe == "tensorwise":
        return (G,), (G,)
    if recipe == "rowwise":
        return (M,), (G, K)
    return (M, cdiv(K, SCALE_BLOCK)), (cdiv(M, SCALE_BLOCK) + G, K)


def weight_scale_shapes(recipe: str, G: int, N: int, K: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(scale shape, scale_t shape) of a weight [G, N, K] (see the table above)."""
    if recipe == "tensorwise":
        return (G,), (G,)
    if recipe == "rowwise":
        return (G, N), (G, K)
    nb, kb = cdiv(N, SCALE_BLOCK), cdiv(K, SCALE_BLOCK)
    return (G, nb, kb), (G, kb, nb)


def config_op(op: str, recipe: str, fast_accum: bool) -> str:
    """The config table of an FP8 GEMM launch: fast accumulation (tensorwise/rowwise) has its own tiles."""
    return f"{op}_fast" if fast_accum and recipe != "blockwise" else op


def config_dtype(recipe: str, dtype_name: str, fast_accum: bool) -> str:
    """The dtype part of a tuned-cache key. With fast accumulation, tensorwise and rowwise run the
    same main loop (their scales differ only in the epilogue), so they share tuned configs."""
    return dtype_name if fast_accum and recipe != "blockwise" else f"{recipe}-{dtype_name}"


def transposed_columns(M: int, G: int) -> int:
    """Columns of an activation's data_t storage: room for every group starting 16-aligned."""
    return padded(M + (ROW_ALIGN - 1) * G)
