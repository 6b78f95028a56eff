"""GroupedLinear against a loop of per-expert torch.nn.Linear in fp64, one test base per backend."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, flat_configs, needs_cuda, record_launches, spy_store_paths
from torch import nn

from moegemm import shapes
from moegemm.testing import assert_rel_close, linear_loop_reference
from moegemm.torch import GroupedLinear

G, M, K, N = 4, 37, 24, 20
SIZES = [10, 0, 15, 12]  # sums to M, group 1 empty


def linear_loop(module: GroupedLinear, x: torch.Tensor, sizes: list[int], dy: torch.Tensor):
    """fp64 oracle: one nn.Linear per expert over its rows; y, dx, dweight [G, N, K], dbias [G, N] or None."""
    return linear_loop_reference(module.weight, module.bias, x, sizes, dy)


def make_inputs(dtype: torch.dtype, rows: int = M, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=gen).to(dtype=dtype, device=DEVICE).requires_grad_()
    dy = torch.randn(rows, N, generator=gen).to(dtype=dtype, device=DEVICE)
    return x, dy


class MoEBlock(nn.Module):
    """Top-k routed MLP: sort token copies by expert, fc1 -> gelu -> fc2, weighted scatter-add back."""

    def __init__(self, backend: str, hidden: int = 16, topk: int = 2) -> None:
        super().__init__()
        self.topk = topk
        self.router = nn.Linear(K, G, bias=False, device=DEVICE)
        self.fc1 = GroupedLinear(G, K, hidden, device=DEVICE, backend=backend)
        self.fc2 = GroupedLinear(G, hidden, K, bias=False, device=DEVICE, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, experts = self.router(x).softmax(-1).topk(self.topk, dim=-1)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        tokens = order // self.topk
        # Static-shape group sizes on the device (bincount's output shape is data-dependent).
        group_sizes = torch.zeros(G, dtype=torch.int64, device=x.device).index_add_(
            0, flat, torch.ones_like(flat)
        )
        h = self.fc2(nn.functional.gelu(self.fc1(x[tokens], group_sizes)), group_sizes)
        h = h * probs.flatten()[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, tokens, h)


class GroupedLinearTest:
    BACKEND = "triton"

    def make(
        self, bias: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs
    ) -> GroupedLinear:
        torch.manual_seed(seed)
        return GroupedLinear(G, K, N, bias, dtype=dtype, device=DEVICE, backend=self.BACKEND, **kwargs)

    def check_grads(self, module, x, sizes, dy, y, dtype, what):
        ry, rdx, rdw, rdb = linear_loop(module, x, sizes, dy)
        assert_rel_close(y.detach().cpu(), ry, dtype, what=f"{what} y")
        assert_rel_close(x.grad.cpu(), rdx, dtype, what=f"{what} dx")
        assert_rel_close(module.weight.grad.cpu(), rdw, dtype, what=f"{what} dweight")
        if module.bias is not None:
            assert_rel_close(module.bias.grad.cpu(), rdb, dtype, what=f"{what} dbias")

    @pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
    @pytest.mark.parametrize("sizes_as", ["list", "device-int32", "cpu-int64"])
    def test_matches_linear_loop(self, bias, sizes_as):
        module = self.make(bias)
        x, dy = make_inputs(torch.float32)
        group_sizes = {
            "list": SIZES,
            "device-int32": torch.tensor(SIZES, dtype=torch.int32, device=DEVICE),
            "cpu-int64": torch.tensor(SIZES, dtype=torch.int64),
        }[sizes_as]
        y = module(x, group_sizes, check=True)
        assert y.shape == (M, N) and y.dtype == torch.float32
        y.backward(dy)
        self.check_grads(module, x, SIZES, dy, y, torch.float32, f"{self.BACKEND} {sizes_as} bias={bias}")

    @pytest.mark.parametrize("frozen", ["x", "weight"])
    def test_partial_requires_grad(self, frozen):
        module = self.make()
        x, dy = make_inputs(torch.float32)
        if frozen == "x":
            x.requires_grad_(False)
        else:
            module.requires_grad_(False)
        module(x, SIZES).backward(dy)
        _, rdx, rdw, rdb = linear_loop(module, x, SIZES, dy)
        if frozen == "x":
            assert x.grad is None
            assert_rel_close(module.weight.grad.cpu(), rdw, torch.float32, what="dweight, x frozen")
            assert_rel_close(module.bias.grad.cpu(), rdb, torch.float32, what="dbias, x frozen")
        else:
            assert module.weight.grad is None and module.bias.grad is None
            assert_rel_close(x.grad.cpu(), rdx, torch.float32, what="dx, weight frozen")

    def test_bfloat16(self):
        module = self.make(dtype=torch.bfloat16)
        x, dy = make_inputs(torch.bfloat16, seed=1)
        y = module(x, SIZES)
        assert y.dtype == torch.bfloat16
        y.backward(dy)
        assert module.weight.grad.dtype == module.bias.grad.dtype == torch.bfloat16
        self.check_grads(module, x, SIZES, dy, y, torch.bfloat16, f"{self.BACKEND} bf16")

    @pytest.mark.parametrize("sizes", [[0, 0, 0, M], [M, 0, 0, 0], [0, 20, 0, 17]], ids=str)
    def test_empty_groups_get_exact_zero_grads(self, sizes):
        module = self.make()
        x, dy = make_inputs(torch.float32)
        y = module(x, sizes)
        y.backward(dy)
        self.check_grads(module, x, sizes, dy, y, torch.float32, f"{self.BACKEND} {sizes}")
        for g in (g for g, s in enumerate(sizes) if s == 0):
            assert torch.equal(module.weight.grad[g], torch.zeros(N, K, device=DEVICE)), f"dweight[{g}] not 0"
            assert torch.equal(module.bias.grad[g], torch.zeros(N, device=DEVICE)), f"dbias[{g}] not 0"

    @pytest.mark.parametrize("sizes", [[10, 0, 15, 5], [0, 0, 0, 0]], ids=str)
    def test_tail_rows_are_zero_and_get_zero_grad(self, sizes):
        module = self.make()
        with torch.no_grad():
            module.bias.add_(1.0)  # a bias added to the tail rows could not hide behind a small init
        x, dy = make_inputs(torch.float32)
        y = module(x, sizes)
        y.backward(dy)  # dy is nonzero on the tail: it must not reach dweight or dbias
        owned = sum(sizes)
        assert torch.equal(y[owned:].detach(), torch.zeros(M - owned, N, device=DEVICE)), (
            "tail rows of y not 0"
        )
        assert torch.equal(x.grad[owned:], torch.zeros(M - owned, K, device=DEVICE)), "tail rows of dx not 0"
        self.check_grads(module, x, sizes, dy, y, torch.float32, f"{self.BACKEND} tail {sizes}")

    def test_fp32_bias_with_tf32_allowed(self):
        # TF32 matmuls allowed: the bias is still added in fp32 in the epilogue, never rounded to TF32.
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            self.test_tail_rows_are_zero_and_get_zero_grad([10, 0, 15, 5])
        finally:
            torch.set_float32_matmul_precision(previous)

    @pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
    @pytest.mark.parametrize("kind", ["fresh", "view-at-offset", "non-contiguous", "slice-of-grad-base"])
    def test_out_buffer_gradients(self, kind, fuse):
        """out= of every kind: y lands in the buffer (NaN-poisoned, so every element must be written),
        and every input gets its gradient: x (through a non-leaf, as in a real model), weight
        (or main_grad), bias, and for a view of a base in the graph, the base's other elements."""
        sizes = [10, 0, 15, 5]  # a tail of unowned rows too
        module = self.make(fuse_wgrad_accumulation=fuse)
        if fuse:
            module.weight.main_grad = torch.zeros(G, N, K, device=DEVICE)
        leaf, dy = make_inputs(torch.float32)
        x = leaf * 2.0
        nan = float("nan")
        base = None
        if kind == "fresh":
            out = torch.full((M, N), nan, device=DEVICE)
        elif kind == "view-at-offset":
            base = torch.full((M * N + 11,), nan, device=DEVICE)
            out = base[4 : 4 + M * N].view(M, N)
        elif kind == "non-contiguous":
            base = torch.full((N, 2 * M), nan, device=DEVICE)
            out = base[:, ::2].T  # strides (2, 2M)
        else:  # a slice of a buffer that is itself differentiable: its other rows keep their gradient
            source = torch.randn(M + 6, N, device=DEVICE, requires_grad=True)
            base = source * 3.0
            out = base[2 : 2 + M]
        y = module(x, sizes, out=out)
        assert y.data_ptr() == out.data_ptr() and y.stride() == out.stride()
        if kind == "slice-of-grad-base":  # one loss over the whole base; the layer's rows get dy
            weights = torch.randn(M + 6, N, device=DEVICE)
            weights[2 : 2 + M] = dy
            (base * weights).sum().backward()
            want = 3.0 * weights
            want[2 : 2 + M] = 0  # overwritten by the layer: its old values no longer matter
            assert_rel_close(source.grad.cpu(), want.cpu(), torch.float32, what="the base's other rows")
        else:
            y.backward(dy)
        ry, rdx, rdw, rdb = linear_loop(module, x, sizes, dy)
        what = f"{self.BACKEND} out={kind} fuse={fuse}"
        assert_rel_close(y.detach().cpu(), ry, torch.float32, what=f"{what} y")
        assert leaf.grad is not None, f"{what}: x got no gradient"
        assert_rel_close(leaf.grad.cpu(), 2.0 * rdx, torch.float32, what=f"{what} dx")
        assert_rel_close(
            (module.weight.main_grad if fuse else module.weight.grad).cpu(),
            rdw,
            torch.float32,
            what=f"{what} dweight",
        )
        assert_rel_close(module.bias.grad.cpu(), rdb, torch.float32, what=f"{what} dbias")
        if kind in ("view-at-offset", "non-contiguous"):  # the rest of the buffer is untouched (NaN)
            written = torch.zeros_like(base, dtype=torch.bool)
            (written[4 : 4 + M * N] if kind == "view-at-offset" else written[:, ::2]).fill_(True)
            assert base[~written].isnan().all(), "wrote outside out="

    @pytest.mark.parametrize("kind", ["view-at-offset", "slice-of-grad-base"])
    def test_out_buffer_under_compile(self, kind):
        """torch.compile(fullgraph) with out=: Dynamo reorders an autograd.Function's inputs, so the eager
        out-first rule cannot carry over; the compiled call must still give every input its gradient."""
        module = self.make()
        leaf, dy = make_inputs(torch.float32)
        sizes = torch.tensor([10, 0, 15, 5], device=DEVICE)
        source = torch.randn(M + 6, N, device=DEVICE, requires_grad=kind == "slice-of-grad-base")

        def step(leaf, source):
            base = source * 3.0 if kind == "slice-of-grad-base" else torch.zeros(M * N + 11, device=DEVICE)
            out = base[2 : 2 + M] if kind == "slice-of-grad-base" else base[4 : 4 + M * N].view(M, N)
            y = module(leaf * 2.0, sizes, out=out)
            return y, base

        results = []
        for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
            leaf.grad = source.grad = None
            module.zero_grad(set_to_none=True)
            y, base = fn(leaf, source)
            (y * dy).sum().backward() if kind != "slice-of-grad-base" else (base * base).sum().backward()
            grads = [leaf.grad, module.weight.grad, module.bias.grad]
            results.append([y.detach(), *grads] + ([source.grad] if source.requires_grad else []))
        for name, got, want in zip(("y", "dx", "dweight", "dbias", "dsource"), results[1], results[0]):
            assert got is not None, f"compiled out={kind}: no {name}"
            assert_rel_close(got.cpu(), want.cpu(), torch.float32, what=f"compiled out={kind} {name}")

    def test_out_view_reproducer(self):
        """The reported case: a view at an offset into a flat buffer, x a non-leaf (issue: h.grad None)."""
        torch.manual_seed(0)
        layer = GroupedLinear(2, 4, 3, bias=True, device=DEVICE, backend=self.BACKEND)
        h = torch.randn(6, 4, device=DEVICE, requires_grad=True)
        out = torch.zeros(26, device=DEVICE)[4:22].view(6, 3)
        dy = torch.randn(6, 3, device=DEVICE)
        layer(h * 2.0, torch.tensor([2, 4]), out=out).backward(dy)
        _, rdx, _, _ = linear_loop_reference(layer.weight, layer.bias, h * 2.0, [2, 4], dy)
        assert h.grad is not None, "h got no gradient through out="
        assert_rel_close(h.grad.cpu(), 2.0 * rdx, torch.float32, what="reproducer dh")

    @pytest.mark.parametrize("case", ["aliases-x", "overlaps-x", "expanded", "leaf-requires-grad"])
    def test_out_buffer_refused(self, case):
        module = GroupedLinear(G, K, K, device=DEVICE, backend=self.BACKEND)  # N = K: out could be x
        x = torch.randn(M, K, device=DEVICE)
        out, error, pattern = {
            "aliases-x": (x, ValueError, r"out= may share memory with x"),
            "overlaps-x": (None, ValueError, r"out= may share memory with x"),
            "expanded": (
                torch.zeros(1, K, device=DEVICE).expand(M, K),
                ValueError,
                r"elements that share memory",
            ),
            "leaf-requires-grad": (
                torch.zeros(M, K, device=DEVICE, requires_grad=True),
                RuntimeError,
                r"leaf",
            ),
        }[case]
        if case == "overlaps-x":
            buf = torch.randn(M + 3, K, device=DEVICE)
            x, out = buf[:M], buf[3:]
        with pytest.raises(error, match=pattern):
            module(x, SIZES, out=out)

    @pytest.mark.parametrize("megatron_flag", [False, True], ids=["plain", "grad_added_to_main_grad"])
    def test_fuse_wgrad_accumulation(self, megatron_flag):
        module = self.make(fuse_wgrad_accumulation=True)
        module.weight.main_grad = torch.full((G, N, K), 0.5, device=DEVICE)
        if megatron_flag:
            module.weight.grad_added_to_main_grad = False
        x, dy = make_inputs(torch.float32)
        for _ in range(2):  # accumulating twice adds up
            module(x, SIZES).backward(dy)
        _, _, rdw, rdb = linear_loop(module, x, SIZES, dy)
        assert_rel_close(module.weight.main_grad.cpu(), 0.5 + 2 * rdw, torch.float32, what="main_grad")
        assert_rel_close(module.bias.grad.cpu(), 2 * rdb, torch.float32, what="dbias")
        if megatron_flag:  # TE: flag set, autograd gets a dummy of the weight's shape
            assert module.weight.grad_added_to_main_grad is True
            assert module.weight.grad is not None and module.weight.grad.shape == (G, N, K)
        else:
            assert module.weight.grad is None

    def test_fuse_wgrad_accumulation_needs_main_grad(self):
        module = self.make(fuse_wgrad_accumulation=True)
        x, _ = make_inputs(torch.float32)
        with pytest.raises(RuntimeError, match=r"needs weight\.main_grad.*\(4, 20, 24\)"):
            module(x, SIZES)
        module.weight.main_grad = torch.zeros(G, N, K, dtype=torch.bfloat16, device=DEVICE)
        with pytest.raises(ValueError, match=r"main_grad must be float32 .*got torch\.bfloat16"):
            module(x, SIZES)
        module.weight.main_grad = torch.zeros(G, K, N, device=DEVICE)
        with pytest.raises(ValueError, match=r"shape \(4, 20, 24\).*shape \(4, 24, 20\)"):
            module(x, SIZES)
        with torch.no_grad():  # no backward will run: main_grad is not needed
            module(x, SIZES)

    @pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
    def test_delay_wgrad_compute(self, fuse):
        module = self.make(delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse)
        if fuse:
            module.weight.main_grad = torch.zeros(G, N, K, device=DEVICE)
        x, dy = make_inputs(torch.float32)
        y = module(x, SIZES)
        y.backward(dy)
        assert module.weight.grad is None and module.bias.grad is None, "wgrad ran in the backward"
        ry, rdx, rdw, rdb = linear_loop(module, x, SIZES, dy)
        assert_rel_close(x.grad.cpu(), rdx, torch.float32, what="dx")
        module.backward_dw()
        dw = module.weight.main_grad if fuse else module.weight.grad
        assert_rel_close(dw.cpu(), rdw, torch.float32, what="delayed dweight")
        assert_rel_close(module.bias.grad.cpu(), rdb, torch.float32, what="delayed dbias")
        with pytest.raises(RuntimeError, match=r"backward_dw\(\) has no pending weight gradient"):
            module.backward_dw()

    def test_delay_wgrad_compute_compiled_with_graph_break(self):
        module = self.make(delay_wgrad_compute=True)
        compiled = torch.compile(module, backend="aot_eager")  # backward_dw's state: not fullgraph
        x, dy = make_inputs(torch.float32)
        for _ in range(2):  # delayed gradients accumulate like autograd's
            compiled(x, SIZES).backward(dy)
            module.backward_dw()
        _, rdx, rdw, rdb = linear_loop(module, x, SIZES, dy)
        assert_rel_close(x.grad.cpu(), 2 * rdx, torch.float32, what="compiled delayed dx")
        assert_rel_close(module.weight.grad.cpu(), 2 * rdw, torch.float32, what="compiled delayed dweight")
        assert_rel_close(module.bias.grad.cpu(), 2 * rdb, torch.float32, what="compiled delayed dbias")

    def test_delay_wgrad_compute_forgotten(self):
        module = self.make(delay_wgrad_compute=True)
        x, dy = make_inputs(torch.float32)
        module(x, SIZES).backward(dy)
        with pytest.raises(RuntimeError, match=r"call backward_dw\(\) after each backward"):
            module(x, SIZES)

    def test_state_dict_per_expert_layout(self):
        experts = [nn.Linear(K, N, dtype=torch.float32) for _ in range(G)]
        per_expert = {f"fc.weight{g}": lin.weight.detach() for g, lin in enumerate(experts)}
        per_expert |= {f"fc.bias{g}": lin.bias.detach() for g, lin in enumerate(experts)}
        parent = nn.ModuleDict({"fc": self.make()})
        parent.load_state_dict(per_expert)
        for g, lin in enumerate(experts):
            assert torch.equal(parent["fc"].weight[g].cpu(), lin.weight.detach())
            assert torch.equal(parent["fc"].bias[g].cpu(), lin.bias.detach())
        # The native layout still loads, and a partial per-expert dict names what is missing.
        parent.load_state_dict({k: v.clone() for k, v in parent.state_dict().items()})
        del per_expert["fc.weight2"]
        with pytest.raises(
            RuntimeError, match=r"has 3 of the 4 entries weight0\.\.weight3; missing \['fc\.weight2'\]"
        ):
            parent.load_state_dict(per_expert)

    def test_init(self):
        module = self.make()
        bound = 1 / K**0.5  # nn.Linear's default, per expert
        assert module.weight.abs().max() <= bound and module.bias.abs().max() <= bound
        assert module.weight.std() > bound / 4, "weight left uninitialized"
        seen = []
        module = self.make(init_method=lambda w: seen.append(tuple(w.shape)) or w.fill_(len(seen)))
        assert seen == [(N, K)] * G, "init_method runs once per expert on its [N, K] weight"
        assert [module.weight[g].unique().tolist() for g in range(G)] == [[1.0], [2.0], [3.0], [4.0]]
        assert torch.equal(module.bias, torch.zeros(G, N, device=DEVICE)), "TE zeroes the bias"
        assert "num_groups=4, in_features=24, out_features=20, bias=True" in repr(module)

    @pytest.mark.parametrize("fuse", [False, True])
    def test_eager_calls_skip_custom_op_dispatch(self, fuse, monkeypatch):
        """Eager fwd+bwd launches directly (parameters included): the torch.library ops are for tracing,
        and their Python dispatch cost more than the kernels at small shapes (issue 4's overhead)."""
        from moegemm._src.torch import ops as _ops

        def traced_only(*args, **kwargs):
            raise AssertionError("an eager GroupedLinear call went through a torch.library custom op")

        for name in ("m_grouped_mm_op", "m_grouped_mm_out_op", "k_grouped_mm_op", "k_grouped_mm_out_op"):
            monkeypatch.setattr(_ops, name, traced_only)
        module = self.make(fuse_wgrad_accumulation=fuse)
        if fuse:
            module.weight.main_grad = torch.zeros(G, N, K, device=DEVICE)
        x, dy = make_inputs(torch.float32)
        module(x, SIZES).backward(dy)
        assert x.grad is not None and module.bias.grad is not None

    def test_compile_fullgraph_moe_block(self):
        torch.manual_seed(0)
        block = MoEBlock(self.BACKEND)
        x = torch.randn(12, K, device=DEVICE, requires_grad=True)
        block(x).square().sum().backward()
        eager = [x.grad] + [p.grad for p in block.parameters()]
        x.grad = None
        block.zero_grad(set_to_none=True)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        y = compiled(x)
        y.square().sum().backward()
        assert_rel_close(y.detach().cpu(), block(x).detach().cpu(), torch.float32, what="compiled y")
        for (name, p), want in zip([("x", x), *block.named_parameters()], eager):
            assert_rel_close(p.grad.cpu(), want.cpu(), torch.float32, what=f"compiled d{name}")

    @pytest.mark.parametrize(
        "case",
        [
            "sizes-length",
            "sizes-float",
            "sizes-list-float",
            "x-features",
            "x-dtype",
            "x-rank",
            "check-sum-below",
            "check-sum-above",
            "check-negative",
            "out-shape",
        ],
    )
    def test_bad_input_errors(self, case):
        module = self.make()
        x, _ = make_inputs(torch.float32)
        args, kwargs = (x, SIZES), {}
        error, pattern = {
            "sizes-length": (ValueError, r"group_sizes has 3 entries but the weight has G=4"),
            "sizes-float": (TypeError, r"group_sizes must be int32 or int64, got torch\.float32"),
            "sizes-list-float": (TypeError, r"group_sizes must hold integers, got \[10\.0, 0, 15, 12\]"),
            "x-features": (ValueError, r"x \[M, in_features=24\], got x of shape \(37, 25\)"),
            "x-dtype": (TypeError, r"x is torch\.float64 but GroupedLinear's parameters are torch\.float32"),
            "x-rank": (ValueError, r"x \[M, in_features=24\], got x of shape \(37, 24, 1\)"),
            "check-sum-below": (ValueError, r"sum\(group_sizes\) = 30 but x has M = 37 rows"),
            "check-sum-above": (ValueError, r"sum\(group_sizes\) = 40 exceeds the 37 rows"),
            "check-negative": (ValueError, r"negative entries \(group, size\): \[\(1, -3\)\]"),
            "out-shape": (ValueError, r"out must be a torch\.float32 tensor of shape \(37, 20\)"),
        }[case]
        if case == "sizes-length":
            args = (x, [10, 15, 12])
        elif case == "sizes-float":
            args = (x, torch.tensor(SIZES, dtype=torch.float32))
        elif case == "sizes-list-float":
            args = (x, [10.0, 0, 15, 12])
        elif case == "x-features":
            args = (torch.randn(M, K + 1, device=DEVICE), SIZES)
        elif case == "x-dtype":
            args = (x.detach().double(), SIZES)
        elif case == "x-rank":
            args = (x.unsqueeze(-1), SIZES)
        elif case.startswith("check"):
            sizes = {
                "check-sum-below": [10, 0, 15, 5],
                "check-sum-above": [10, 3, 15, 12],
                "check-negative": [10, -3, 15, 12],
            }[case]
            args, kwargs = (x, torch.tensor(sizes, device=DEVICE)), {"check": True}
        elif case == "out-shape":
            kwargs = {"out": torch.empty(M, N + 1, device=DEVICE)}
        with pytest.raises(error, match=pattern):
            module(*args, **kwargs)


