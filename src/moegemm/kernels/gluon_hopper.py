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
    "mbarrier",
    "sched_layout",
    "supported",
    "warpgroup_mma",
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
