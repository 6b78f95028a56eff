"""Tile configurations, kept as data. The launch planner (``moegemm._src.plan``) is the only caller of the
``pick_*`` functions; the schedule modes and their gates live there.

``TABLE`` maps (op, target) to an ordered list of (config, why). The first entry is the default;
the rest are the autotune candidates. Tuned choices per shape bucket live in the committed cache
``tuned_configs/<device>.json`` (written by ``python -m moegemm.bench --tune``) and win over the default.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class MGroupedConfig:
    """Output tile BLOCK_M x BLOCK_N, reduction step BLOCK_K, GROUP_M row tiles per swizzle band."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    ctas_per_sm: int = 1  # persistent programs per SM; 2 lets one CTA's epilogue overlap the other's loads


@dataclasses.dataclass(frozen=True)
class KGroupedConfig:
    """Output tile BLOCK_K x BLOCK_N of out[g], reduction over tokens in steps of BLOCK_R."""

    block_k: int
    block_n: int
    block_r: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    ctas_per_sm: int = 1
    # One flat loop over all reduction steps of a program's tiles instead of a loop per tile: the next
    # tile's loads overlap this tile's store, which pays on short reductions (few rows per expert) and
    # costs per-step overhead on long ones (k_grouped_mm_kernel's FLAT; docs/design.md, 'k-grouped kernel').
    # Used for 2-byte outputs only (KGroupedLaunch.make: out_itemsize).
    flat: bool = False
    # With flat: read a and b through TMA descriptors the kernel makes per group (PyTorch on sm90, 2-byte
    # row-major operands with 16-byte aligned rows; other launches load through cp.async). Fewer
    # instructions per step, a descriptor pair per change of group (docs/design.md, 'TMA loads').
    tma_load: bool = False


