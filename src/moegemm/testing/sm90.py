"""Compile the GPU kernels for sm_90a on a machine without a GPU: the warp-specialized Gluon kernels and
the BF16 Triton kernels every default launch uses.

CI has no GPU, the interpreter cannot run Gluon, and it never runs Triton's GPU code generator, so a
Triton release that renames a Gluon API (triton 3.9 turned ``cp.async_copy_global_to_shared`` and
``tma.async_copy_global_to_shared`` into ``async_load``) or breaks a lowering would otherwise surface
only on a user's H100. This runs Triton's compiler for
``GPUTarget("cuda", 90, 32)`` down to a cubin, then the bundled ptxas with ``-v`` for the spill count
(None where that ptxas does not take the PTX version Triton wrote).

    python -m moegemm.testing.sm90 [kernel ...]    # one JSON line per kernel (KERNELS, or UNALIGNED by name)

Run it in a process without TRITON_INTERPRET: under the interpreter the @triton.jit helpers the
Gluon kernels call are interpreted functions, which the compiler refuses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

from moegemm._src import configs
from moegemm._src.kernels import (
    combine,
    k_grouped,
    k_grouped_fp8_ws,
    k_grouped_ws,
    m_grouped,
    m_grouped_fp8,
    m_grouped_fp8_ws,
    quantize_fp8,
    split_k,
    stage_rows,
    swiglu,
)
from moegemm._src.kernels.gluon_hopper import TensorDescriptor, gl
from moegemm._src.kernels.schedule import sm90_shared_fits

__all__ = ["KERNELS", "UNALIGNED", "compile_kernel", "compile_source", "load_widths"]

# A realistic specialization per kernel: (G, M, N, K) of dsv3-ep8-fc1 and the default configs.
G, M, N, K = 32, 32768, 4096, 7168


def _k_grouped_ws(num_stages: int | None = None):
    """The warp-specialized BF16 wgrad at gpt-oss-20b's sizes (out [32, 2880, 2880]), its table config (or
    that config with another ring depth: 3 slots leave room for a staging tile per consumer)."""
    Gw, Mw, Kw, Nw = 32, 16384, 2880, 2880
    config = configs.candidates("k_grouped_ws", "sm90")[0]
    if num_stages is not None:
        config = dataclasses.replace(config, num_stages=num_stages)
    launch = k_grouped_ws.KGroupedWsLaunch.make(Mw, Nw, Kw, Gw, config=config, num_programs_cap=132)
    x = torch.empty(16, 16, dtype=torch.bfloat16)  # only its dtype and alignment matter here
    pointers = {
        "out_desc": _desc(x, [k_grouped_ws.BLOCK_K // 2, config.block_n]),
        "a_ptr": "*bf16",
        "b_ptr": "*bf16",
        "group_sizes_ptr": "*i32",
    }
    return k_grouped_ws.k_grouped_mm_ws_kernel, {**launch.meta, "K": Kw, "N": Nw, "G": Gw}, pointers


def _desc(t, block):
    layout = gl.NVMMASharedLayout.get_default_for(
        block, {torch.float32: gl.float32}.get(t.dtype, gl.bfloat16)
    )
    return triton.runtime.jit.mangle_type(TensorDescriptor(t, [16, 16], [16, 1], block, layout))


def _m_grouped_fp8_ws(store: int = 0, narrow: bool = False):
    """The m-grouped FP8 kernel at dsv3-ep8-fc1's sizes, blockwise with bias: the 256-wide table config (or the
    128-wide one), with the epilogue's store (m_grouped_fp8_ws.STORE_*) for a bf16 out."""
    config = configs.candidates("m_grouped_fp8_ws", "sm90")[int(narrow)]
    launch = m_grouped_fp8_ws.MGroupedFp8WsLaunch.make(
        M,
        N,
        K,
        G,
        recipe="blockwise",
        config=config,
        num_programs_cap=132,
        has_bias=True,
        store=store,
    )
    pointers = {
        "x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "sw_ptr": "*fp32", "group_sizes_ptr": "*i32",
        "bias_ptr": "*fp32", "out_ptr": "*bf16",
    }  # fmt: skip
    return m_grouped_fp8_ws.m_grouped_mm_fp8_ws_kernel, launch.meta, pointers


