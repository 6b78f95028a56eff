"""The skeleton the warp-specialized Gluon kernels (``k_grouped_ws``, ``m_grouped_fp8_ws``, ``k_grouped_fp8_ws``)
share, as one GEMM base: the Gluon Hopper imports (with a stand-in where this Triton lacks them, so the modules
import and ``supported()`` answers), the register budget, the operand rings and their mbarrier protocol, the
partition launch, and the layouts of the schedule vectors and the consumers' wgmma. A kernel module adds its
loader's copies, its consumers' math and its epilogue.

Partitions (``warp_specialize_ring``): the default partition of LOADER_WARPS warps is the loader; it fills a
ring of NUM_STAGES slots through TMA, from descriptors it makes on the device (Triton's global scratch: the
PyTorch launcher's allocator, or the JAX GPU executor's). Two consumer
warpgroups each own half of every tile's rows and run wgmma on it (FP8: wgmma -> wait -> promote, so one's
promotion runs under the other's wgmma). docs/design.md, 'Warp-specialized wgrad' and 'Warp-specialized FP8
kernels', say why and what each measured.
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

    # triton 3.9 renamed tma.async_copy_global_to_shared (which now raises) to tma.async_load (desc, coord,
    # barrier, smem).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # And gl.thread_barrier -> gl.barrier (3.9 has only the latter; both are one CTA-level barrier, which inside
    # a warp_specialize partition syncs that partition's warps).
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # And cp.async_copy_global_to_shared -> cp.async_load (the quantize's cp.async ring).
    cp_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    # And tma.async_copy_shared_to_global -> tma.async_store.
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # TMA reduce-add of a shared tile into global memory (cp.reduce.async.bulk.tensor .add): triton 3.9 has
    # tma.async_atomic_add; 3.6 has the op in its builder but no Gluon wrapper, so this is that wrapper.
    tma_reduce_add = getattr(tma, "async_atomic_add", None)
    if tma_reduce_add is None:
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(
                _ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
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
    fence_async_shared = mbarrier = warpgroup_mma = warpgroup_mma_wait = None
    tma = tma_load = tma_store = tma_reduce_add = TensorDescriptor = thread_barrier = None
    cp = cp_async_load = None
    IMPORT_ERROR = e

__all__ = [
    "CONSUMER_WARPS",
    "LOADER_WARPS",
    "MAXNREG",
    "TensorDescriptor",
    "acquire_slot",
    "acquire_slot_tx",
    "cp",
    "cp_async_load",
    "fence_async_shared",
    "gl",
    "gluon",
    "group_bounds",
    "m_tile_space",
    "mbarrier",
    "operand_ring",
    "promoted_mainloop",
    "release_slot",
    "ring_barriers",
    "sched_layout",
    "stage_out",
    "supported",
    "thread_barrier",
    "tma",
    "tma_load",
    "tma_reduce_add",
    "tma_store",
    "wait_slot",
    "warp_specialize_ring",
    "warpgroup_mma",
    "warpgroup_mma_wait",
    "wgmma_layout",
]

LOADER_WARPS = 4  # the default partition: the launch's num_warps
# Registers per thread at launch (ptxas's cap): 12 warps x 168 fill the 64K register file. setmaxnreg
# then moves them: CONSUMER_REGS to each consumer, the rest to the loader.
MAXNREG = 168
_CONSUMER_WARPS = 4  # one warpgroup per consumer
CONSUMER_WARPS = gl.constexpr(_CONSUMER_WARPS) if IMPORT_ERROR is None else _CONSUMER_WARPS


def supported() -> bool:
    """Whether this Triton has the Gluon API the kernels use (they need an sm_90 device besides)."""
    return IMPORT_ERROR is None


# Layouts.


@gluon.constexpr_function
def sched_layout(num_warps):
    """Vectors over groups (the schedule) and over a tile's rows or columns (scales): one a thread."""
    return gl.BlockedLayout([1], [32], [num_warps], [0])


