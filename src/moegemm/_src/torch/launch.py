"""Kernel launches from PyTorch tensors: launch descriptions, and a direct path into compiled kernels.

``launch_m_grouped`` / ``launch_k_grouped`` assume validated inputs (``moegemm.torch.api`` checks them).

Why a direct path: ``JITFunction.run`` re-derives, on every call, the specialization of ~30 arguments
(pointer alignment, integer divisibility), a string cache key and the launch options. That cost
38-52 us per launch on the H100 host (docs/design.md, 'Direct launch'), more than a small grouped GEMM takes
on the GPU. ``DirectLaunch`` lets Triton bind the first call of each specialization as usual, keeps the
CompiledKernel it returns, and calls its launcher for later calls with the same key.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
from triton.runtime import _allocation

from moegemm._src import plan
from moegemm._src.kernels import combine as combine_kernels
from moegemm._src.kernels import k_grouped_ws as k_ws
from moegemm._src.kernels import split_k as split_k_kernels
from moegemm._src.kernels import stage_rows
from moegemm._src.kernels.gluon_hopper import TensorDescriptor
from moegemm._src.kernels.k_grouped import k_grouped_mm_kernel
from moegemm._src.kernels.m_grouped import m_grouped_mm_kernel

INTERPRET = bool(triton.knobs.runtime.interpret)
# Programs of a persistent launch under the interpreter: odd and small, so the stride loop is exercised.
INTERPRET_PROGRAMS = plan.INTERPRET.programs
# MOEGEMM_DIRECT_LAUNCH=0 sends every launch through JITFunction.run (plan.SWITCHES; read at import).
DIRECT_LAUNCH = plan.SWITCHES.direct_launch
# What this launcher passes (moegemm._src.plan.Capabilities): host descriptors, Triton's global scratch
# (_ensure_allocator), Gluon kernels where this Triton has them (compiled launches only), a workspace (the
# split-K partials).
CAPABILITIES = plan.Capabilities(
    host_descriptors=True, global_scratch=True, gluon=k_ws.supported() and not INTERPRET, workspace=True
)


@functools.cache
def _device_traits(index: int) -> plan.Target:
    props = torch.cuda.get_device_properties(index)
    target = "sm90" if (props.major, props.minor) == (9, 0) else "cuda"
    return plan.Target(target, props.name, props.multi_processor_count)


def _target(device: torch.device) -> plan.Target:
    if device.type == "cpu":
        return plan.INTERPRET
    return _device_traits(device.index if device.index is not None else torch.cuda.current_device())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Launch plans depend only on static facts (shapes, dtype, device, stride class, layout facts), so they are
# memoized here on the spec DirectLaunch keys on; plan.constrain clears them (plan.on_change below).
@functools.lru_cache(maxsize=4096)
def _m_launch(
    M, N, K, G, dtype, device, max_stride, w_k_contiguous, has_bias, tma_store, tma_load, rows_aligned=False,
    load_pad=1,
) -> plan.Plan:  # fmt: skip
    """tma_store: out's layout takes a TMA descriptor; tma_load: x's and w's do (launch_m_grouped checks
    both); rows_aligned: x's, w's and out's rows are 16-byte aligned with unit inner strides (half-high
    tiles may run); load_pad: x and w were staged into rows zero-padded to that many elements. The plan
    decides what the launch takes."""
    problem = plan.Problem(
        plan.M_GROUPED,
        M,
        N,
        K,
        G,
        _dtype_name(dtype),
        max_stride=max_stride,
        w_k_contiguous=w_k_contiguous,
        has_bias=has_bias,
        rows_aligned=rows_aligned,
        tma_store_layout=tma_store,
        tma_load_layout=tma_load,
        load_pad=load_pad,
    )
    return plan.plan(problem, _target(device), CAPABILITIES)


def _ws_device(device: torch.device) -> bool:
    """Whether the warp-specialized kernels run here: Gluon present, an sm90 GPU (wgmma, setmaxnreg)."""
    return device.type == "cuda" and CAPABILITIES.gluon and _target(device).name == "sm90"


@functools.lru_cache(maxsize=4096)
def _k_launch(
    M,
    N,
    K,
    G,
    dtype,
    device,
    max_stride,
    a_k_contiguous,
    accumulate,
    a_colsum,
    out_itemsize,
    tma_store,
    tma_load,
    load_pad=1,
) -> plan.Plan:
    """The Triton kernel's plan. tma_store: out's layout takes a TMA descriptor; tma_load: a's and b's do
    (launch_k_grouped checks both); load_pad: a and b were staged into rows zero-padded to that many
    elements."""
    problem = plan.Problem(
        plan.K_GROUPED,
        M,
        N,
        K,
        G,
        _dtype_name(dtype),
        out_itemsize=out_itemsize,
        max_stride=max_stride,
        a_k_contiguous=a_k_contiguous,
        accumulate=accumulate,
        a_colsum=a_colsum,
        tma_store_layout=tma_store,
        tma_load_layout=tma_load,
        load_pad=load_pad,
    )
    return plan.plan(problem, _target(device), CAPABILITIES)


@functools.lru_cache(maxsize=4096)
def _k_ws_launch(M, N, K, G, dtype, device, stride_am, stride_bm) -> plan.Plan | None:
    """The warp-specialized wgrad's plan (out [G, K, N] = a^T b per group) for a launch whose out and
    operands take descriptors, out contiguous in their dtype, no column sums; None where the plan keeps the
    Triton kernel. Static facts only."""
    problem = plan.Problem(
        plan.K_GROUPED,
        M,
        N,
        K,
        G,
        _dtype_name(dtype),
        out_itemsize=dtype.itemsize,
        max_stride=max(abs(stride_am), abs(stride_bm), K * N),
        tma_store_layout=True,
        tma_load_layout=True,
        ws_layout=True,
        row_strides=(stride_am, stride_bm),
    )
    chosen = plan.plan(problem, _target(device), CAPABILITIES)
    return chosen if chosen.kernel == "k_grouped_ws" else None


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's global scratch for a launch (tensor maps a kernel makes on the device): from the
    caching allocator on the current device, O(programs) bytes, released when the launch returns
    (stream-ordered, so graph capture and later kernels on the stream are safe)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Installs _scratch as Triton's allocator where this thread's context has none (a caller's own
    allocator stays). Per thread: autograd runs the backward on threads of its own."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


class DirectLaunch:
    """One @triton.jit kernel whose tensor arguments come first, then integers, then meta-parameters.

    ``launch(spec, tensors, ints, describe)``: ``spec`` is a hashable summary of everything the launch
    description depends on, ``describe()`` builds that description (grid and meta) on a miss. The key
    of a bound launch is what Triton specializes on: spec, the integer values, and each tensor's dtype
    and 16-byte alignment. Anything else (the interpreter, a launch hook such as a profiler's, the
    switch above) takes JITFunction.run. Not tracked: Triton debug/instrumentation knobs changed after
    a specialization was bound (``clear_launch_cache()`` forgets the bindings).
    """

    MAX_ENTRIES = 4096

    def __init__(self, kernel, descriptors: bool = False) -> None:
        """descriptors: some tensor arguments are TensorDescriptors (TMA kernels), keyed by their base
        tensor; only such launches pay for looking the bases up."""
        self.kernel = kernel
        self.descriptors = descriptors
        self.bound: dict[tuple, tuple] = {}

    def clear(self) -> None:
        self.bound.clear()

    def _direct(self) -> bool:
        knobs = triton.knobs.runtime
        return (
            DIRECT_LAUNCH
            and not INTERPRET
            and not _hooked(knobs.launch_enter_hook)
            and not _hooked(knobs.launch_exit_hook)
        )

    def launch(self, spec: tuple, tensors: tuple, ints: tuple, describe) -> None:
        device = tensors[-1].device  # the output: a tensor, where the first may be a TensorDescriptor
        direct = self._direct()
        if direct:
            # One flat tuple: hashing it is most of the hit path's cost.
            # A TensorDescriptor (TMA kernels) is keyed by its base tensor; its shapes are in spec.
            bases = [getattr(t, "base", t) for t in tensors] if self.descriptors else tensors
            aligned = sum(1 << i for i, t in enumerate(bases) if t.data_ptr() % 16 == 0)
            key = (*spec, *ints, aligned, *[t.dtype for t in bases])
            entry = self.bound.get(key)
            if entry is not None:
                run, function, packed_metadata, (grid_0, grid_1, grid_2), constexprs = entry
                with _device_guard(device):
                    run(
                        grid_0,
                        grid_1,
                        grid_2,
                        current_stream(device.index),
                        function,
                        packed_metadata,
                        None,
                        None,
                        None,
                        *tensors,
                        *ints,
                        *constexprs,
                    )
                return
        launch = describe()
        with _device_guard(device):
            compiled = self.kernel[launch.grid](*tensors, *ints, **launch.meta)
        if direct and getattr(compiled, "function", None) is not None:
            if len(self.bound) >= self.MAX_ENTRIES:
                self.bound.clear()
            # The meta-parameters follow the tensors and ints (which may hold constexprs of their own).
            constexprs = tuple(launch.meta[p.name] for p in self.kernel.params[len(tensors) + len(ints) :])
            self.bound[key] = (
                compiled.run,
                compiled.function,
                compiled.packed_metadata,
                (*launch.grid, 1, 1)[:3],
                constexprs,
            )


def _hooked(hook) -> bool:
    """A launch hook is installed: None, or (triton >= 3.5) an empty HookChain, means none."""
    return hook is not None and bool(getattr(hook, "calls", True))


def current_stream(index: int) -> int:
    """The raw handle of the current CUDA stream on device ``index`` (what Triton's driver reads)."""
    return torch._C._cuda_getCurrentRawStream(index)


def _device_guard(device: torch.device):
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


M_GROUPED = DirectLaunch(m_grouped_mm_kernel)
STAGE_ROWS = DirectLaunch(stage_rows.stage_rows_kernel)
SPLIT_REDUCE = DirectLaunch(split_k_kernels.reduce_kernel)
COMBINE = DirectLaunch(combine_kernels.combine_kernel)
GATHER_ROWS = DirectLaunch(combine_kernels.gather_rows_kernel)
K_GROUPED = DirectLaunch(k_grouped_mm_kernel)
K_GROUPED_WS = DirectLaunch(k_ws.k_grouped_mm_ws_kernel, descriptors=True)


def clear_launch_cache() -> None:
    """Forget memoized and bound launches (after the config cache or pick_config changed, e.g. while tuning)."""
    _m_launch.cache_clear()
    _k_launch.cache_clear()
    _fused_launch.cache_clear()
    _k_ws_launch.cache_clear()
    M_GROUPED.clear()
    STAGE_ROWS.clear()
    SPLIT_REDUCE.clear()
    COMBINE.clear()
    GATHER_ROWS.clear()
    K_GROUPED.clear()
    K_GROUPED_WS.clear()


plan.on_change(clear_launch_cache)


def _unit_axis(t: torch.Tensor, axes: int = 1) -> int | None:
    """The axis a kernel reads t's rows along: of t's last ``axes`` axes, the first from the end with stride 1
    (None: none; x, a and b are read along their last axis only, w along either of its last two)."""
    for axis in range(t.dim() - 1, t.dim() - 1 - axes, -1):
        if t.shape[axis] > 0 and t.stride(axis) == 1:
            return axis
    return None


def _misaligned(t: torch.Tensor, pad: int, axes: int = 1) -> bool:
    """Whether t's rows along its unit-stride axis (``_unit_axis``) are not 16-byte aligned (``pad``
    elements): the extent, an outer stride or the base (docs/design.md, 'Unaligned rows'). A tensor without
    such an axis is read as it is."""
    axis = _unit_axis(t, axes)
    if axis is None:
        return False
    if t.shape[axis] % pad or t.data_ptr() % 16:
        return True
    return any(t.stride(d) % pad for d in range(t.dim()) if d != axis and t.shape[d] > 1)


class _ReduceLaunch:
    """The launch description of one split_k.reduce_kernel launch: R rows of N, grouped by group_rows (0:
    none) into out's strides (group, row, column)."""

    def __init__(self, R: int, N: int, group_rows: int, strides: tuple[int, int, int], split: int) -> None:
        self.grid = split_k_kernels.grid(R, N)
        self.meta = dict(
            N=N,
            GROUP_ROWS=group_rows,
            stride_og=strides[0],
            stride_or=strides[1],
            stride_on=strides[2],
            SPLIT=split,
            BLOCK_R=split_k_kernels.BLOCK_R,
            BLOCK_N=split_k_kernels.BLOCK_N,
            num_warps=split_k_kernels.NUM_WARPS,
        )


def _reduce_splits(partials: torch.Tensor, out: torch.Tensor, group_rows: int, strides: tuple) -> None:
    """out = partials.sum(0) in order, through split_k.reduce_kernel (partials [split, R, N] fp32)."""
    split, R, N = partials.shape
    SPLIT_REDUCE.launch(
        ("reduce", R, N, group_rows, strides, split, out.dtype, out.device),
        (partials, out),
        (R,),
        lambda: _ReduceLaunch(R, N, group_rows, strides, split),
    )


class _StageLaunch:
    """The launch description of one stage_rows_kernel launch (what DirectLaunch's describe returns)."""

    def __init__(self, rows: int, c: int, c_pad: int) -> None:
        self.grid = stage_rows.grid(rows, c_pad)
        self.meta = dict(
            C=c,
            C_PAD=c_pad,
            BLOCK_R=stage_rows.BLOCK_R,
            BLOCK_C=stage_rows.BLOCK_C,
            num_warps=stage_rows.NUM_WARPS,
        )


def _staged(t: torch.Tensor, pad: int, axes: int = 1) -> torch.Tensor:
    """t, whose rows ``_misaligned`` found not 16-byte aligned, copied into rows zero-padded to a multiple of
    ``pad`` elements along its unit-stride axis (16-byte aligned rows and base) by one stage_rows_kernel
    launch, returned as a view of t's shape (the padding lies past each row's end, where the kernels' LOAD_PAD
    masks read it). The outer axes are walked from t's sizes and strides: views of t would cost host time per
    call."""
    axis = _unit_axis(t, axes)
    shape, stride = t.shape, t.stride()
    outer = [d for d in range(t.dim()) if d != axis]  # one or two axes: x, a, b [rows, C]; w [G, rows, C]
    C = shape[axis]
    c_pad = -(-C // pad) * pad
    B, sb = (shape[outer[0]], stride[outer[0]]) if len(outer) == 2 else (1, 0)
    R, sr = shape[outer[-1]], stride[outer[-1]]
    buf = torch.empty(B * R * c_pad, dtype=t.dtype, device=t.device)
    if B * R:
        STAGE_ROWS.launch(
            (C, c_pad, t.dtype, t.device), (t, buf), (B * R, R, sb, sr), lambda: _StageLaunch(B * R, C, c_pad)
        )
    view = [0] * t.dim()
    view[axis], view[outer[-1]] = 1, c_pad
    if len(outer) == 2:
        view[outer[0]] = R * c_pad
    return buf.as_strided(shape, view)


def launch_m_grouped(x, w, group_sizes, out, bias=None, transpose_w: bool = False) -> None:
    """out [M, N] = for g: x[rows(g)] @ W[g] (+ bias[g]); bias [G, N] in x's dtype or None.

    W = w [G, K, N], or with ``transpose_w`` w is [G, N, K] (an nn.Linear weight as stored) read
    transposed, without making the w.mT view: a view of a parameter costs several us of host time.
    """
    M, K = x.shape
    N = w.shape[1] if transpose_w else w.shape[2]
    if M == 0 or N == 0:
        return
    # Rows that are not 16-byte aligned are staged into padded ones (plan.stage_rows).
    pad = 16 // x.element_size()
    x_staged, w_staged = _misaligned(x, pad), _misaligned(w, pad, 2)
    staged = (x.numel() if x_staged else 0) + (w.numel() if w_staged else 0)
    w_k_unit = (w.stride(2) if transpose_w else w.stride(1)) == 1  # the forward's nn.Linear weight, as stored
    load_pad = plan.stage_rows(
        staged * x.element_size() if K > 0 else 0,
        M,
        N,
        K,
        w.shape[0],
        x.element_size(),
        k_contiguous_weight=w_k_unit and K > 1,
    )
    if load_pad > 1:
        x = _staged(x, load_pad) if x_staged else x
        w = _staged(w, load_pad, 2) if w_staged else w
    if transpose_w:
        G = w.shape[0]
        sw_g, sw_n, sw_k = w.stride()
        sw = (sw_g, sw_k, sw_n)
    else:
        G = w.shape[0]
        sw = w.stride()
    sx, so = x.stride(), out.stride()
    sb = (0, 0) if bias is None else bias.stride()
    w_k_contiguous = sw[1] == 1 and sw[2] != 1
    w_rows, w_row_stride = (N, sw[2]) if w_k_contiguous else (K, sw[1])
    tma_store = tma_load = False
    if plan.tma_candidate(M, N, K, G):  # the plan's size gate first: data pointers cost host time
        # The kernel's TMA descriptor over out (m_grouped._clipped_out_desc): N contiguous, the row stride and
        # the base 16-byte aligned.
        tma_store = out.element_size() == 2 and so[1] == 1 and so[0] % 8 == 0 and out.data_ptr() % 16 == 0
        # Descriptors over x [M, K] and w's 2-D view ([G * N, K] or [G * K, N]): unit inner strides, 16-byte row
        # strides and bases, the experts back to back (one expert: any group stride); the plan checks the
        # sizes (nonzero extents, int32 coordinates, the K-tail rule: m_grouped.tma_load_fits).
        tma_load = (
            sx[1] == 1
            and sx[0] % 8 == 0
            and (w_k_contiguous or sw[2] == 1)
            and w_row_stride % 8 == 0
            and (G == 1 or sw[0] == w_rows * w_row_stride)
            and x.data_ptr() % 16 == 0
            and w.data_ptr() % 16 == 0
        )
    # Half-high tail tiles only where every row is 16-byte aligned (m_grouped.half_tiles_fit says why).
    rows_aligned = (
        sx[1] == 1
        and so[1] == 1
        and (w_k_contiguous or sw[2] == 1)
        and (sx[0] | w_row_stride | so[0]) * x.element_size() % 16 == 0
    )
    spec = (
        M,
        N,
        K,
        G,
        x.dtype,
        x.device,
        max(map(abs, (*sx, sw[1], sw[2], *so, sb[1]))),
        w_k_contiguous,
        bias is not None,
        tma_store,
        tma_load,
        rows_aligned,
        load_pad,
    )
    b = x if bias is None else bias
    chosen = _m_launch(*spec)
    split_k = chosen.meta["SPLIT_K"]
    dst = out
    if split_k > 1:  # fp32 partials [split_k, M, N], summed into out after (plan._split_k)
        dst = torch.empty((split_k, M, N), dtype=torch.float32, device=out.device)
    ints = (M, N, K, G, G, *sx, *sw, *((N, 1) if split_k > 1 else so), *sb)
    if chosen.scratch:
        _ensure_allocator()  # descriptors made in the kernel: Triton allocates their scratch
    # No group offset (HAS_GROUP_OFFSET=False): the kernel never reads that slot; group_sizes fills it.
    # The expert block's pointers (gather, act, row_scale, act_out, ds) are not read without its options.
    M_GROUPED.launch(
        spec, (x, w, group_sizes, group_sizes, b, group_sizes, x, x, x, x, dst), ints, lambda: chosen
    )
    if split_k > 1:
        _reduce_splits(dst, out, 0, (0, *so))


# SMs the expert block's launches leave free while collectives run beside them (``reserved_sms``; docs/design.md,
# 'Expert parallelism'): a persistent launch sized to every SM would wait for the SMs NCCL's kernels hold.
_reserved_sms = 0


@contextlib.contextmanager
def reserved_sms(count: int):
    """Within the block, the expert block's launches (``launch_m_grouped_fused``, ``launch_k_grouped_fused``) size
    their persistent grids to the SM count less ``count``."""
    global _reserved_sms
    before, _reserved_sms = _reserved_sms, count
    try:
        yield
    finally:
        _reserved_sms = before


@functools.lru_cache(maxsize=1024)
def _fused_launch(
    op,
    M,
    N,
    K,
    G,
    dtype,
    device,
    max_stride,
    k_contiguous,
    gather,
    epilogue,
    tma_load=False,
    fill_tail=True,
    reserved=0,
) -> plan.Plan:
    """The plan of one of the expert block's launches (``launch_m_grouped_fused``, ``launch_k_grouped_fused``):
    k_contiguous is w's (m-grouped) or a's (k-grouped) K stride being 1; tma_load: w's layout takes a descriptor
    (m-grouped; gathered x rows never do); reserved: SMs the persistent grid leaves free (``reserved_sms``)."""
    problem = plan.Problem(
        op,
        M,
        N,
        K,
        G,
        _dtype_name(dtype),
        out_itemsize=dtype.itemsize,
        max_stride=max_stride,
        w_k_contiguous=k_contiguous if op == plan.M_GROUPED else False,
        a_k_contiguous=k_contiguous if op == plan.K_GROUPED else True,
        gather=gather,
        epilogue=epilogue,
        tma_load_layout=tma_load,
        fill_tail=fill_tail,
    )
    target = _target(device)
    if reserved and target.name != "interpret":
        target = target._replace(programs=max(1, target.programs - reserved))
    return plan.plan(problem, target, CAPABILITIES)


def _contiguous(name: str, t: torch.Tensor | None) -> None:
    if t is not None and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def launch_m_grouped_fused(
    x,
    w,
    group_sizes,
    out,
    *,
    gather=None,
    epilogue="",
    act=None,
    row_scale=None,
    act_out=None,
    fill_tail=True,
) -> torch.Tensor | None:
    """The expert block's m-grouped launches (docs/design.md, 'Fused expert block'), W = w [G, K, N] (any
    strides; an nn.Linear-layout weight [G, N, K] passed as its .mT view), M = out's rows:

    - ``for g: out[rows(g)] = x[gather[rows(g)]] @ W[g]`` with ``gather`` int32 [M] (else x's own rows);
    - epilogue "swiglu": N = 2n, act [M, 2n] = z = that product, out [M, n] = silu(z[:, :n]) * z[:, n:];
    - epilogue "swiglu_bwd": the product is dh [M, n]; from act = z [M, 2n] and row_scale s [M] (fp32) it writes
      out [M, 2n] = dz, act_out [M, n] = s * h, and returns ds [cdiv(n, BLOCK_N), M] fp32, the per-column-tile
      sums of dh * h (BLOCK_N is the plan's; None for the other epilogues).
    act, out (with "swiglu_bwd") and act_out are contiguous. ``fill_tail=False``: out's (and act's, act_out's)
    rows past sum(group_sizes) are left as they are (docs/design.md, 'Expert parallelism')."""
    M = out.shape[0]
    G, K, N = w.shape
    sw, sx, so = w.stride(), x.stride(), out.stride()
    for name, t in (("act", act), ("act_out", act_out)):
        _contiguous(name, t)
    if epilogue == "swiglu_bwd":
        _contiguous("out", out)
    w_k_contiguous = sw[1] == 1 and sw[2] != 1
    tma_load = False
    x_descriptor = gather is not None or (
        sx[1] == 1 and sx[0] % (16 // x.element_size()) == 0 and x.data_ptr() % 16 == 0
    )
    if x_descriptor and plan.tma_candidate(M, N, K, G):
        # w through a descriptor the kernel makes (as launch_m_grouped checks it): unit inner stride, 16-byte row
        # stride and base, the experts back to back; x's gathered rows take pointer loads, x's own rows the
        # descriptor when their layout takes one.
        w_rows, w_row_stride = (N, sw[2]) if w_k_contiguous else (K, sw[1])
        tma_load = (
            (w_k_contiguous or sw[2] == 1)
            and w_row_stride % 8 == 0
            and (G == 1 or sw[0] == w_rows * w_row_stride)
            and w.data_ptr() % 16 == 0
        )
    spec = (
        plan.M_GROUPED,
        M,
        N,
        K,
        G,
        x.dtype,
        x.device,
        max(map(abs, (*sx, sw[1], sw[2], *so))),
        w_k_contiguous,
        ("x",) if gather is not None else (),
        epilogue,
        tma_load,
        fill_tail,
        _reserved_sms,
    )
    chosen = _fused_launch(*spec)
    ds = None
    if epilogue == "swiglu_bwd":
        ds = torch.empty(triton.cdiv(N, chosen.meta["BLOCK_N"]), M, dtype=torch.float32, device=out.device)
    if M == 0 or N == 0:
        return ds
    tensors = (
        x,
        w,
        group_sizes,
        group_sizes,
        x,  # no bias
        group_sizes if gather is None else gather,
        x if act is None else act,
        x if row_scale is None else row_scale,
        x if act_out is None else act_out,
        x if ds is None else ds,
        out,
    )
    ints = (M, N, K, G, G, *sx, *sw, *so, 0, 0)
    if chosen.scratch:
        _ensure_allocator()  # w's descriptor is made in the kernel: Triton allocates its scratch
    M_GROUPED.launch(spec, tensors, ints, lambda: chosen)
    return ds


class _CombineLaunch:
    """The launch description of one combine_kernel launch."""

    def __init__(self, T: int, D: int, top_k: int, stride_rm: int, stride_om: int, has_weight: bool) -> None:
        self.grid = combine_kernels.grid(T, D)
        self.meta = dict(
            D=D,
            TOP_K=top_k,
            stride_rm=stride_rm,
            stride_om=stride_om,
            HAS_WEIGHT=has_weight,
            BLOCK_T=combine_kernels.BLOCK_T,
            BLOCK_D=combine_kernels.BLOCK_D,
            num_warps=combine_kernels.NUM_WARPS,
        )


def launch_combine(rows, pos, weight, out) -> None:
    """out [T, D] = for t: sum_j weight[t, j] * rows[pos[t, j]] (weight None: 1), j in order; rows [R, D], pos
    [T, k] int32 contiguous, weight [T, k] contiguous; unit column strides."""
    T, top_k = pos.shape
    R, D = rows.shape
    if T == 0 or D == 0:
        return
    if R == 0:  # no rows to read (k = 0): every token sums nothing
        out.zero_()
        return
    _contiguous("pos", pos)
    _contiguous("weight", weight)
    if rows.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(
            f"combine: rows and out need unit column strides, got {rows.stride()} and {out.stride()}"
        )
    spec = (
        "combine",
        D,
        top_k,
        rows.stride(0),
        out.stride(0),
        weight is not None,
        rows.dtype,
        out.dtype,
        out.device,
    )
    COMBINE.launch(
        spec,
        (rows, pos, pos if weight is None else weight, out),
        (T, R),
        lambda: _CombineLaunch(T, D, top_k, rows.stride(0), out.stride(0), weight is not None),
    )


class _GatherRowsLaunch:
    """The launch description of one gather_rows_kernel launch."""

    def __init__(self, R: int, D: int, G: int, stride_sm: int, stride_om: int) -> None:
        self.grid = combine_kernels.gather_rows_grid(R, D)
        self.meta = dict(
            D=D,
            stride_sm=stride_sm,
            stride_om=stride_om,
            BLOCK_G=max(16, triton.next_power_of_2(G)),
            BLOCK_R=combine_kernels.GATHER_BLOCK_R,
            BLOCK_D=combine_kernels.GATHER_BLOCK_D,
            num_warps=4,
        )


def launch_gather_rows(src, index, group_sizes, out) -> None:
    """out [R, D] rows r < sum(group_sizes) = src[index[r]]; the rows past them are left as they are. src [S, D],
    index [R] int32 contiguous, unit column strides (the expert-parallel wgrads' row copies; docs/design.md,
    'Expert parallelism')."""
    (S, D), (R,), G = src.shape, index.shape, group_sizes.shape[0]
    if R == 0 or D == 0 or S == 0 or G == 0:
        return
    _contiguous("index", index)
    if src.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(
            f"gather_rows: src and out need unit column strides, got {src.stride()} and {out.stride()}"
        )
    spec = ("gather_rows", D, G, src.stride(0), out.stride(0), src.dtype, out.device)
    GATHER_ROWS.launch(
        spec,
        (src, index, group_sizes, out),
        (S, R, G),
        lambda: _GatherRowsLaunch(R, D, G, src.stride(0), out.stride(0)),
    )


def launch_k_grouped_fused(a, b, group_sizes, out, *, gather_a=None, gather_b=None) -> None:
    """The expert block's wgrads: ``for g: out[g] = A[rows(g)]^T @ B[rows(g)]``, out [G, K, N], where A's row r is
    a[gather_a[r]] (else a[r]) and B's likewise; M = the rows (the gather's length, else a's). Groups with no rows
    get exact zeros."""
    M = gather_a.shape[0] if gather_a is not None else a.shape[0]
    K, N = a.shape[1], b.shape[1]
    G = group_sizes.shape[0]
    sa, sb, so = a.stride(), b.stride(), out.stride()
    gather = (("a",) if gather_a is not None else ()) + (("b",) if gather_b is not None else ())
    spec = (
        plan.K_GROUPED,
        M,
        N,
        K,
        G,
        a.dtype,
        a.device,
        max(map(abs, (*sa, *sb, so[1], so[2]))),
        sa[1] == 1 and sa[0] != 1,
        gather,
        "",
        False,
        True,
        _reserved_sms,
    )
    if G == 0 or K == 0 or N == 0:
        return
    chosen = _fused_launch(*spec)
    split = chosen.meta["SPLIT_R"]
    dst = out
    if split > 1:
        dst = torch.empty((split, G, K, N), dtype=torch.float32, device=out.device)
    tensors = (
        a,
        b,
        group_sizes,
        group_sizes,
        dst,
        dst,  # no column sums
        group_sizes if gather_a is None else gather_a,
        group_sizes if gather_b is None else gather_b,
        dst,
    )
    K_GROUPED.launch(
        spec, tensors, (M, N, K, G, G, *sa, *sb, *((K * N, N, 1) if split > 1 else so), 0, 0), lambda: chosen
    )
    if split > 1:
        _reduce_splits(dst.view(split, G * K, N), out, K, so)


# Out dtypes of the TMA-store descriptors (the BF16 wgrad's 2-byte out; the FP8 wgrad's fp32 or 2-byte dW).
_GL_DTYPES = (
    {torch.bfloat16: k_ws.gl.bfloat16, torch.float16: k_ws.gl.float16, torch.float32: k_ws.gl.float32}
    if k_ws.supported()
    else {}
)


@functools.cache
def _nvmma_layout(rows: int, cols: int, dtype):
    return k_ws.gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


def launch_k_grouped(a, b, group_sizes, out, accumulate: bool, a_colsum=None) -> None:
    """out [G, K, N] (+)= for g: a[rows(g)]^T @ b[rows(g)]; a_colsum [G, K] (or None) = sum(a[rows(g)], 0)."""
    M, K = a.shape
    N = b.shape[1]
    G = group_sizes.shape[0]
    if G == 0 or K == 0 or (N == 0 and a_colsum is None):
        return
    # Rows that are not 16-byte aligned are staged into padded ones (plan.stage_rows).
    pad = 16 // a.element_size()
    a_staged, b_staged = _misaligned(a, pad), _misaligned(b, pad)
    staged = (a.numel() if a_staged else 0) + (b.numel() if b_staged else 0)
    load_pad = plan.stage_rows(staged * a.element_size() if M > 0 else 0, M, N, K, G, a.element_size())
    if load_pad > 1:
        a = _staged(a, load_pad) if a_staged else a
        b = _staged(b, load_pad) if b_staged else b
    sa, sb, so = a.stride(), b.stride(), out.stride()
    ss = (0, 0) if a_colsum is None else a_colsum.stride()
    tma_store = tma_load = False
    if plan.tma_candidate(M, N, K, G):  # the plan's size gate first: data pointers cost host time
        # The kernel's TMA descriptor over out [G, K, N] (k_grouped._out_desc): N contiguous, the other strides
        # and the base 16-byte aligned (the plan checks accumulation and N > 0).
        tma_store = (
            out.element_size() == 2
            and so[2] == 1
            and so[0] % 8 == 0
            and so[1] % 8 == 0
            and out.data_ptr() % 16 == 0
        )
        # Descriptors over a [rows, K] and b [rows, N]: unit column strides, 16-byte row strides and bases (the
        # plan checks 0 < M < 2**31: an empty a's base is null, and the kernel's row coordinates are int32).
        tma_load = (
            sa[1] == 1
            and sb[1] == 1
            and sa[0] % 8 == 0
            and sb[0] % 8 == 0
            and a.data_ptr() % 16 == 0
            and b.data_ptr() % 16 == 0
        )
    # The warp-specialized kernel where both TMA paths apply, out is contiguous in a's dtype, and no column sums
    # (the plan decides: plan._plan_k_ws).
    if (
        tma_store
        and tma_load
        and a_colsum is None
        and not accumulate
        and out.dtype == a.dtype == b.dtype
        and so == (K * N, N, 1)
    ):
        ws_plan = _k_ws_launch(M, N, K, G, a.dtype, a.device, sa[0], sb[0])
        if ws_plan is not None:
            _ensure_allocator()  # the loader's descriptors live in Triton's global scratch
            # out's descriptor stays on the host (~10 us of host time a launch): made in the consumers it cost up
            # to 3-6% of device time on short-group launches (docs/design.md, 'Warp-specialized wgrad').
            block = [k_ws.BLOCK_K // 2, ws_plan.meta["BLOCK_N"]]
            layout = _nvmma_layout(*block, _GL_DTYPES[out.dtype])
            out_desc = TensorDescriptor(out.view(G * K, N), [G * K, N], [N, 1], block, layout)
            K_GROUPED_WS.launch(
                ("ws", M, N, K, G, a.dtype, a.device, sa[0], sb[0]),
                (out_desc, a, b, group_sizes),
                (M, K, N, G, sa[0], sb[0]),
                lambda: ws_plan,
            )
            return
    spec = (
        M,
        N,
        K,
        G,
        a.dtype,
        a.device,
        max(map(abs, (*sa, *sb, so[1], so[2], ss[1]))),
        sa[1] == 1 and sa[0] != 1,
        accumulate,
        a_colsum is not None,
        out.element_size(),
        tma_store,
        tma_load,
        load_pad,
    )
    colsum = out if a_colsum is None else a_colsum
    chosen = _k_launch(*spec)
    split = chosen.meta["SPLIT_R"]
    dst = out
    if split > 1:  # fp32 partials [split, G, K, N], summed into out after (plan._split_r)
        dst = torch.empty((split, G, K, N), dtype=torch.float32, device=out.device)
    if chosen.scratch:
        _ensure_allocator()  # descriptors made in the kernel: Triton allocates their scratch
    K_GROUPED.launch(
        spec,
        (a, b, group_sizes, group_sizes, dst, colsum, group_sizes, group_sizes, dst),
        (M, N, K, G, G, *sa, *sb, *((K * N, N, 1) if split > 1 else so), *ss),
        lambda: chosen,
    )
    if split > 1:
        _reduce_splits(dst.view(split, G * K, N), out, K, so)