def _k_grouped_fp8_ws(
    accumulate: bool = True, out: str = "fp32", recipe: str = "blockwise", out_desc_on_device: bool = False
):
    """The FP8 wgrad at dsv3-ep8-fc1's sizes (out [32, 4096, 7168]) with the tile the pick gives the recipe,
    accumulating into fp32 main_grad (TMA reduce-add) or storing (fp32 or bf16 dW); ``out_desc_on_device``: out's
    descriptor made by the kernel (the JAX launch), its slot a plain pointer."""
    itemsize = 4 if out == "fp32" else 2
    config = configs.pick_fp8_ws_config(
        "k_grouped_fp8_ws", recipe=recipe, G=G, N=N, K=K, M=M, out_itemsize=itemsize, accumulate=accumulate
    )
    launch = k_grouped_fp8_ws.KGroupedFp8WsLaunch.make(
        M, N, K, G, recipe=recipe, config=config, num_programs_cap=132, accumulate=accumulate,
        out_itemsize=itemsize, out_desc_on_device=out_desc_on_device,
    )  # fmt: skip
    dtype = torch.float32 if out == "fp32" else torch.bfloat16
    block = [k_grouped_fp8_ws.BLOCK_K // 2, k_grouped_fp8_ws.SUB_N]
    pointers = {
        "out_desc": "*fp8e4nv" if out_desc_on_device else _desc(torch.empty(16, 16, dtype=dtype), block),
        "a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "group_sizes_ptr": "*i32",
        "out_ptr": f"*{out}",
    }  # fmt: skip
    return k_grouped_fp8_ws.k_grouped_mm_fp8_ws_kernel, launch.meta, pointers


def _quantize_pair(scaling: int = 1, warps: int = 16, x: str = "bf16", weight: bool = False):
    """The one-read FP8 quantize (data and data_t) of activations with device-side group sizes (a weight's
    128x128 blocks with ``weight``), at the sm90 config's ring depth."""
    config = configs.pick_config("quantize_fp8", "sm90")
    meta = dict(
        CHUNKS=config.pair_chunks, BLOCK_G=64, HAS_SIZES=not weight, NUM_STAGES=config.pair_stages,
        SCALING=scaling, T_GROUP_LOCAL=weight, FP8_MAX=448.0, WIDE_OFFSETS=False, AMAX_COLS=128, num_warps=warps,
    )  # fmt: skip
    pointers = {
        "x_ptr": f"*{x}", "group_sizes_ptr": "*i32", "amax_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
        "qt_ptr": "*u8", "st_ptr": "*fp32",
    }  # fmt: skip
    R, C, G_ = (G * N, K, G) if weight else (M, K, G)
    values = dict(
        R=R, C=C, G=G_, rows_per_group=N if weight else R, stride_xr=C, stride_xc=1, stride_qr=C + 16,
        stride_qc=1, stride_tg=K * N if weight else 0, stride_tc=N if weight else M + 16 * G, stride_tr=1,
        stride_sg=0 if weight else 1, stride_sr=0 if weight else 1, stride_sc=R, stride_stb=C, stride_stc=1,
        stride_aj=M,
    )  # fmt: skip
    if weight:
        nb, kb = N // 128, K // 128
        values.update(stride_sg=nb * kb, stride_sr=kb, stride_sc=1, stride_stb=0, stride_stc=0)
    return quantize_fp8.fp8_quantize_pair_kernel, meta, pointers, values


def _quantize_rows(C: int):
    """Rowwise data of activations [M, C] with device-side group sizes, as ``quantize_fp8.rows_geometry`` plans
    it at the sm90 config: held whole up to one_sweep_cols columns, two sweeps past them."""
    config = configs.pick_config("quantize_fp8", "sm90")
    block_r, block_c, one_sweep, warps, _ = quantize_fp8.rows_geometry(M, C, config)
    meta = dict(
        BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_G=64, HAS_SIZES=True, NUM_STAGES=config.sweep_stages,
        FP8_MAX=448.0, EMULATE_CAST=False, ONE_SWEEP=one_sweep, num_warps=warps,
    )  # fmt: skip
    pointers = {"x_ptr": "*bf16", "group_sizes_ptr": "*i32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    values = dict(R=M, C=C, G=G, stride_xr=C, stride_xc=1, stride_qr=C, stride_qc=1, stride_s=1)
    return quantize_fp8.fp8_quantize_rows_kernel, meta, pointers, values


def _m_args(
    M: int, N: int, K: int, G: int, *, w_k_contiguous: bool = True, bias: bool = False, out: str = "*bf16"
):
    """(pointer types, other arguments) of a contiguous BF16 m-grouped launch: x [M, K], w read as [G, K, N]
    (K-contiguous: an nn.Linear weight [G, N, K] as stored), out [M, N] of type ``out``, bias [G, N] or none."""
    pointers = {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "group_sizes_ptr": "*i32", "group_offset_ptr": "*i32",
        "bias_ptr": "*bf16", "gather_ptr": "*i32", "act_ptr": "*bf16", "row_scale_ptr": "*fp32",
        "act_out_ptr": "*bf16", "ds_ptr": "*fp32", "out_ptr": out,
    }  # fmt: skip
    w_strides = dict(stride_wk=1, stride_wn=K) if w_k_contiguous else dict(stride_wk=N, stride_wn=1)
    values = dict(
        M=M, N=N, K=K, G=G, G_TOTAL=G, stride_xm=K, stride_xk=1, stride_wg=N * K, **w_strides, stride_om=N,
        stride_on=1, stride_bg=N if bias else 0, stride_bn=1 if bias else 0,
    )  # fmt: skip
    return pointers, values


def _k_args(M: int, N: int, K: int, G: int, out: str = "*bf16"):
    """(pointer types, other arguments) of a contiguous BF16 k-grouped launch: a [M, K], b [M, N], out
    [G, K, N] of type ``out`` (c and the column sums alike)."""
    pointers = {
        "a_ptr": "*bf16", "b_ptr": "*bf16", "group_sizes_ptr": "*i32", "group_offset_ptr": "*i32", "c_ptr": out,
        "a_colsum_ptr": out, "gather_a_ptr": "*i32", "gather_b_ptr": "*i32", "out_ptr": out,
    }  # fmt: skip
    values = dict(
        M=M, N=N, K=K, G=G, G_TOTAL=G, stride_am=K, stride_ak=1, stride_bm=N, stride_bn=1, stride_og=K * N,
        stride_ok=N, stride_on=1, stride_sg=0, stride_sk=0,
    )  # fmt: skip
    return pointers, values


def _m_grouped(
    config=None,
    tma_store: bool = False,
    tma_load: bool = False,
    w_k_contiguous: bool = True,
    mixed_m: bool = False,
    K: int = K,
    tail_split: bool = True,
    flat: bool = False,
):
    """The BF16 forward (the nn.Linear weight read K-contiguous) or dgrad (N-contiguous), with bias (the
    default config unless given); ``mixed_m``: with half-high tail tiles (at a K that has them);
    ``tail_split``: with the last round's tiles split in half-high halves where the config has them (as
    every launch with 16-byte aligned rows)."""
    config = config or configs.candidates("m_grouped", "sm90")[0]
    launch = m_grouped.MGroupedLaunch.make(
        M, N, K, G, config=config, num_programs_cap=132, fp32_inputs=False, interpret=False,
        w_k_contiguous=w_k_contiguous, has_bias=True, tma_store=tma_store, tma_load=tma_load, mixed_m=mixed_m,
        tail_split=tail_split, flat=flat,
    )  # fmt: skip
    assert launch.meta["TMA_STORE"] == tma_store, config
    assert launch.meta["TMA_LOAD"] == tma_load, config
    assert launch.meta["MIXED_M"] == mixed_m, (config, K)
    # flat: the flat loop allowed (configs.M_FLAT); it runs at K <= FLAT_MAX_K, beyond that where groups fill
    # whole row tiles (both loops compiled in).
    assert launch.meta["FLAT"] == (flat and K <= m_grouped.FLAT_MAX_K), (config, K)
    assert launch.meta["FLAT_WHOLE_TILES"] == (
        flat and m_grouped.flat_whole_tiles_fits(K, tma_load, tma_store, False)
    ), (config, K)
    half = not launch.meta["FLAT"] and m_grouped.half_tiles_fit(config.block_m, K, N, False)
    assert launch.meta["TAIL_SPLIT"] == (tail_split and half)
    pointers, values = _m_args(M, N, K, G, w_k_contiguous=w_k_contiguous, bias=True)
    meta = {**launch.meta, "ctas_per_sm": config.ctas_per_sm}
    return m_grouped.m_grouped_mm_kernel, meta, pointers, values


def _unaligned(op: str, K: int, N: int):
    """A launch on rows that are 16-byte aligned but not 16-element aligned (K, N such as 1000, 1400, as
    real layers and tensor-parallel shards have), with the strides a contiguous launch passes: its operand
    loads must stay 16-byte wide (``load_widths``; docs/design.md, 'Compiled-in sizes'). op: "fwd" (x @ w.mT,
    K-contiguous w), "dgrad" (N-contiguous w), "wgrad" (k-grouped, out [G, K, N] = a^T b), "fwd_fp8" (the
    Triton FP8 kernel, rowwise)."""
    g, m = 8, 4096
    if op == "wgrad":
        config = configs.candidates("k_grouped", "sm90")[0]
        launch = k_grouped.KGroupedLaunch.make(
            m, N, K, g, config=config, num_programs_cap=132, fp32_inputs=False, accumulate=False,
            interpret=False, out_itemsize=2,
        )  # fmt: skip
        return (k_grouped.k_grouped_mm_kernel, dict(launch.meta), *_k_args(m, N, K, g))
    pointers, values = _m_args(m, N, K, g, w_k_contiguous=op != "dgrad")
    if op == "fwd_fp8":
        config = configs.candidates("m_grouped_fp8_fast", "sm90")[0]
        launch = m_grouped_fp8.MGroupedFp8Launch.make(
            m, N, K, g, recipe="rowwise", config=config, num_programs_cap=132, interpret=False,
            max_stride=max(K, N), has_bias=False, fast_accum=True,
        )  # fmt: skip
        pointers = {
            "x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "sw_ptr": "*fp32",
            "group_sizes_ptr": "*i32", "group_offset_ptr": "*i32", "bias_ptr": "*bf16", "gather_ptr": "*i32",
            "act_ptr": "*bf16", "row_scale_ptr": "*fp32", "act_out_ptr": "*bf16", "ds_ptr": "*fp32", "out_ptr": "*bf16",
        }  # fmt: skip
        values |= dict(stride_sxg=0, stride_sxm=1, stride_sxk=0, stride_swg=N, stride_swn=1, stride_swk=0)
        return m_grouped_fp8.m_grouped_mm_fp8_kernel, dict(launch.meta), pointers, values
    config = configs.candidates("m_grouped", "sm90")[0]
    launch = m_grouped.MGroupedLaunch.make(
        m, N, K, g, config=config, num_programs_cap=132, fp32_inputs=False, interpret=False,
        w_k_contiguous=op == "fwd",
    )  # fmt: skip
    return m_grouped.m_grouped_mm_kernel, dict(launch.meta), pointers, values


def _split(op: str, M: int):
    """A split-reduction launch with M rows (M = 1 compiles as Triton's constant): the m-grouped forward's
    split-K with TMA loads (int32 descriptor coordinates), the k-grouped wgrad's split rows, the reduction
    kernel over [G, K, N] and the row-staging kernel."""
    g, k, n = 21, 2968, 512
    if op == "m_grouped":
        config = configs.candidates("m_grouped", "sm90")[0]
        launch = m_grouped.MGroupedLaunch.make(
            M, n, k, g, config=config, num_programs_cap=132, fp32_inputs=False, interpret=False,
            w_k_contiguous=True, tma_load=True, split_k=5,
        )  # fmt: skip
        return (m_grouped.m_grouped_mm_kernel, dict(launch.meta), *_m_args(M, n, k, g, out="*fp32"))
    if op == "k_grouped":
        config = configs.candidates("k_grouped", "sm90")[0]
        launch = k_grouped.KGroupedLaunch.make(
            M, n, 64, 2, config=config, num_programs_cap=132, fp32_inputs=False, accumulate=False,
            interpret=False, out_itemsize=4, split_r=4,
        )  # fmt: skip
        return (k_grouped.k_grouped_mm_kernel, dict(launch.meta), *_k_args(M, n, 64, 2, out="*fp32"))
    if op == "reduce":
        meta = dict(
            N=n, GROUP_ROWS=64, stride_og=64 * n, stride_or=n, stride_on=1, SPLIT=4, BLOCK_R=split_k.BLOCK_R,
            BLOCK_N=split_k.BLOCK_N, num_warps=split_k.NUM_WARPS,
        )  # fmt: skip
        return split_k.reduce_kernel, meta, {"partials_ptr": "*fp32", "out_ptr": "*bf16"}, {"R": M}
    meta = dict(C=1001, C_PAD=1008, BLOCK_R=stage_rows.BLOCK_R, BLOCK_C=stage_rows.BLOCK_C, num_warps=4)
    values = {"rows": M, "R": M, "stride_sb": 0, "stride_sr": 1001}
    return stage_rows.stage_rows_kernel, meta, {"src_ptr": "*bf16", "dst_ptr": "*bf16"}, values


# Launches on 16-byte but not 16-element aligned rows, whose loads ``load_widths`` checks.
UNALIGNED = {
    f"unaligned-{op}-{K}-{N}": (lambda op=op, K=K, N=N: _unaligned(op, K, N))
    for op, K, N in (
        ("fwd", 1000, 1400),
        ("dgrad", 1400, 1000),
        ("wgrad", 1000, 1400),
        ("fwd", 1024, 1400),
        ("fwd_fp8", 1000, 1400),
    )
}


def load_widths(ptx: str) -> dict[str, int]:
    """Global memory accesses of a kernel's PTX by width: ``cp.async-<bytes>`` (asynchronous copies into
    shared memory, what the software pipeliner issues), ``ld-<bits>`` and ``st-<bits>`` (loads into and stores
    from registers, vector width times element bits)."""
    counts: dict[str, int] = {}
    copy = r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)?\s*\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-f]+|\d+)"
    for size in re.findall(copy, ptx):
        key = f"cp.async-{int(size, 0)}"
        counts[key] = counts.get(key, 0) + 1
    for kind, vec, bits in re.findall(r"(ld|st)\.global(?:\.[a-z_:0-9]+)*?(?:\.v(\d))?\.[bsuf](\d+)\s", ptx):
        key = f"{kind}-{int(vec or 1) * int(bits)}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _k_grouped(
    config=None,
    tma_store: bool = False,
    a_colsum: bool = False,
    tma_load: bool = False,
):
    """The BF16 wgrad: out [G, N, K] = dy[rows]^T @ x[rows], bf16 out (the default config unless given),
    with ``a_colsum`` also GroupedLinear's bias gradient from the same launch."""
    config = config or configs.candidates("k_grouped", "sm90")[0]
    launch = k_grouped.KGroupedLaunch.make(
        M, K, N, G, config=config, num_programs_cap=132, fp32_inputs=False, accumulate=False, interpret=False,
        out_itemsize=2, tma_store=tma_store, a_colsum=a_colsum, tma_load=tma_load,
    )  # fmt: skip
    assert launch.meta["TMA_STORE"] == tma_store, config
    assert launch.meta["TMA_LOAD"] == tma_load, config
    pointers, values = _k_args(M, K, N, G)  # out [G, N, K]: the kernel's K is N here, its N is K
    meta = {**launch.meta, "ctas_per_sm": config.ctas_per_sm}
    return k_grouped.k_grouped_mm_kernel, meta, pointers, values