@dataclasses.dataclass(frozen=True)
class Fp8WsConfig:
    """The warp-specialized FP8 kernels (``kernels/m_grouped_fp8_ws.py``, ``kernels/k_grouped_fp8_ws.py``;
    promoted mode, sm90): a 128 x block_n output tile (two consumer warpgroups of 64 rows; 256 runs as
    two 128-column halves), num_stages ring slots of 128-wide reduction steps, group_m row tiles per
    swizzle band, consumer_regs registers per consumer thread (setmaxnreg; the loader warpgroup gets
    the rest of 168 x 12 warps)."""

    block_n: int = 256
    num_stages: int = 4
    group_m: int = 8
    consumer_regs: int = 216


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """The warp-specialized BF16/FP16 wgrad (``kernels/k_grouped_ws.py``, sm90): a 128 x block_n output
    tile (two consumer warpgroups of 64 rows), block_k rows a reduction step in a ring of num_stages
    slots, group_m tiles per swizzle band, consumer_regs registers per consumer thread (setmaxnreg; the
    loader warpgroup gets the rest of 168 x 12 warps), tma: the loader's copies."""

    block_n: int = 256
    block_k: int = 64
    num_stages: int = 4
    group_m: int = 8
    consumer_regs: int = 232
    tma: bool = True  # the TMA loader where it applies (PyTorch, groups back to back), else cp.async


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """FP8 quantize launches. Tile kernels (``quantize_fp8.tiles_geometry``): a data tile is q_rows x
    128 (one 1x128 scale block wide), a transposed-copy tile 128 x t_cols (one group-aligned 128x1 block
    tall), a weight's 128x128 block is its own tile; a program takes up to q_chunks (t_chunks) column
    tiles of one row tile, fewer where that leaves under 16 programs per SM; num_stages is the
    column loop's tl.range stages.
    The one-read pair kernel: pair_warps, pair_stages, pair_chunks (below).
    Rowwise data: rows up to one_sweep_cols wide held whole (quantize_fp8.rows_geometry), wider ones in
    sweeps of rows per program and columns per step; the transposed copy: columns per program and rows per
    step; sweep_stages the same for the sweeps. With C and the strides 16-divisible
    (every real launch) Triton 3.6 pipelines these loops with cp.async (docs/design.md, 'Quantize')."""

    q_rows: int = 32
    t_cols: int = 32
    q_chunks: int = 4
    t_chunks: int = 8
    num_warps: int = 4
    num_stages: int = 3
    t_warps: int = 4  # the transposed-copy launch's
    sweep_rows: int = 8
    sweep_cols: int = 512
    # Rowwise data of rows up to one_sweep_cols wide: held whole, one_sweep_elems elements a program
    # (quantize_fp8.rows_geometry).
    one_sweep_cols: int = 16384
    one_sweep_elems: int = 8192
    col_block: int = 64
    col_rows: int = 256
    sweep_stages: int = 1
    # The one-read kernel (quantize_fp8.fp8_quantize_pair_kernel): warps holding a 128 x 128 tile (8 or 16),
    # tiles in its cp.async ring, 128-column tiles per program (quantize_fp8.pair_geometry).
    pair_warps: int = 16
    pair_stages: int = 2
    pair_chunks: int = 8
    # A transposed-copy launch that reads its rows through a row index (the FP8 expert block's wgrad operands):
    # t_cols, t_warps, t_chunks and num_stages for it. H100, DeepSeek-V3 EP8's R = 65536 rows of 7168 (ms, t_cols x
    # warps 32x4 / 64x4 / 128x4 / 32x8 / 64x8 / 128x8, 8 chunks, 3 stages): tensorwise from FP8 bytes 0.602 /
    # 0.548 / 0.539 / 0.666 / 0.582 / 0.544, blockwise from bf16 0.866 / 0.818 / 0.901 / 1.158 / 1.062 / 1.307
    # (2026-11-27, journal 42). Without the cp.async pipeline of the gathered loads (1 stage) the same launches ran
    # 1.3-2.0x faster; 64 x 4, chunks 4 / 8 / 16: DeepSeek-V3 EP8 bytes 0.285 / 0.268 / 0.268, blockwise 0.634 /
    # 0.608 / 0.623; Qwen3-30B-A3B (262144 rows of 2048) bytes 0.368 / 0.420 / 0.483, blockwise 0.829 / 0.781 /
    # 0.772 (2026-11-27, journal 43).
    gather_t_cols: int = 64
    gather_t_warps: int = 4
    gather_t_chunks: int = 4
    gather_stages: int = 1
    # The rowwise transposed-copy launch (col_block columns a program, col_rows rows a step): H100, the FP8
    # block's gathered x and expert-order dz (2026-11-27, journal 43; ms, DeepSeek-V3 EP8 skewed / Qwen3-30B-A3B
    # skewed): 32 x 64, 4 warps (before) 1.057, 0.640 / 1.299, 1.030; 64 x 128, 4 warps 0.894, 0.541 / 1.055,
    # 0.845; 64 x 256, 8 warps 0.885, 0.543 / 1.034, 0.803; 2 cp.async stages 2.4-2.6x slower. Groups averaging
    # under quantize_fp8.COL_LONG_MIN_ROWS rows keep col_short (columns, rows a step, warps), the earlier tile.
    col_warps: int = 8
    col_short: tuple[int, int, int] = (32, 64, 4)