@gluon.constexpr_function
def wgmma_layout(cols, instr_k):
    """A consumer warpgroup's wgmma accumulator [rows, cols] (instr_k: 16 for 2-byte operands, 32 for FP8)."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[_CONSUMER_WARPS, 1], instr_shape=[16, cols, instr_k]
    )


# The ring: NUM_STAGES slots of operand tiles and two mbarriers a slot. Step i of a partition's walk uses slot
# i % NUM_STAGES in phase (i // NUM_STAGES) & 1; every partition walks the same steps, so the loader and both
# consumers agree on slots without messages.


@gluon.jit
def operand_ring(dtype: gl.constexpr, NUM_STAGES: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
    """[NUM_STAGES, ROWS, COLS] NVMMA-swizzled slots: what the loader's copies write and wgmma reads."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, COLS], dtype)
    return gl.allocate_shared_memory(dtype, [NUM_STAGES, ROWS, COLS], layout)


@gluon.jit
def ring_barriers(NUM_STAGES: gl.constexpr):
    """(ready, empty) [NUM_STAGES] mbarriers: ready[s] completes when the copies into slot s landed (the
    loader's one expect-arrive and the copies' byte count), empty[s] when both consumers released it."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one per consumer
    return ready, empty


@gluon.jit
def acquire_slot(empty, step):
    """Loader: the slot of ``step`` once both consumers released its previous use (the first pass
    through the ring waits on the phase before init, which counts as complete)."""
    NUM_STAGES: gl.constexpr = empty.shape[0]
    slot = step % NUM_STAGES
    mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)
    return slot


@gluon.jit
def acquire_slot_tx(ready, empty, step, NBYTES: gl.constexpr):
    """TMA loader: ``acquire_slot``, then the slot's ready barrier expecting NBYTES of copies (a box past a
    descriptor's extent is zero-filled and still counts). Returns (slot, its ready barrier for the copies)."""
    slot = acquire_slot(empty, step)
    bar = ready.index(slot)
    mbarrier.expect(bar, NBYTES)
    return slot, bar


