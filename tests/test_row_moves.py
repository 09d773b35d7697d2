"""The MoE block's row moves (models/row_moves.py): the same values and gradients as autograd's `x[index]`, and
a backward without scatter-adds — the atomics that cost the GPU 2.4 ms a layer (issue 49)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loom.models.moe import MoEBlock
from loom.models.router import RouterSpec
from loom.models.row_moves import spread_rows, take_rows

ACCUMULATING = ("index_put", "index_put_", "index_add", "index_add_", "scatter_add", "scatter_add_")


class _Accumulating(TorchDispatchMode):
    """The shapes of the tensors that accumulating index ops (scatter-adds) write into."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name.startswith("index_put"):  # index_put(self, indices, values, accumulate)
            accumulating = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
        else:
            accumulating = name in ACCUMULATING
        if accumulating:
            self.shapes.append((name, tuple(args[0].shape)))
        return func(*args, **kwargs)


def _grads(fn, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(g)
    return y.detach(), x.grad


def test_take_rows_equals_indexing_forward_and_backward():
    """A permutation, and some distinct rows of a longer buffer (the grouped kernel's padding): the rows not
    taken get a zero gradient."""
    x = torch.randn(12, 5, dtype=torch.float64)
    for index in (torch.randperm(12), torch.tensor([7, 0, 3, 11, 5])):
        g = torch.randn(len(index), 5, dtype=torch.float64)
        want, got = _grads(lambda t: t[index], x, g), _grads(lambda t: take_rows(t, index), x, g)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_spread_rows_equals_indexing_forward_and_backward():
    """Each of 6 rows 3 times, sorted by a random key as the block sorts by expert: each row's gradient is the
    sum of its copies'."""
    k, x = 3, torch.randn(6, 4, dtype=torch.float64)
    order = torch.randint(0, 5, (18,)).argsort(stable=True)
    back = torch.empty_like(order).scatter_(0, order, torch.arange(18))
    g = torch.randn(18, 4, dtype=torch.float64)
    want = _grads(lambda t: t[order // k], x, g)
    got = _grads(lambda t: spread_rows(t, order, back, k), x, g)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_moe_block_backward_has_no_scatter_add_on_token_rows():
    """The whole block's backward (grouped kernel, fp32 on CPU): no accumulating index op writes rows of the
    hidden (16) or intermediate (8) width — the routing weights' and scores' small ones ([tokens · k], [tokens,
    experts = 4]) are all that remain."""
    torch.manual_seed(0)
    block = MoEBlock(16, RouterSpec(num_experts=4, top_k=2), 8, kernel="grouped")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    loss = block(torch.randn(10, 16, requires_grad=True)).square().sum()
    with _Accumulating() as seen:
        loss.backward()
    assert seen.shapes and all(shape[-1] not in (16, 8) for _, shape in seen.shapes), seen.shapes