def _moe(op: str):
    """The expert block's launches at Qwen3-30B-A3B's sizes (T 32768, k 8: R = 262144 rows; d 2048, n 768, E 128),
    with the config the H100 plan picks (docs/design.md, 'Fused expert block'): "fc1" (gather, SwiGLU), "fc2",
    "fc2-dgrad" (gather, SwiGLU backward; "-tma-w": w2 through TMA), "fc1-wgrad" (b gathered), "fc2-wgrad" (a gathered), "combine";
    "-ep": the expert-parallel local step's launches, which leave the rows past the groups alone (FILL_TAIL off);
    "gather-rows": its wgrads' row copies."""
    from moegemm._src import plan

    R, d, n, E = 262144, 2048, 768, 128
    target = plan.Target("sm90", "NVIDIA H100 80GB HBM3", 132)
    caps = plan.Capabilities(host_descriptors=True, global_scratch=True, gluon=False, workspace=True)
    if op == "combine":
        meta = dict(D=d, TOP_K=8, stride_rm=d, stride_om=d, HAS_WEIGHT=True, BLOCK_T=combine.BLOCK_T,
                    BLOCK_D=combine.BLOCK_D, num_warps=combine.NUM_WARPS)  # fmt: skip
        pointers = {"rows_ptr": "*bf16", "pos_ptr": "*i32", "weight_ptr": "*fp32", "out_ptr": "*bf16"}
        return combine.combine_kernel, meta, pointers, dict(T=32768, R=R)
    if op == "gather-rows":
        meta = dict(D=d, stride_sm=d, stride_om=d, BLOCK_G=E, BLOCK_R=combine.GATHER_BLOCK_R,
                    BLOCK_D=combine.GATHER_BLOCK_D, num_warps=4)  # fmt: skip
        pointers = {"src_ptr": "*bf16", "index_ptr": "*i32", "group_sizes_ptr": "*i32", "out_ptr": "*bf16"}
        return combine.gather_rows_kernel, meta, pointers, dict(S=32768, R=R, G=E)
    if op.endswith("wgrad"):
        Kw, Nw, gather = (2 * n, d, ("b",)) if op == "fc1-wgrad" else (d, n, ("a",))
        problem = plan.Problem(plan.K_GROUPED, R, Nw, Kw, E, "bfloat16", gather=gather)
        chosen = plan.plan(problem, target, caps)
        pointers, values = _k_args(R, Nw, Kw, E)
        return k_grouped.k_grouped_mm_kernel, dict(chosen.meta), pointers, values
    tma_w = op.endswith("-tma-w")
    op = op.removesuffix("-tma-w")
    fill_tail = not op.endswith("-ep")  # the expert-parallel local step: rows past the groups left alone
    op = op.removesuffix("-ep")
    Nm, Km, k_contiguous, gather, epilogue = {
        "fc1": (2 * n, d, True, ("x",), "swiglu"),
        "fc2": (d, n, True, (), ""),
        "fc2-dgrad": (n, d, False, ("x",), "swiglu_bwd"),
    }[op]
    problem = plan.Problem(
        plan.M_GROUPED,
        R,
        Nm,
        Km,
        E,
        "bfloat16",
        w_k_contiguous=k_contiguous,
        gather=gather,
        epilogue=epilogue,
        tma_load_layout=tma_w,
        fill_tail=fill_tail,
    )
    chosen = plan.plan(problem, target, caps)
    pointers, values = _m_args(R, Nm, Km, E, w_k_contiguous=k_contiguous)
    return (
        m_grouped.m_grouped_mm_kernel,
        {**chosen.meta, "ctas_per_sm": chosen.config.ctas_per_sm},
        pointers,
        values,
    )