M, K = MGroupedConfig, KGroupedConfig
TABLE: dict[tuple[str, str], list[tuple[object, str]]] = {
    ("m_grouped", "interpret"): [
        (M(32, 32, 32, 4, 4, 1), "interpreter: small tiles keep numpy work per step low"),
    ],
    ("k_grouped", "interpret"): [
        (K(32, 32, 32, 4, 4, 1), "interpreter: small tiles keep numpy work per step low"),
    ],
    ("m_grouped", "sm90"): [
        (M(128, 256, 64, 8, 8, 3), "anchor: 697 TF/s dense; room for the TMA store's staging tile"),
        (M(128, 128, 64, 8, 4, 4), "fewer padded columns; 657 TF/s dense"),
        (
            M(128, 128, 64, 8, 4, 3, 2),
            "2 CTAs/SM (96 KB smem each): one's epilogue hides under the other's loop",
        ),
        (M(128, 128, 64, 8, 8, 3, 2), "as above with 8 warps: more loads in flight"),
        (M(64, 256, 64, 8, 4, 4), "many-expert shapes: ~128 rows/group wastes less of a 64-row tile"),
        (M(64, 256, 64, 8, 4, 3, 2), "64-row tiles, 2 CTAs/SM"),
        (M(128, 256, 64, 16, 8, 3), "wider swizzle band for weight reuse"),
        (M(64, 128, 64, 8, 4, 4, 2), "small groups, fine-grained experts: more tiles to fill 132 SMs"),
        (M(128, 256, 64, 8, 8, 4), "4 stages, TMA loads (192 KB: no TMA store): short-K forwards"),
    ],
    ("k_grouped", "sm90"): [
        (K(128, 256, 64, 8, 8, 3), "large K x N per expert"),
        (K(128, 128, 64, 8, 4, 4), "more tiles when G x tiles is below the SM count"),
        (K(128, 128, 64, 8, 4, 3, 2), "2 CTAs/SM: store of one tile overlaps the loads of another"),
        (K(128, 128, 64, 8, 8, 3, 2), "as above with 8 warps"),
        (K(128, 128, 128, 8, 8, 3), "deeper reduction step, fewer loop iterations"),
        (K(64, 128, 64, 8, 4, 4, 2), "small experts, 2 CTAs/SM"),
        (K(128, 128, 32, 8, 4, 4, 2), "~128 tokens/expert: shorter reduction steps, deeper pipeline"),
        (K(64, 128, 64, 8, 4, 3, 3), "3 CTAs/SM: more output tiles in flight on many-expert shapes"),
        (K(128, 64, 64, 8, 4, 3, 3), "narrow N tile, 3 CTAs/SM"),
        (K(128, 128, 64, 8, 4, 3, 2, flat=True), "flat loop, 2 CTAs/SM: ~128-512 rows per expert"),
        (K(128, 128, 32, 8, 4, 4, 2, flat=True), "flat loop, short steps: ~128 rows per expert"),
        (
            K(128, 256, 64, 8, 8, 3, flat=True),
            "flat 128 x 256: fits its TMA-store staging tile since the store keeps the wgmma layout",
        ),
        (K(128, 256, 64, 8, 8, 3, flat=True, tma_load=True), "as above, TMA loads: long groups"),
    ],
    # The expert block's launches with a gathered operand or the SwiGLU backward epilogue (docs/design.md,
    # 'Fused expert block'), measured on the H100 over every m_grouped / k_grouped candidate at sonic-1024 (T 32768,
    # d 4096, n 1024, E 64, k 4) and Qwen3-30B-A3B: the forward's gather + SwiGLU keeps the ordinary pick.
    ("m_grouped_swiglu_bwd", "sm90"): [
        (M(128, 128, 64, 8, 8, 4), "4 stages: 2.63 / 2.59 ms vs 3.09 / 2.95 for the 128-wide pick, 3 stages"),
    ],
    ("k_grouped_gather", "sm90"): [
        (K(128, 256, 64, 8, 8, 3), "nested loop: the flat one took 2.35-5.8 ms where this takes 1.7-4.7"),
    ],
    # FP8: BLOCK_K 128 is one DeepSeek-V3 scale block (blockwise promotes once per step); 1-byte
    # operands fit a 128 x 256 x 128 tile in 3 stages (144 KB of shared memory).
    # "_fast": tensorwise/rowwise with fast accumulation (fast_accum=True: the tensor cores accumulate
    # a whole tile's K, no promotion), which wants other tiles than promoted accumulation does.
    ("m_grouped_fp8", "interpret"): [(M(32, 32, 32, 4, 4, 1), "interpreter: small tiles")],
    ("m_grouped_fp8_fast", "interpret"): [(M(32, 32, 32, 4, 4, 1), "interpreter: small tiles")],
    ("k_grouped_fp8", "interpret"): [(K(32, 32, 32, 4, 4, 1), "interpreter: small tiles")],
    ("k_grouped_fp8_fast", "interpret"): [(K(32, 32, 32, 4, 4, 1), "interpreter: small tiles")],
    # Measured on the H100 (docs/design.md, 'FP8 promotion and fast accumulation'): 2 CTAs/SM won by 1.6-1.9x
    # over one 128 x 256 CTA, since a CTA that waits for its wgmma (to promote or scale the partial sum)
    # leaves the tensor cores to the other.
    ("m_grouped_fp8", "sm90"): [
        (M(128, 128, 128, 8, 8, 3, 2), "FP8 anchor: 2 CTAs/SM, one promotes while the other multiplies"),
        (M(64, 128, 128, 8, 4, 4, 2), "many-expert shapes: less waste per group, 2 CTAs/SM"),
        (M(64, 128, 128, 8, 4, 3, 3), "3 CTAs/SM: more wgmma in flight per SM"),
        (M(128, 256, 128, 8, 8, 3), "widest tile, one CTA/SM"),
        (M(128, 128, 128, 8, 4, 4), "one CTA/SM, 4 stages"),
    ],
    ("k_grouped_fp8", "sm90"): [
        (K(128, 128, 128, 8, 8, 3), "FP8 wgrad anchor: one 128-token scale block per step"),
        (K(128, 128, 128, 8, 4, 3, 2), "2 CTAs/SM: best for tensorwise/rowwise wgrad on dsv3"),
        (K(128, 256, 128, 8, 8, 3), "wide N"),
        (K(128, 128, 64, 8, 4, 4, 2), "short groups: half-block steps, deeper pipeline"),
    ],
    # Fast accumulation: nothing waits for a wgmma inside the loop, so one CTA with the widest tile
    # keeps the tensor cores fed (probe, dsv3-ep8-fc1 fwd: 128 x 256 one CTA 1271 TF/s, 128 x 128 two
    # CTAs 943; docs/design.md, 'FP8 promotion and fast accumulation').
    ("m_grouped_fp8_fast", "sm90"): [
        (M(128, 256, 128, 8, 8, 3), "FP8 fast anchor: widest tile, one CTA/SM"),
        (M(128, 128, 128, 8, 8, 3, 2), "2 CTAs/SM: one's epilogue under the other's loop"),
        (M(128, 128, 128, 8, 4, 4, 2), "2 CTAs/SM, 4 warps, deeper pipeline"),
        (M(64, 256, 128, 8, 4, 4, 2), "many-expert shapes: 64-row tiles waste less per group"),
        (M(64, 128, 128, 8, 4, 4, 2), "small groups: more tiles to fill 132 SMs"),
        (M(128, 256, 64, 8, 8, 4), "wide tile, shorter steps, 4 stages"),
        (M(128, 256, 128, 16, 8, 3), "wider swizzle band for weight reuse"),
    ],
    ("k_grouped_fp8_fast", "sm90"): [
        (K(128, 128, 128, 8, 4, 3, 2), "2 CTAs/SM: best tensorwise/rowwise wgrad on dsv3 (probe)"),
        (K(128, 128, 128, 8, 8, 3), "one CTA, 8 warps"),
        (K(128, 256, 128, 8, 8, 3), "wide N"),
        (K(128, 128, 64, 8, 4, 4, 2), "~128 tokens/expert: half-block steps, deeper pipeline"),
    ],
    # Measured on the H100 (docs/design.md, 'Warp-specialized FP8 kernels'), promoted fwd, TF/s 256 vs 128:
    # dsv3-ep8-fc1 blockwise 899 vs 750, mixtral-fc1 756 vs 683, gptoss-120b-fc1 447 vs 415, but
    # qwen3-30b-fc1 (K 2048) 385 vs 410. pick_fp8_ws_config takes the 128-wide tile below K = 2560.
    ("m_grouped_fp8_ws", "sm90"): [
        (Fp8WsConfig(256, 4, 8, 240), "long K: 128 x 256 halves the L2 bytes per FLOP of 128 x 128"),
        (Fp8WsConfig(128, 6, 8, 232), "short K (<= 2048): less epilogue per tile, deeper ring"),
    ],
    # The wgrad (TMA loader, TMA store or reduce-add epilogue), the ring as deep as fits beside two 64 x 128
    # staging tiles (5 or 3 slots with fp32 dW, 6 or 4 with bf16), dsv3-ep8-fc1 tensorwise TF/s 128 vs 256: bf16
    # dW 684 vs 841, fp32 599 vs 664; blockwise at 256 spills 1.8 KB a thread with an fp32 out (505 vs 203 TF/s)
    # and is no faster with a bf16 one (0.93-1.09x). Accumulating, 128 wide reads out's tile ahead into the
    # staging tile: 0.95-1.38x of 256 wide's reduce-add (2026-11-27). docs/design.md, 'The FP8 wgrad'.
    ("k_grouped_fp8_ws", "sm90"): [
        (Fp8WsConfig(128, 6, 8, 240), "128 x 128, TMA loader, TMA-store epilogue under the next tile"),
        (Fp8WsConfig(256, 4, 8, 240), "128 x 256: a quarter fewer operand bytes per FLOP"),
    ],
    # The warp-specialized wgrad (TMA loader, TMA-store epilogue): 4 slots of 64 rows (192 KB) beside one 32 KB
    # staging tile the consumers take turns on; over 3 slots with a staging tile each, +4.5% geomean on all 19
    # wgrad launches; 2 slots ran at 0.63-0.90x torch against 0.92-1.07x for 3
    # (docs/design.md, 'Warp-specialized wgrad').
    ("k_grouped_ws", "sm90"): [
        (WsConfig(256, 64, 4), "128 x 256 x 64, TMA loader and store, 4-deep ring, one shared staging tile"),
    ],
    ("quantize_fp8", "interpret"): [
        (
            QuantizeConfig(32, 32, 8, 8, 4, 1, 4, 8, 32, 32, 16, 1, col_short=(32, 16, 4)),
            "interpreter: small tiles",
        )
    ],
    ("quantize_fp8", "sm90"): [
        (
            QuantizeConfig(),
            "best of 11 + 7 on 5 suite cases x 3 recipes, H100 (docs/design.md, 'Quantize')",
        )
    ],
    ("quantize_fp8", "cuda"): [(QuantizeConfig(), "untuned")],
    ("m_grouped_fp8", "cuda"): [(M(64, 64, 64, 8, 4, 2), "untuned; FP8 tensor cores need sm89+")],
    ("k_grouped_fp8", "cuda"): [(K(64, 64, 64, 8, 4, 2), "untuned; FP8 tensor cores need sm89+")],
    ("m_grouped_fp8_fast", "cuda"): [(M(64, 64, 64, 8, 4, 2), "untuned; FP8 tensor cores need sm89+")],
    ("k_grouped_fp8_fast", "cuda"): [(K(64, 64, 64, 8, 4, 2), "untuned; FP8 tensor cores need sm89+")],
    ("m_grouped", "cuda"): [(M(64, 64, 32, 8, 4, 2), "pre-Hopper fallback, untuned")],
    ("k_grouped", "cuda"): [(K(64, 64, 32, 8, 4, 2), "pre-Hopper fallback, untuned")],
}
del M, K

