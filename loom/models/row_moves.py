"""Row gathers whose backward is a gather or a plain write, for the mixture-of-experts block's token moves.

Autograd's backward of `x[index]` is a scatter-add (index_put with accumulate, or index_add for index_select):
atomics, slow in bf16 (2.4 ms a layer at 131K rows of 2048 on an H200) and nondeterministic on CUDA. The MoE
block knows more about its indices than autograd does — each is a permutation, distinct rows of a padded
buffer, or k copies of every row in a known order — so each backward here is the inverse move: a gather, or a
write without accumulation.
"""

from __future__ import annotations

import torch


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_copy(0, index, grad), None


class _SpreadRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, back: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(back)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        return grad.index_select(0, back).view(-1, ctx.k, *grad.shape[1:]).sum(1), None, None, None


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[index]` for an `index` without repeats (a permutation, or some rows of `x`): the backward writes each
    row's gradient back to its place, zeros elsewhere."""
    return _TakeRows.apply(x, index)


def spread_rows(x: torch.Tensor, order: torch.Tensor, back: torch.Tensor, k: int) -> torch.Tensor:
    """`x[order // k]`: each of `x`'s rows k times (as rows t·k … t·k + k − 1), put in `order`, a permutation of
    those whose inverse is `back`; the backward gathers each row's k copies by `back` and sums them."""
    return _SpreadRows.apply(x, order, back, k)


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation of 0 … n − 1 (a scatter of the positions)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
