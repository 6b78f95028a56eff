"""What the warp-specialized Gluon kernels (``k_grouped_ws``, ``m_grouped_fp8_ws``, ``k_grouped_fp8_ws``)
share: the Gluon Hopper imports (with a stand-in where this Triton lacks them, so the modules import
and ``supported()`` answers), the launch's register budget, the layouts of the loader's copies and of
the per-program schedule vectors, the ring protocol, and the m-grouped tile space.

The kernels have the same partitions: a default partition of LOADER_WARPS warps fills an mbarrier
ring with cp.async (not TMA: jax-triton 0.3.1 cannot pass host tensor descriptors), and two
consumer warpgroups each run wgmma on half of every tile's rows (FP8: wgmma -> wait -> promote, so
one's promotion runs under the other's wgmma).
"""

from __future__ import annotations

from moegemm._src.kernels.schedule import clamped_group_bounds, row_tile_space

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # triton 3.9 renamed cp.async_copy_global_to_shared (which now raises) to cp.async_load, same arguments.
    async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    # Likewise tma.async_copy_global_to_shared -> tma.async_load (desc, coord, barrier, smem).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # And gl.thread_barrier -> gl.barrier (3.9 has only the latter; both are one CTA-level barrier, which inside
    # a warp_specialize partition syncs that partition's warps).
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    IMPORT_ERROR = None
except ImportError as e:  # a Triton without (this version of) Gluon's Hopper API

    class _NoGluon:
        """Lets the kernel modules import (and supported() answer) where Gluon is missing."""

        constexpr = None

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        constexpr_function = jit

    gluon = gl = _NoGluon()
    cp = async_load = fence_async_shared = mbarrier = warpgroup_mma = warpgroup_mma_wait = None
    tma = tma_load = TensorDescriptor = thread_barrier = None
    IMPORT_ERROR = e

__all__ = [
    "CONSUMER_WARPS",
    "async_load",
    "LOADER_WARPS",
    "MAXNREG",
    "copy_layout",
    "cp",
    "fence_async_shared",
    "gl",
    "gluon",
    "mark_slot_loaded",
    "m_tile_space",
    "mbarrier",
    "release_slot",
    "ring_barriers",
    "sched_layout",
    "supported",
    "TensorDescriptor",
    "tma",
    "thread_barrier",
    "tma_load",
    "warpgroup_mma",
    "wait_slot_free",
    "wait_slot_ready",
    "warpgroup_mma_wait",
]

LOADER_WARPS = 4  # the default partition: the launch's num_warps
# Registers per thread at launch (ptxas's cap): 12 warps x 168 fill the 64K register file. setmaxnreg
# then moves them: CONSUMER_REGS to each consumer, the rest to the loader.
MAXNREG = 168
CONSUMER_WARPS = gl.constexpr(4) if IMPORT_ERROR is None else 4  # one warpgroup per consumer


def supported() -> bool:
    """Whether this Triton has the Gluon API the kernels use (they need an sm_90 device besides)."""
    return IMPORT_ERROR is None


@gluon.constexpr_function
def copy_layout(cols, num_warps, vec=16):
    """cp.async pointer tiles [rows, cols] with cols contiguous in memory: ``vec`` consecutive elements
    (16 bytes: 16 for FP8, 8 for 2-byte types) per thread, a warp's threads along the columns first."""
    tpw = max(1, min(32, cols // vec))
    return gl.BlockedLayout([1, vec], [32 // tpw, tpw], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def sched_layout(num_warps):
    """Vectors over groups (the schedule) and over a tile's rows or columns (scales): one a thread."""
    return gl.BlockedLayout([1], [32], [num_warps], [0])


# The ring protocol. Step i of a partition's walk uses slot i % NUM_STAGES in phase (i // NUM_STAGES) & 1;
# every partition walks the same steps, so the loader and both consumers agree on slots without messages.


@gluon.jit
def ring_barriers(NUM_STAGES: gl.constexpr, TMA: gl.constexpr = False):
    """(ready, empty) [NUM_STAGES] mbarriers: ready[s] completes when every loader thread's copies into
    slot s landed (one arrive per thread of the launch's default partition; with TMA, the loader's
    one expect-arrive and the copies' byte count), empty[s] when both consumers released it."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    if TMA:
        ready_count: gl.constexpr = 1
    else:
        ready_count: gl.constexpr = 32 * gl.num_warps()
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=ready_count)
        mbarrier.init(empty.index(i), count=2)  # one per consumer
    return ready, empty


@gluon.jit
def wait_slot_free(empty, step):
    """Loader: the slot of ``step`` once both consumers released its previous use (the first pass
    through the ring waits on the phase before init, which counts as complete)."""
    NUM_STAGES: gl.constexpr = empty.shape[0]
    slot = step % NUM_STAGES
    mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)
    return slot


@gluon.jit
def mark_slot_loaded(ready, slot):
    """Loader: every thread arrives once its own cp.async copies into ``slot`` land (noinc: the barrier
    counts all loader threads)."""
    cp.mbarrier_arrive(ready.index(slot), increment_count=False)


@gluon.jit
def wait_slot_ready(ready, step, PROXY_FENCE: gl.constexpr):
    """Consumer: the slot of ``step`` once its copies landed."""
    NUM_STAGES: gl.constexpr = ready.shape[0]
    slot = step % NUM_STAGES
    mbarrier.wait(ready.index(slot), (step // NUM_STAGES) & 1)
    if PROXY_FENCE:  # cp.async wrote through the generic proxy; wgmma reads through the async one
        fence_async_shared()
    return slot


@gluon.jit
def release_slot(empty, slot):
    """Consumer: done reading ``slot`` (its wgmmas drained)."""
    mbarrier.arrive(empty.index(slot), count=1)


@gluon.jit
def m_tile_space(group_sizes_ptr, G, M, n_tiles, BLOCK_M: gl.constexpr, BLOCK_G: gl.constexpr):
    """``schedule.group_row_bounds`` + ``row_tile_space`` over an arange with this partition's layout
    (Gluon's arange needs one); the same clamping, so every partition sees the same tiles.
    Returns (offs, starts, ends, m_tiles, tile_ends, total_tiles) for ``schedule.locate_row_tile``."""
    offs = gl.arange(0, BLOCK_G, layout=sched_layout(gl.num_warps()))
    starts, ends = clamped_group_bounds(group_sizes_ptr, offs, G, M)
    # int32 once clamped into [0, M] (M is an i32): these vectors stay live through the whole kernel,
    # and int64 ones cost the consumers registers their accumulators need.
    starts = starts.to(gl.int32)
    ends = ends.to(gl.int32)
    starts, ends, m_tiles, tile_ends, total_tiles = row_tile_space(offs, starts, ends, G, M, n_tiles, BLOCK_M)
    return offs, starts, ends, m_tiles, tile_ends, total_tiles
