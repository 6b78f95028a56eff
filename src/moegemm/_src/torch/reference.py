"""The private half of the PyTorch twins (``moegemm.torch.reference`` holds the public ones).

- group geometry: the clamped row bounds of each group, as the kernels compute them;
- column sums per group (the bias gradient's twin);
- FP8: the quantize twins, which reproduce the quantize kernels bit for bit (the same fp32 amax,
  division and round-to-nearest-even cast), and dequantization (``moegemm._src.fp8`` layouts).
  Dequantization runs without a host sync (searchsorted over the group ends), so
  ``Fp8Tensor.dequantize`` uses it on any device; the other twins sync (``group_sizes.tolist()``).
"""

from __future__ import annotations

import torch

from moegemm._src import fp8, layout


def group_bounds(group_sizes: torch.Tensor, M: int) -> list[tuple[int, int]]:
    """[(start_g, end_g)] of device or host sizes (one sync); see moegemm._src.layout for the rule."""
    return layout.group_bounds(group_sizes.tolist(), M)


def exact_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 products of 16-bit inputs are exact (even as TF32 on a GPU); fp32 inputs need fp64 for that."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def grouped_column_sums(
    a: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """a [M, K] -> [G, K]; for g: out[g] = sum(a[rows(g)], 0) (the bias gradient when a is dy)."""
    compute_dtype = compute_dtype or exact_dtype(a.dtype)
    out = torch.zeros(group_sizes.shape[0], a.shape[1], dtype=compute_dtype, device=a.device)
    for g, (start, end) in enumerate(group_bounds(group_sizes, a.shape[0])):
        out[g] = a[start:end].to(compute_dtype).sum(0)
    return out.to(out_dtype)


# ---------------------------------------------------------------- FP8


def _fp8_max(dtype: torch.dtype) -> float:
    return fp8.FP8_MAX[str(dtype).removeprefix("torch.")]