CACHE_DIR = Path(__file__).parent / "tuned_configs"


def candidates(op: str, target: str, tma: bool = True) -> list:
    """The table's configs for (op, target); without ``tma``, not those measured only through TMA."""
    return [cfg for cfg, _why in TABLE[(op, target)] if tma or cfg not in TMA_ONLY]


# Configs whose measurements (tune records, the fitted model, cache entries) came from launches with the
# TMA store or TMA loads, which only the PyTorch front end's BF16 launches take on sm90 (JAX's plan without
# the scratch: jax/launch.py, _plan): the flat 128 x 256 loop stores through its staging tile there.
# The 4-stage m-grouped 128 x 256 was measured with TMA loads on forward launches only (K-contiguous weight;
# on dgrad it lost 2-19%, and the cost model has no layout term): the launcher offers it only there.
TMA_ONLY = frozenset(
    {
        MGroupedConfig(128, 256, 64, 8, 8, 4),
        KGroupedConfig(128, 256, 64, 8, 8, 3, flat=True),
        KGroupedConfig(128, 256, 64, 8, 8, 3, flat=True, tma_load=True),
    }
)


def rows_bucket(M: int, G: int) -> int:
    """Power-of-two bucket of the mean rows per group, the quantity that decides tile height."""
    mean = max(1, M // max(G, 1))
    return 1 << (mean.bit_length() - 1)


def cache_key(op: str, dtype: str, G: int, N: int, K: int, M: int) -> str:
    return f"{op}|{dtype}|G{G}|N{N}|K{K}|r{rows_bucket(M, G)}"


@functools.lru_cache(maxsize=8)
def load_cache(device_name: str) -> dict[str, dict]:
    path = CACHE_DIR / f"{device_slug(device_name)}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def device_slug(device_name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")