def _moe_fp8(op: str, recipe: str):
    """The FP8 expert block's fused launches (docs/design.md, 'FP8 expert block') at DeepSeek-V3 EP8's sizes
    (R = 65536 rows, d 7168, n 2048, E 32) with the plan the H100 takes: "fc1" (gather, SwiGLU; fast
    accumulation where the recipe has it) and "fc2-dgrad" (gather, SwiGLU backward, promoted)."""
    from moegemm._src import fp8, plan

    R, d, n, E = 65536, 7168, 2048, 32
    target = plan.Target("sm90", "NVIDIA H100 80GB HBM3", 132)
    caps = plan.Capabilities(host_descriptors=True, global_scratch=True, gluon=True, workspace=True)
    N, K, epilogue = (2 * n, d, "swiglu") if op == "fc1" else (n, d, "swiglu_bwd")
    problem = plan.Problem(
        plan.M_GROUPED, R, N, K, E, "float8_e4m3fn", max_stride=2 * d, recipe=recipe, fast_accum=op == "fc1",
        gather=("x",), epilogue=epilogue,
    )  # fmt: skip
    chosen = plan.plan(problem, target, caps)
    pointers = {
        "x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "sw_ptr": "*fp32", "group_sizes_ptr": "*i32",
        "group_offset_ptr": "*i32", "bias_ptr": "*fp32", "gather_ptr": "*i32", "act_ptr": "*bf16",
        "row_scale_ptr": "*fp32", "act_out_ptr": "*bf16", "ds_ptr": "*fp32", "out_ptr": "*bf16",
    }  # fmt: skip
    Kp = fp8.padded(K)
    if recipe == "tensorwise":
        scales = dict(stride_sxg=0, stride_sxm=0, stride_sxk=0, stride_swg=1, stride_swn=0, stride_swk=0)
    elif recipe == "rowwise":
        scales = dict(stride_sxg=0, stride_sxm=1, stride_sxk=0, stride_swg=N, stride_swn=1, stride_swk=0)
    else:
        nb, kb = fp8.cdiv(N, 128), fp8.cdiv(K, 128)
        scales = dict(
            stride_sxg=0, stride_sxm=1, stride_sxk=8192, stride_swg=nb * kb, stride_swn=kb, stride_swk=1
        )
    out_n = n if op == "fc1" else 2 * n
    values = dict(
        M=R, N=N, K=K, G=E, G_TOTAL=E, stride_xm=Kp, stride_xk=1, stride_wg=N * Kp, stride_wn=Kp, stride_wk=1,
        stride_om=out_n, stride_on=1, stride_bg=0, stride_bn=0, **scales,
    )  # fmt: skip
    meta = {**chosen.meta, "ctas_per_sm": chosen.config.ctas_per_sm}
    return m_grouped_fp8.m_grouped_mm_fp8_kernel, meta, pointers, values


