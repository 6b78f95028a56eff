"""What the warp-specialized Gluon kernels (``m_grouped_fp8_ws``, ``k_grouped_fp8_ws``) share: the
Gluon Hopper imports (with a stand-in where this Triton lacks them, so the modules import and
``supported()`` answers), the launch's register budget, and the layouts of the loader's copies and
of the per-program schedule vectors.

Both kernels have the same partitions: a default partition of LOADER_WARPS warps fills an mbarrier
ring with cp.async (not TMA: jax-triton 0.3.1 cannot pass host tensor descriptors), and two
consumer warpgroups each run wgmma -> wait -> promote on half of every tile's rows, so one's promotion
runs under the other's wgmma.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

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
    cp = fence_async_shared = mbarrier = warpgroup_mma = warpgroup_mma_wait = None
    IMPORT_ERROR = e

__all__ = [
    "CONSUMER_WARPS",
    "LOADER_WARPS",
    "MAXNREG",
    "copy_layout",
    "cp",
    "fence_async_shared",
    "gl",
    "gluon",
    "mark_slot_loaded",
    "mbarrier",
    "release_slot",
    "ring_barriers",
    "sched_layout",
    "supported",
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
def copy_layout(block_k, num_warps):
    """cp.async pointer tiles: 16 consecutive bytes of the contraction per thread, a warp's threads
    along it first."""
    tpw_k = max(1, min(32, block_k // 16))
    return gl.BlockedLayout([1, 16], [32 // tpw_k, tpw_k], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def sched_layout(num_warps):
    """Vectors over groups (the schedule) and over a tile's rows or columns (scales): one a thread."""
    return gl.BlockedLayout([1], [32], [num_warps], [0])


# The ring protocol. Step i of a partition's walk uses slot i % NUM_STAGES in phase (i // NUM_STAGES) & 1;
# every partition walks the same steps, so the loader and both consumers agree on slots without messages.


@gluon.jit
def ring_barriers(NUM_STAGES: gl.constexpr):
    """(ready, empty) [NUM_STAGES] mbarriers: ready[s] completes when every loader thread's copies into
    slot s landed (one arrive per thread of the launch's default partition), empty[s] when both
    consumers released it."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=32 * gl.num_warps())  # one arrive per loader thread
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