@gluon.jit
def wait_slot(ready, step):
    """Consumer: the slot of ``step`` once its copies landed (TMA writes through the async proxy, which wgmma
    reads: no proxy fence)."""
    NUM_STAGES: gl.constexpr = ready.shape[0]
    slot = step % NUM_STAGES
    mbarrier.wait(ready.index(slot), (step // NUM_STAGES) & 1)
    return slot


@gluon.jit
def drain_copies(ready, first_step, end_step, step):
    """Loader at ``step``, before it rewrites a descriptor that steps [first_step, end_step) copied through:
    waits until those copies landed. A bulk copy reads its descriptor from global memory when the copy engine
    runs it, not when the loader issues it, so a descriptor rewritten under an in-flight copy sends that copy to
    the new descriptor's columns (docs/design.md, 'Gluon ring protocol'). Steps before step - NUM_STAGES landed
    already (their slots were released before this loader acquired step - 1's), and none of the waited ready
    barriers has been re-armed since (the loader arms them, at step and later)."""
    NUM_STAGES: gl.constexpr = ready.shape[0]
    for j in range(gl.maximum(first_step, step - NUM_STAGES), end_step):
        mbarrier.wait(ready.index(j % NUM_STAGES), (j // NUM_STAGES) & 1)


@gluon.jit
def stage_out(acc, out_desc, c_smem, row, col, REDUCE: gl.constexpr):
    """acc through a staging tile (free: its last store has read it) to out_desc's tensor at (row, col) by one TMA
    store, or reduce-add (REDUCE; ``cp.reduce.async.bulk.tensor``). The caller waits for the copy
    (``tma.store_wait``) before it writes the tile again."""
    c_smem.store(acc.to(c_smem.dtype))
    fence_async_shared()
    thread_barrier()  # every thread's part is in shared memory before the one issuing thread copies
    if REDUCE:
        tma_reduce_add(out_desc, [row, col], c_smem)
    else:
        tma_store(out_desc, [row, col], c_smem)


@gluon.jit
def release_slot(empty, slot):
    """Consumer: done reading ``slot`` (its wgmmas drained)."""
    mbarrier.arrive(empty.index(slot), count=1)


# A function passed to a @gluon.jit helper arrives as a constexpr, which gl.warp_specialize does not take and a
# call unwraps: the partitions run these bodies.


@gluon.jit
def _loader_partition(fn: gl.constexpr, args):
    fn(*args)


@gluon.jit
def _consumer_partition(fn: gl.constexpr, args, HALF: gl.constexpr):
    fn(*args, HALF)


@gluon.jit
def warp_specialize_ring(
    loader: gl.constexpr, loader_args, consumer: gl.constexpr, consumer_args, CONSUMER_REGS: gl.constexpr
):
    """Runs ``loader(*loader_args)`` in the default partition and ``consumer(*consumer_args, HALF)`` in two
    warpgroups, HALF 0 and 1, with CONSUMER_REGS registers a thread each (setmaxnreg; the loader gets the rest
    of MAXNREG). Pass the argument tuples as literals at the call: a tuple bound to a variable first loses the
    constexpr-ness of its entries (triton 3.6)."""
    gl.warp_specialize(
        [
            (_loader_partition, (loader, loader_args)),
            (_consumer_partition, (consumer, consumer_args, 0)),
            (_consumer_partition, (consumer, consumer_args, 1)),
        ],
        [CONSUMER_WARPS, CONSUMER_WARPS],
        [CONSUMER_REGS, CONSUMER_REGS],
    )


@gluon.jit
def promoted_mainloop(
    step_fn: gl.constexpr, step_args, n_steps, step, partial, a_bufs, b_bufs, ready, empty, HALF: gl.constexpr
):  # fmt: skip
    """An FP8 consumer's K loop over one tile: n_steps ring steps from ``step`` on, each waiting for its slot,
    running ``acc, partial = step_fn(a, b_slot, slot, k, partial, acc, PART, *step_args)`` (wgmma into
    ``partial``, wait, promote into ``acc``) for each column part of the tile, and releasing the slot. ``a`` is
    this consumer's HALF of the slot's rows. A tile wider than ``partial`` (BLOCK_N 256) runs as two 128-column
    parts with their own accumulators: two 64 x 128 fp32 accumulators and one partial fit a warpgroup's
    registers, a 64 x 256 accumulator and its partial do not. Returns (acc0, acc1, partial, step); acc1 is
    zeros for a one-part tile."""
    SUB_M: gl.constexpr = partial.shape[0]
    SUB_N: gl.constexpr = partial.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    layout: gl.constexpr = partial.type.layout
    acc0 = gl.zeros([SUB_M, SUB_N], gl.float32, layout)
    acc1 = gl.zeros([SUB_M, SUB_N], gl.float32, layout)
    for k in range(n_steps):
        slot = wait_slot(ready, step)
        a = a_bufs.index(slot).slice(HALF * SUB_M, SUB_M)
        acc0, partial = step_fn(a, b_bufs.index(slot), slot, k, partial, acc0, 0, *step_args)
        if BLOCK_N > SUB_N:
            acc1, partial = step_fn(a, b_bufs.index(slot), slot, k, partial, acc1, 1, *step_args)
        release_slot(empty, slot)
        step += 1
    return acc0, acc1, partial, step


# The schedule: every partition computes it from group_sizes with the same clamping, so all see the same tiles.


@gluon.jit
def group_bounds(group_sizes_ptr, G, M, BLOCK_G: gl.constexpr):
    """(offs, starts, ends): ``schedule.clamped_group_bounds`` over an arange with this partition's layout
    (Gluon's arange needs one), int32 once clamped into [0, M] (M is an i32): these vectors stay live through
    the whole kernel, and int64 ones cost the consumers registers their accumulators need."""
    offs = gl.arange(0, BLOCK_G, layout=sched_layout(gl.num_warps()))
    starts, ends = clamped_group_bounds(group_sizes_ptr, offs, G, M)
    return offs, starts.to(gl.int32), ends.to(gl.int32)


@gluon.jit
def m_tile_space(group_sizes_ptr, G, M, n_tiles, BLOCK_M: gl.constexpr, BLOCK_G: gl.constexpr):
    """``group_bounds`` + ``schedule.row_tile_space``. Returns (offs, starts, ends, m_tiles, tile_ends,
    total_tiles) for ``schedule.locate_row_tile``."""
    offs, starts, ends = group_bounds(group_sizes_ptr, G, M, BLOCK_G)
    starts, ends, m_tiles, tile_ends, total_tiles = row_tile_space(offs, starts, ends, G, M, n_tiles, BLOCK_M)
    return offs, starts, ends, m_tiles, tile_ends, total_tiles