# Every candidate that MGroupedLaunch / KGroupedLaunch lets store through TMA: their shared-memory
# estimates (m_grouped.tma_store_fits, k_grouped.tma_store_fits) must hold for what the compiler allocates.
_TMA_STORE_CANDIDATES = {
    # Each m_grouped candidate with cp.async and with TMA loads (their mbarriers must fit the margin).
    **{
        f"m_grouped_tma_store-{i}{suffix}": (_m_grouped, config, {"tma_load": tma_load})
        for i, config in enumerate(configs.candidates("m_grouped", "sm90"))
        for suffix, tma_load in (("", False), ("-tma-load", True))
        if m_grouped.tma_store_fits(config, 2)
    },
    # Each k_grouped candidate in both loops (the flat loop can be forced onto any config), and flat with
    # TMA loads (their mbarriers must fit the estimate's margin).
    **{
        f"k_grouped_tma_store-{i}{suffix}": (
            _k_grouped,
            dataclasses.replace(config, flat=flat, tma_load=tma_load),
            {"tma_load": tma_load},
        )
        for i, config in enumerate(configs.candidates("k_grouped", "sm90"))
        for suffix, flat, tma_load in (
            ("", False, False),
            ("-flat", True, False),
            ("-flat-tma-load", True, True),
        )
        if k_grouped.tma_store_fits(config, 2)
    },
}