class TestTriton(GroupedLinearTest):
    BACKEND = "triton"
    pytestmark = pytest.mark.gpu


@pytest.mark.gpu
def test_bfloat16_through_tma_store(monkeypatch):
    """A bf16 layer whose dgrad and wgrad (+ the fused dbias sums) store through TMA descriptors, forced
    at this size; fwd's out [M, 20] has rows 40 bytes apart, so it stores from registers."""
    m_calls = spy_store_paths(monkeypatch, "m_grouped")
    k_calls = spy_store_paths(monkeypatch, "k_grouped")
    torch.manual_seed(3)
    module = GroupedLinear(G, K, N, True, dtype=torch.bfloat16, device=DEVICE, backend="triton")
    x, dy = make_inputs(torch.bfloat16, seed=3)
    y = module(x, SIZES)
    y.backward(dy)
    ry, rdx, rdw, rdb = linear_loop(module, x, SIZES, dy)
    assert_rel_close(y.detach().cpu(), ry, torch.bfloat16, what="tma y")
    assert_rel_close(x.grad.cpu(), rdx, torch.bfloat16, what="tma dx")
    assert_rel_close(module.weight.grad.cpu(), rdw, torch.bfloat16, what="tma dweight")
    assert_rel_close(module.bias.grad.cpu(), rdb, torch.bfloat16, what="tma dbias")
    assert torch.equal(module.weight.grad[1].cpu(), torch.zeros(N, K, dtype=torch.bfloat16)), "empty expert"
    assert [name for name, _ in m_calls] == ["M_GROUPED", "M_GROUPED_TMA"]  # fwd, dgrad
    assert [name for name, _ in k_calls] == ["K_GROUPED_TMA"]  # wgrad with the dbias sums