def scale_of(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """amax / FP8_MAX in fp32; 1 where amax is 0 (the kernels' rule)."""
    amax = amax.float()
    # Divided by a tensor: on CUDA, torch divides by a Python scalar as a multiply by its reciprocal
    # (1 ulp off the kernels' correctly rounded division).
    return torch.where(amax > 0, amax / torch.full_like(amax, _fp8_max(dtype)), torch.ones_like(amax))


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """The quantization multiplier: 1 / scale correctly rounded, capped at the largest finite fp32 (the
    kernels' ``_inv``)."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    return (torch.ones_like(scale) / scale).clamp(max=torch.finfo(torch.float32).max)


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """clamp(x * inverse(scale)) in ``dtype``, round-to-nearest-even."""
    m = _fp8_max(dtype)
    return (x.float() * inverse(scale)).clamp(-m, m).to(dtype)


# ---------------------------------------------------------------- group geometry (no host sync)


def row_groups(group_sizes: torch.Tensor | None, M: int, device) -> tuple[torch.Tensor, ...]:
    """(group index of each row (G for rows past the last group), starts [G], ends [G]) as the kernels
    clamp them, computed on the device."""
    if group_sizes is None:
        rows = torch.zeros(M, dtype=torch.int64, device=device)
        return rows, torch.zeros(1, dtype=torch.int64, device=device), torch.full((1,), M, device=device)
    sizes = group_sizes.to(torch.int64).clamp(0, M)
    ends_unclamped = sizes.cumsum(0)
    starts = (ends_unclamped - sizes).clamp(max=M)
    ends = ends_unclamped.clamp(max=M)
    rows = torch.searchsorted(ends, torch.arange(M, device=device), right=True)
    return rows, starts, ends


def transposed_columns_of_rows(
    group_sizes, M: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(column of each row in data_t (0 for unowned rows), the row's group, its 128-row block index)."""
    rows, starts, ends = row_groups(group_sizes, M, device)
    sizes = ends - starts
    units = -(-sizes // fp8.ROW_ALIGN)
    t_start = (units.cumsum(0) - units) * fp8.ROW_ALIGN
    blocks = -(-sizes // fp8.SCALE_BLOCK)
    block_base = blocks.cumsum(0) - blocks
    owned = rows < sizes.shape[0]
    g = rows.clamp(max=sizes.shape[0] - 1)
    local = torch.arange(M, device=device) - starts[g]
    cols = torch.where(owned, t_start[g] + local, 0)
    return cols, torch.where(owned, rows, sizes.shape[0]), block_base[g] + local // fp8.SCALE_BLOCK


def gathered_t_bytes(x_q, gather, group_sizes) -> torch.Tensor:
    """The twin of ``ops.gathered_t_bytes``: x_q[gather]'s bytes in data_t's columns, zeros elsewhere."""
    R, G = gather.shape[0], group_sizes.shape[0]
    rows = x_q.view(torch.uint8).index_select(0, gather.long())
    cols, g, _ = transposed_columns_of_rows(group_sizes, R, x_q.device)
    data_t = torch.zeros(x_q.shape[1], fp8.transposed_columns(R, G), dtype=torch.uint8, device=x_q.device)
    owned = g < G
    data_t[:, cols[owned]] = rows[owned].T
    return data_t.view(x_q.dtype)


def _blocks(scale: torch.Tensor, dims: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for dim, size in zip(dims, sizes):
        scale = scale.repeat_interleave(fp8.SCALE_BLOCK, dim).narrow(dim, 0, size)
    return scale


# ---------------------------------------------------------------- dequantization


def dequantize_activation(data, scale, recipe, group_sizes, *, dtype=torch.float32) -> torch.Tensor:
    """data [M, K] -> data * scale; rows past the last group are 0."""
    M, K = data.shape
    x = data.to(torch.float64 if dtype == torch.float64 else torch.float32)
    rows, _, _ = row_groups(group_sizes, M, data.device)
    G = 1 if group_sizes is None else group_sizes.shape[0]
    s = scale.to(x.dtype)
    if recipe == "tensorwise":
        s = s.expand(G)[rows.clamp(max=G - 1)][:, None]
    elif recipe == "rowwise":
        s = s[:, None]
    else:
        s = _blocks(s, (1,), (K,))
    return torch.where((rows < G)[:, None], x * s, 0).to(dtype)


def dequantize_activation_t(
    data_t, scale_t, recipe, group_sizes, M: int, *, dtype=torch.float32
) -> torch.Tensor:
    """The transposed copy data_t [K, M_t] back in x's [M, K] layout; rows past the last group are 0."""
    cols, g, block = transposed_columns_of_rows(group_sizes, M, data_t.device)
    G = 1 if group_sizes is None else group_sizes.shape[0]
    x = data_t.to(torch.float64 if dtype == torch.float64 else torch.float32)[:, cols].T
    s = scale_t.to(x.dtype)
    if recipe == "tensorwise":
        s = s.expand(G)[g.clamp(max=G - 1)][:, None]
    elif recipe == "rowwise":
        s = s[g.clamp(max=G - 1)]
    else:
        s = s[block.clamp(0, s.shape[0] - 1)]
    return torch.where((g < G)[:, None], x * s, 0).to(dtype)


def dequantize_weight(data, scale, recipe, *, dtype=torch.float32) -> torch.Tensor:
    """data [G, N, K] -> data * scale."""
    G, N, K = data.shape
    x = data.to(torch.float64 if dtype == torch.float64 else torch.float32)
    s = scale.to(x.dtype)
    if recipe == "tensorwise":
        return (x * s[:, None, None]).to(dtype)
    if recipe == "rowwise":
        return (x * s[:, :, None]).to(dtype)
    return (x * _blocks(s, (1, 2), (N, K))).to(dtype)


# ---------------------------------------------------------------- quantize twins


def quantize_activation(x, group_sizes, recipe, dtype, transpose: bool, amax=None):
    """(data, scale, data_t, scale_t) of activations x [M, K] (``moegemm._src.fp8`` layouts); data_t and
    scale_t are None without ``transpose``. ``amax`` [G] (tensorwise): the groups' amax, given."""
    M, K = x.shape
    G = 1 if group_sizes is None else group_sizes.shape[0]
    bounds = [(0, M)] if group_sizes is None else group_bounds(group_sizes, M)
    owned = max([end for _, end in bounds], default=0)
    xf = x.float()
    data = torch.zeros(M, K, dtype=dtype, device=x.device)
    s_shape, st_shape = fp8.activation_scale_shapes(recipe, M, K, G)
    data_t = torch.zeros(K, fp8.transposed_columns(M, G), dtype=dtype, device=x.device) if transpose else None
    t_cols = []
    col = 0
    for start, end in bounds:
        t_cols.append(col)
        col += fp8.cdiv(end - start, fp8.ROW_ALIGN) * fp8.ROW_ALIGN
    if recipe == "tensorwise":
        if amax is None:
            amax = torch.stack([xf[s:e].abs().amax() if e > s else xf.new_zeros(()) for s, e in bounds])
        scale = scale_of(amax, dtype)
        for g, (start, end) in enumerate(bounds):
            data[start:end] = cast(xf[start:end], scale[g], dtype)
            if transpose:
                data_t[:, t_cols[g] : t_cols[g] + end - start] = data[start:end].T
        return data, scale, data_t, (scale if transpose else None)
    if recipe == "rowwise":
        scale = torch.ones(M, device=x.device)
        scale[:owned] = scale_of(xf[:owned].abs().amax(1) if K else xf.new_zeros(owned), dtype)
        data[:owned] = cast(xf[:owned], scale[:owned, None], dtype)
        if not transpose:
            return data, scale, None, None
        scale_t = torch.ones(st_shape, device=x.device)
        for g, (start, end) in enumerate(bounds):
            if end > start:
                scale_t[g] = scale_of(xf[start:end].abs().amax(0), dtype)
                data_t[:, t_cols[g] : t_cols[g] + end - start] = cast(xf[start:end], scale_t[g], dtype).T
        return data, scale, data_t, scale_t
    kb = fp8.cdiv(K, fp8.SCALE_BLOCK)
    scale = torch.ones(s_shape, device=x.device)
    for b in range(kb):
        cols = slice(b * fp8.SCALE_BLOCK, min(K, (b + 1) * fp8.SCALE_BLOCK))
        scale[:owned, b] = scale_of(xf[:owned, cols].abs().amax(1), dtype)
        data[:owned, cols] = cast(xf[:owned, cols], scale[:owned, b, None], dtype)
    if not transpose:
        return data, scale, None, None
    scale_t = torch.ones(st_shape, device=x.device)
    block = 0
    for g, (start, end) in enumerate(bounds):
        for r in range(start, end, fp8.SCALE_BLOCK):
            rows = slice(r, min(end, r + fp8.SCALE_BLOCK))
            scale_t[block] = scale_of(xf[rows].abs().amax(0), dtype)
            local = r - start + t_cols[g]
            data_t[:, local : local + rows.stop - r] = cast(xf[rows], scale_t[block], dtype).T
            block += 1
    return data, scale, data_t, scale_t


def quantize_weight(w, recipe, dtype, transpose: bool):
    """(data [G, N, K], scale, data_t [G, K, N] or None, scale_t or None) of a weight (``moegemm._src.fp8``)."""
    G, N, K = w.shape
    wf = w.float()
    if recipe == "tensorwise":
        scale = scale_of(wf.abs().amax((1, 2)) if N * K else wf.new_zeros(G), dtype)
        data = cast(wf, scale[:, None, None], dtype)
        return data, scale, (data.mT.contiguous() if transpose else None), (scale if transpose else None)
    if recipe == "rowwise":
        scale = scale_of(wf.abs().amax(2) if K else wf.new_zeros(G, N), dtype)
        data = cast(wf, scale[:, :, None], dtype)
        if not transpose:
            return data, scale, None, None
        scale_t = scale_of(wf.abs().amax(1) if N else wf.new_zeros(G, K), dtype)
        return data, scale, cast(wf, scale_t[:, None, :], dtype).mT.contiguous(), scale_t
    nb, kb = fp8.cdiv(N, fp8.SCALE_BLOCK), fp8.cdiv(K, fp8.SCALE_BLOCK)
    padded = wf.new_zeros(G, nb * fp8.SCALE_BLOCK, kb * fp8.SCALE_BLOCK)
    padded[:, :N, :K] = wf
    blocks = padded.view(G, nb, fp8.SCALE_BLOCK, kb, fp8.SCALE_BLOCK)
    scale = scale_of(blocks.abs().amax((2, 4)), dtype)
    data = cast(wf, _blocks(scale, (1, 2), (N, K)), dtype)
    if not transpose:
        return data, scale, None, None
    return data, scale, data.mT.contiguous(), scale.transpose(1, 2)


# ---------------------------------------------------------------- the expert block's epilogues and combine


def combine(
    rows: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The combine kernel's twin: out [T, D] = sum_j weight[t, j] * rows[pos[t, j]] in fp32, j in order; a
    negative position adds nothing, a non-finite weight counts as 0."""
    T, k = pos.shape
    out = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)
    if rows.shape[0] == 0:
        return out.to(dtype)
    for j in range(k):
        p = pos[:, j].long()
        term = rows[p.clamp(0, rows.shape[0] - 1)].float()
        if weight is not None:
            w = weight[:, j].float()
            term = term * torch.where(torch.isfinite(w), w, 0.0)[:, None]
        out += torch.where((p >= 0)[:, None], term, 0.0)
    return out.to(dtype)


def swiglu_epilogue(acc: torch.Tensor, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1's epilogue twin: acc [M, 2n] fp32 -> (z [M, 2n] rounded to act_dtype, h = silu(gate) * up of the rounded
    z, in act_dtype)."""
    z = acc.to(act_dtype)
    gate, up = z.float().chunk(2, dim=1)
    return z, (gate * torch.sigmoid(gate) * up).to(act_dtype)


def swiglu_bwd_epilogue(
    dh: torch.Tensor, z: torch.Tensor, row_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fc2's dgrad epilogue twin: dh [M, n] fp32, the kept z [M, 2n], row_scale s [M] -> (dz [M, 2n], s * h [M, n],
    both in z's dtype, ds [1, M] fp32 = sum over columns of dh * h), h rounded as the forward stored it."""
    gate, up = z.float().chunk(2, dim=1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    h = (silu * up).to(z.dtype).float()
    s = row_scale.float()[:, None]
    ds = (dh * h).sum(1)[None]
    dh = dh * s
    dz = torch.cat((dh * up * sig * (1.0 + gate * (1.0 - sig)), dh * silu), dim=1)
    return dz.to(z.dtype), (h * s).to(z.dtype), ds