KERNELS = {
    "m_grouped": _m_grouped,
    "m_grouped-whole-tiles": lambda: _m_grouped(tail_split=False),
    # The flat loop (K <= FLAT_MAX_K, TMA loads, register store): the forward of every candidate it admits (its
    # operand ring stays live beside the epilogue's scratch: m_grouped.flat_shared_bytes must hold), the dgrad.
    **{
        f"m_grouped-flat-{i}": (lambda c=config: _m_grouped(c, tma_load=True, K=1024, flat=True))
        for i, config in enumerate(configs.candidates("m_grouped", "sm90"))
        if sm90_shared_fits(m_grouped.flat_shared_bytes(config, 2), config.ctas_per_sm)
    },
    "m_grouped-flat-dgrad": lambda: _m_grouped(tma_load=True, K=1024, flat=True, w_k_contiguous=False),
    # The flat loop with the TMA store (every tile in one bulk copy, no masked store): every candidate it admits
    # (the ring beside the staging tile: m_grouped.tma_store_fits must hold), the dgrad.
    **{
        f"m_grouped-flat-tma-store-{i}": (
            lambda c=config: _m_grouped(c, tma_store=True, tma_load=True, K=1024, flat=True)
        )
        for i, config in enumerate(configs.candidates("m_grouped", "sm90"))
        if sm90_shared_fits(m_grouped.flat_shared_bytes(config, 2), config.ctas_per_sm)
        and m_grouped.tma_store_fits(config, 2)
    },
    "m_grouped-flat-tma-store-dgrad": lambda: _m_grouped(
        tma_store=True, tma_load=True, K=1024, flat=True, w_k_contiguous=False
    ),
    # Both loops in one kernel, the group sizes picking (K between FLAT_MAX_K and FLAT_WHOLE_TILES_MAX_K).
    "m_grouped-flat-whole-tiles": lambda: _m_grouped(
        tma_store=True, tma_load=True, K=2048, mixed_m=True, flat=True
    ),
    "m_grouped-flat-whole-tiles-dgrad": lambda: _m_grouped(
        tma_store=True, tma_load=True, K=2048, mixed_m=True, flat=True, w_k_contiguous=False
    ),
    "m_grouped-mixed-m": lambda: _m_grouped(mixed_m=True, K=2048),
    "m_grouped-mixed-m-dgrad": lambda: _m_grouped(mixed_m=True, K=2048, w_k_contiguous=False),
    "m_grouped_tma_store-tma-load-mixed-m": lambda: _m_grouped(
        tma_store=True, tma_load=True, mixed_m=True, K=2048
    ),
    "k_grouped": _k_grouped,
    "m_grouped-tma-load-dgrad": lambda: _m_grouped(tma_load=True, w_k_contiguous=False),
    "m_grouped_tma_store-tma-load-dgrad": lambda: _m_grouped(
        tma_store=True, tma_load=True, w_k_contiguous=False
    ),
    # The candidates without room for the TMA store, with TMA loads: those whose operand ring fits their CTAs
    # per SM (64 x 256 x 64 in 3 stages at 2 CTAs per SM does not, 120 KB each, with or without TMA loads: a
    # table entry that runs one CTA per SM; no cache entry or model pick uses it).
    **{
        f"m_grouped-{i}-tma-load": (lambda c=config: _m_grouped(c, tma_load=True))
        for i, config in enumerate(configs.candidates("m_grouped", "sm90"))
        if not m_grouped.tma_store_fits(config, 2)
        and sm90_shared_fits(m_grouped.ring_bytes(config, 2), config.ctas_per_sm)
    },
    "k_grouped_tma_store-colsum": lambda: _k_grouped(tma_store=True, a_colsum=True),
    "k_grouped-flat-tma-load": lambda: _k_grouped(
        dataclasses.replace(configs.candidates("k_grouped", "sm90")[0], flat=True, tma_load=True),
        tma_load=True,
    ),
    **{
        name: (lambda f=f, c=c, kw=kw: f(c, tma_store=True, **kw))
        for name, (f, c, kw) in _TMA_STORE_CANDIDATES.items()
    },
    **{
        f"split-{op}-M{rows}": (lambda op=op, rows=rows: _split(op, rows))
        for op in ("m_grouped", "k_grouped", "reduce", "stage_rows")
        for rows in (1, 4096)
    },
    **{
        f"moe-{op}": (lambda op=op: _moe(op))
        for op in (
            "fc1",
            "fc2",
            "fc2-dgrad",
            "fc2-dgrad-tma-w",
            "fc1-wgrad",
            "fc2-wgrad",
            "combine",
            "fc1-ep",
            "fc2-ep-tma-w",
            "fc2-dgrad-ep-tma-w",
            "gather-rows",
        )  # fmt: skip
    },
    **{
        f"moe-fp8-{op}-{recipe}": (lambda op=op, recipe=recipe: _moe_fp8(op, recipe))
        for op in ("fc1", "fc2-dgrad")
        for recipe in ("tensorwise", "rowwise", "blockwise")
    },
    # The FP8 block's SwiGLU row kernels (its split form) at DeepSeek-V3's n = 2048, with the amax of tensorwise.
    "moe-swiglu": lambda: (
        swiglu.swiglu_kernel,
        dict(N=2048, BLOCK_R=swiglu.BLOCK_R, BLOCK_N=swiglu.BLOCK_N, num_warps=swiglu.NUM_WARPS),
        {"z_ptr": "*bf16", "h_ptr": "*bf16"},
        {"R": 65536},
    ),
    "moe-swiglu-bwd": lambda: (
        swiglu.swiglu_bwd_kernel,
        dict(N=2048, BLOCK_R=swiglu.BLOCK_R, BLOCK_N=swiglu.BLOCK_N, AMAX=True, num_warps=swiglu.NUM_WARPS),
        {
            "dh_ptr": "*bf16",
            "z_ptr": "*bf16",
            "row_scale_ptr": "*fp32",
            "dz_ptr": "*bf16",
            "hs_ptr": "*bf16",
            "ds_ptr": "*fp32",
            "amax_ptr": "*fp32",
        },  # fmt: skip
        {"R": 65536},
    ),
    "m_grouped_fp8_ws": _m_grouped_fp8_ws,
    "m_grouped_fp8_ws-store-rows": lambda: _m_grouped_fp8_ws(m_grouped_fp8_ws.STORE_ROWS),
    "m_grouped_fp8_ws-store-tma": lambda: _m_grouped_fp8_ws(m_grouped_fp8_ws.STORE_TMA),
    "m_grouped_fp8_ws-store-tma-128": lambda: _m_grouped_fp8_ws(m_grouped_fp8_ws.STORE_TMA, True),
    "k_grouped_ws": _k_grouped_ws,
    "k_grouped_ws-3-slots": lambda: _k_grouped_ws(3),
    "k_grouped_fp8_ws": _k_grouped_fp8_ws,
    "k_grouped_fp8_ws-store": lambda: _k_grouped_fp8_ws(False),
    "k_grouped_fp8_ws-bf16": lambda: _k_grouped_fp8_ws(False, "bf16"),
    "k_grouped_fp8_ws-tensorwise-bf16": lambda: _k_grouped_fp8_ws(False, "bf16", "tensorwise"),
    "k_grouped_fp8_ws-tensorwise": lambda: _k_grouped_fp8_ws(True, "fp32", "tensorwise"),
    "k_grouped_fp8_ws-device-desc": lambda: _k_grouped_fp8_ws(False, "bf16", "tensorwise", True),
    # The one-read quantize: every recipe's activations at both warp counts, an fp32 input, a weight.
    "quantize-pair-blockwise": _quantize_pair,
    "quantize-pair-blockwise-8-warps": lambda: _quantize_pair(warps=8),
    "quantize-pair-tensorwise": lambda: _quantize_pair(0),
    "quantize-pair-rowwise": lambda: _quantize_pair(3),
    "quantize-pair-rowwise-8-warps": lambda: _quantize_pair(3, 8),
    "quantize-pair-tensorwise-8-warps": lambda: _quantize_pair(0, 8),
    "quantize-pair-blockwise-fp32": lambda: _quantize_pair(x="fp32"),
    "quantize-pair-weight-blockwise": lambda: _quantize_pair(2, weight=True),
    # Rowwise data: a row held whole (DeepSeek-V3's 7168 and the widest, 16384), and two sweeps past that.
    "quantize-rows-7168": lambda: _quantize_rows(7168),
    "quantize-rows-16384": lambda: _quantize_rows(16384),
    "quantize-rows-two-sweeps": lambda: _quantize_rows(16400),
}