# ---------------------------------------------------------------- GPU only

# Each sums to <= 256 rows: empty groups, one hot expert first and last, uniform, all empty (all tail), ragged.
REPLAY_SIZES = (
    [64, 0, 40, 100, 12, 0, 30, 10],
    [256, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 200],
    [20, 20, 20, 20, 20, 20, 20, 20],
    [0, 0, 0, 0, 0, 0, 0, 0],
    [33, 1, 0, 77, 5, 64, 0, 11],
)


def capture_step(module: GroupedLinear, x: torch.Tensor, gs: torch.Tensor, dy: torch.Tensor):
    """fwd+bwd warmed up on a side stream (Triton compiles there, as capture wants), grads cleared, then
    captured once in a CUDA graph: (graph, y). The .grad tensors are allocated in the graph's pool and
    rewritten by each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            module(x, gs).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    module.zero_grad(set_to_none=True)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = module(x, gs)
        y.backward(dy)
    return graph, y


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_graph_replay_with_changing_sizes(dtype, fuse):
    """fwd+bwd captured once in a CUDA graph, replayed with new sizes written into the same device tensor."""
    G8, M8, K8, N8 = 8, 256, 96, 80
    torch.manual_seed(0)
    module = GroupedLinear(G8, K8, N8, dtype=dtype, device=DEVICE, fuse_wgrad_accumulation=fuse)
    if fuse:
        module.weight.main_grad = torch.zeros(G8, N8, K8, device=DEVICE)
    x = torch.randn(M8, K8, device=DEVICE, dtype=dtype, requires_grad=True)
    dy = torch.randn(M8, N8, device=DEVICE, dtype=dtype)
    gs = torch.tensor(REPLAY_SIZES[0], dtype=torch.int32, device=DEVICE)
    graph, y = capture_step(module, x, gs, dy)
    for sizes in REPLAY_SIZES:
        gs.copy_(torch.tensor(sizes, dtype=torch.int32))
        with torch.no_grad():
            x.normal_()
            dy.normal_()
        if fuse:
            module.weight.main_grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ry, rdx, rdw, rdb = linear_loop(module, x, sizes, dy)
        what = f"replay {sizes} {dtype} fuse={fuse}"
        assert_rel_close(y.detach().cpu(), ry, dtype, what=f"{what} y")
        assert_rel_close(x.grad.cpu(), rdx, dtype, what=f"{what} dx")
        dw = module.weight.main_grad if fuse else module.weight.grad
        assert_rel_close(dw.cpu(), rdw, torch.float32 if fuse else dtype, what=f"{what} dweight")
        assert_rel_close(module.bias.grad.cpu(), rdb, dtype, what=f"{what} dbias")
        owned = sum(sizes)
        assert (y[owned:] == 0).all() and (x.grad[owned:] == 0).all(), f"{what}: tail rows not 0"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sizes_as", ["cuda-tensor", "list"])
def test_no_host_sync(sizes_as):
    """Eager fwd+bwd never syncs the host: with CUDA sizes, and with a list (staged through pinned memory)."""
    G8, M8, K8, N8 = 8, 2048, 256, 512
    module = GroupedLinear(G8, K8, N8, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(M8, K8, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    sizes = [M8 // G8] * G8
    gs = torch.tensor(sizes, device=DEVICE, dtype=torch.int32) if sizes_as == "cuda-tensor" else sizes
    module(x, gs).sum().backward()  # warm-up: Triton compiles outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = module(x, gs)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@needs_cuda
def test_peak_memory_below_linear_loop():
    """No hidden temporaries: fwd+bwd peaks below a per-expert nn.Linear loop doing the same work."""
    G8, M8, K8, N8 = 8, 4096, 1024, 1024
    sizes = shapes.group_sizes(M8, G8, seed=0)
    module = GroupedLinear(G8, K8, N8, dtype=torch.bfloat16, device=DEVICE)
    experts = nn.ModuleList(nn.Linear(K8, N8, dtype=torch.bfloat16, device=DEVICE) for _ in range(G8))
    gs = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    x = torch.randn(M8, K8, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M8, N8, device=DEVICE, dtype=torch.bfloat16)
    runs = {
        "GroupedLinear": lambda: module(x, gs).backward(dy),
        "loop": lambda: torch.cat([lin(part) for lin, part in zip(experts, x.split(sizes))]).backward(dy),
    }
    peaks = {}
    for name, run in runs.items():
        for _ in range(2):  # the first run compiles/loads kernels and fills caches; the second counts
            module.zero_grad(set_to_none=True)
            experts.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - base
    assert peaks["GroupedLinear"] <= peaks["loop"], f"peak bytes above the inputs: {peaks}"


class TestReference(GroupedLinearTest):
    BACKEND = "reference"


@pytest.mark.gpu
@needs_cuda
def test_tma_loads_in_backward_and_graph_replay(monkeypatch):
    """TMA loads in all three GEMMs (fwd and dgrad: descriptors made once per program; wgrad: per group)
    where autograd runs the backward (a thread of its own, which needs Triton's scratch allocator there
    too) and inside a CUDA graph (the scratch comes from the graph's pool), replayed with new sizes: y, dx
    and dweight against the fp64 loop, and a spy that every launch took the TMA loads."""
    from moegemm._src.torch import launch as _launch

    flat_configs(monkeypatch, tma_load=True)
    _launch.plan.constrain(tma_load=True, tma_load_min_flops=0)
    k_calls = record_launches(monkeypatch, "k_grouped")
    m_calls = record_launches(monkeypatch, "m_grouped")
    # N8 = 128: the dgrad reads the weight N-contiguous, which takes TMA loads only without a K tail.
    G8, M8, K8, N8 = 8, 256, 96, 128
    torch.manual_seed(1)
    module = GroupedLinear(G8, K8, N8, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(M8, K8, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M8, N8, device=DEVICE, dtype=torch.bfloat16)
    gs = torch.tensor(REPLAY_SIZES[0], dtype=torch.int32, device=DEVICE)
    y = module(x, gs)
    y.backward(dy)
    ry, rdx, rdw, _ = linear_loop(module, x, REPLAY_SIZES[0], dy)
    assert_rel_close(y.detach().cpu(), ry, torch.bfloat16, what="eager y, TMA loads")
    assert_rel_close(x.grad.cpu(), rdx, torch.bfloat16, what="eager dx, TMA loads")
    assert_rel_close(module.weight.grad.cpu(), rdw, torch.bfloat16, what="eager dweight, TMA loads")
    assert k_calls and all(_launch._k_launch(*s).meta["TMA_LOAD"] for _, s in k_calls), k_calls
    assert len(m_calls) == 2 and all(_launch._m_launch(*s).meta["TMA_LOAD"] for _, s in m_calls), m_calls
    # The eager y keeps its autograd graph's nodes alive, x's AccumulateGrad among them, and that node keeps
    # the legacy stream it was made on: the capture's backward would then wait on the legacy stream and
    # fail (cudaErrorStreamCaptureImplicit), with or without TMA loads. PyTorch behaviour:
    # https://github.com/pytorch/pytorch/issues/164302
    del y
    graph, y = capture_step(module, x, gs, dy)
    for sizes in REPLAY_SIZES:
        gs.copy_(torch.tensor(sizes, dtype=torch.int32))
        with torch.no_grad():
            x.normal_()
            dy.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ry, rdx, rdw, _ = linear_loop(module, x, sizes, dy)
        assert_rel_close(y.detach().cpu(), ry, torch.bfloat16, what=f"replay {sizes} y, TMA loads")
        assert_rel_close(x.grad.cpu(), rdx, torch.bfloat16, what=f"replay {sizes} dx, TMA loads")
        assert_rel_close(
            module.weight.grad.cpu(), rdw, torch.bfloat16, what=f"replay {sizes} dweight, TMA loads"
        )
    _launch.clear_launch_cache()