def pick_config(
    op: str,
    target: str,
    *,
    device_name: str = "",
    dtype: str = "",
    G=0,
    N=0,
    K=0,
    M=0,
    sms: int = 0,
    tma: bool = True,
):
    """The tuned config for this shape bucket if the device's committed cache has one; else, for the
    BF16/FP16 m- and k-grouped kernels on a target with a calibrated cost model (moegemm/cost_model.py),
    the candidate the model predicts fastest for (G, M, N, K) on ``sms`` SMs; else the table default.
    ``tma=False`` (a front end without TMA descriptors): neither the cache nor the model picks a config
    of TMA_ONLY."""
    config = TABLE[(op, target)][0][0]
    hit = None
    if target != "interpret" and device_name:
        hit = load_cache(device_name).get(cache_key(op, dtype, G, N, K, M))
        if hit is not None:
            hit = type(config)(**hit)
            hit = None if not tma and hit in TMA_ONLY else hit
            config = hit or config
    if hit is None and dtype in ("bfloat16", "float16", "float32") and G > 0 and M > 0:
        config = _model_pick(op, target, G=G, M=M, N=N, K=K, sms=sms, tma=tma) or config
    if dtype == "float32" and target != "interpret":
        # 4-byte operands double the shared memory per stage; halve the reduction step to fit.
        field = "block_k" if op == "m_grouped" else "block_r"
        config = dataclasses.replace(config, **{field: max(16, getattr(config, field) // 2)})
    return config


def pick_fp8_ws_config(
    op: str = "m_grouped_fp8_ws",
    *,
    recipe: str,
    device_name: str = "",
    dtype: str = "",
    G: int = 0,
    N: int = 0,
    K: int = 0,
    M: int = 0,
    out_itemsize: int = 4,
    accumulate: bool = False,
) -> Fp8WsConfig | None:
    """A warp-specialized FP8 kernel's config (op "m_grouped_fp8_ws" or "k_grouped_fp8_ws"; N, K the
    output's columns and the m-grouped contraction, or out[g]'s columns and rows), or None where the
    Triton kernel stays faster. A tuned-cache entry for this shape bucket wins if the device has one.

    m-grouped: the 128 x 256 tile from K = 2560 up and the 128 x 128 one below (the K at which the
    measured winner flips, table notes). Tensorwise and rowwise keep the Triton kernel (its split
    accumulator, max_num_imprecise_acc) where groups average under 256 rows and the wide tile would
    run: the only place it lost (gptoss-120b-fc1 dgrad, 128 rows a group, K 5760: 0.94-0.96x;
    docs/design.md, 'Warp-specialized FP8 kernels'), the 128-row tile wasting the partial tiles the Triton
    kernel's tuned 64-row tiles do not.

    k-grouped (out_itemsize, accumulate: the wgrad's output): 128 x 256 for tensorwise and rowwise, 128 x 128
    for blockwise, whose two scale vectors a step spill kilobytes at 256 with an fp32 out (table notes), and
    128 x 128 for every recipe accumulating, whose one part a tile reads out's tile into the staging tile under
    the tile's steps (0.95-1.38x of the 256-wide reduce-add, geomean 1.13x; docs/design.md, 'The FP8 wgrad').
    The Triton kernel keeps accumulation into a 2-byte out."""
    if device_name:
        hit = load_cache(device_name).get(cache_key(op, dtype, G, N, K, M))
        if hit is not None:
            return Fp8WsConfig(**hit)
    if op == "k_grouped_fp8_ws":
        # A 2-byte out accumulated into would be rounded twice (docs/design.md, 'The FP8 wgrad').
        if accumulate and out_itemsize < 4:
            return None
        narrow, wide = candidates(op, "sm90")[:2]
        return narrow if recipe == "blockwise" or accumulate else wide
    wide, narrow = candidates(op, "sm90")[:2]
    config = wide if K >= 2560 and N > narrow.block_n else narrow
    if recipe != "blockwise" and config is wide and M < 256 * max(G, 1):
        return None
    return config


# Mean rows per group above which the warp-specialized wgrad runs, from the suite's wgrad launches on the H100
# (docs/design.md, 'Warp-specialized wgrad'; paired clock, the 4-slot ring against the Triton kernel's pick):
# it won at 256 rows (finegrain-e256, +7.7%), 1024 (dsv3 fc1/fc2 +10-12%, finegrain-e64 +6.6%) and 2048
# (mixtral-fc1, +4.1%), and lost at 128 (qwen3-30b fc1/fc2 -4 to -6%, gpt-oss-120b -16%: there 2 CTAs of 128 x
# 128 a SM hide each other's epilogue, and a 64-row step is half of a group's rows). The threshold sits
# between the two. No suite launch has more than 2048 rows a group; longer groups only amortize the kernel's
# per-tile work further, so there is no upper bound. finegrain-e64/e256 stay below the launcher's TMA gate
# (5e10 FLOPs), so they never route.
K_WS_MIN_ROWS = 192


def pick_k_ws_config(
    *, device_name: str = "", dtype: str = "", G: int = 0, N: int = 0, K: int = 0, M: int = 0
) -> WsConfig | None:
    """The warp-specialized k-grouped kernel's config for a BF16/FP16 wgrad (N, K: out[g]'s columns and rows), or
    None where the Triton kernel stays faster: groups that average K_WS_MIN_ROWS rows or fewer. A tuned-cache
    entry for this shape bucket wins if the device has one (``{"triton": true}`` keeps the Triton kernel)."""
    if device_name:
        hit = load_cache(device_name).get(cache_key("k_grouped_ws", dtype, G, N, K, M))
        if hit is not None:
            return None if hit.get("triton") else WsConfig(**hit)
    return candidates("k_grouped_ws", "sm90")[0] if G > 0 and M > K_WS_MIN_ROWS * G else None


@functools.lru_cache(maxsize=1024)
def _model_pick(op: str, target: str, *, G: int, M: int, N: int, K: int, sms: int, tma: bool = True):
    from moegemm._src import cost_model

    model = cost_model.load(target)
    if model is None or op not in model.ops:
        return None
    if sms:
        model = dataclasses.replace(model, sms=sms)
    ranked = model.rank(op, candidates(op, target, tma), G=G, M=M, N=N, K=K)
    return ranked[0][1] if ranked else None