def compile_kernel(name: str) -> dict:
    """{"kernel", "shared" (bytes), "ctas_per_sm", "spill_bytes" (None if unknown), "scratch" (Triton's global
    scratch a program, bytes), "descriptors" (tensor maps the kernel makes: their global-address writes in the
    PTX)} of one KERNELS entry, compiled for sm_90a (``compile_source``)."""
    fn, meta, pointers, *values = {**KERNELS, **UNALIGNED}[name]()
    compiled = compile_source(fn, meta, pointers, values[0] if values else None)
    return {
        "kernel": name,
        "loads": load_widths(compiled.asm["ptx"]),
        "shared": compiled.metadata.shared,
        "ctas_per_sm": meta.get("ctas_per_sm", 1),
        "spill_bytes": _spills(compiled.asm["ptx"]),
        "scratch": getattr(compiled.metadata, "global_scratch_size", 0) or 0,
        "descriptors": compiled.asm["ptx"].count("tensormap.replace.tile.global_address"),
    }


def compile_source(fn, meta: dict, pointers: dict, values: dict | None = None):
    """A Triton or Gluon kernel compiled for sm_90a (the CompiledKernel: metadata, asm["ptx"/"cubin"/...]).
    ``pointers`` gives pointer and descriptor types, ``meta`` the launch's meta-parameters; for Triton kernels
    ``values`` the other arguments, specialized as a launch would (constexpr parameters take the value, an
    int equal to 1 becomes the constant, one divisible by 16 gets that fact). Entries without values (the
    GEMM Gluon kernels) get ints as i32 with the 16-divisibility of a suite shape, except M (any count)."""
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        if param.name in pointers:
            signature[param.name] = pointers[param.name]
            if pointers[param.name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif param.name in meta:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = meta[param.name]
        elif values is None:
            signature[param.name] = "i32"
            if param.name != "M":
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif param.is_constexpr or values[param.name] == 1:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = values[param.name]
        else:
            signature[param.name] = "i32"
            if values[param.name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: meta[k] for k in ("num_warps", "num_stages", "maxnreg") if k in meta}
    source = (GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource)(
        fn, signature, constexprs, attrs
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _spills(ptx: str) -> int | None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        from triton.backends.nvidia.compiler import get_ptxas

        cmd = [
            get_ptxas(90).path,  # triton 3.9 compiles sm_90 with its newer ptxas-blackwell
            "-v",
            "--gpu-name=sm_90a",
            path,
            "-o",
            os.path.join(d, "k.cubin"),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"(\d+) bytes spill stores", result.stderr)
    return int(found.group(1)) if result.returncode == 0 and found else None


def main(argv: list[str]) -> int:
    for name in argv or list(KERNELS):
        print(json.dumps(compile_kernel(name)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
