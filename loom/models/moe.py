"""A mixture-of-experts MLP block: a router (models/router.py), E routed experts (models/experts.py) and
optional shared experts that every token goes through.

Tokens are sorted by expert (a stable sort: the same order on every run), each expert computes on its run,
and the results come back to their tokens by the inverse permutation and a sum over each token's k choices
(no scatter-add, so the combine is deterministic on any device). `experts(x_sorted, counts)` is the seam that
expert parallelism replaces from outside (parallel/); the model never sees a grid.

The block also keeps what load balancing needs, off the autograd graph:
- `tokens_per_expert`: the counted tokens (a sample's own, not padding or filler: `TokenSpans.counted`) each
  expert received in the training forwards since the last optimizer step; train/expert_load.py sums them over
  the data-parallel ranks, moves the router's choice bias and clears them once per step. A recomputation
  under activation checkpointing runs inside backward and is not counted twice.
- the router z-loss (`z_loss_coef`: mean over counted tokens of logsumexp(logits)²) is added to the gradient,
  not the forward: each token's term is divided by the step's global normaliser (`aux_loss_scale`, set by the
  step as for the token loss), so its gradient is the same for any microbatching and any layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from loom.models.experts import Experts
from loom.models.layers import SwiGLU
from loom.models.router import Router, RouterSpec

_AUX_SCALE: list[float | None] = [None]  # 1 / the step's normaliser while a training step runs


@contextlib.contextmanager
def aux_loss_scale(scale: float):
    """Within it, the blocks' auxiliary losses reach the gradient, each token's term times `scale`."""
    _AUX_SCALE[0] = scale
    try:
        yield
    finally:
        _AUX_SCALE[0] = None


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, spec: RouterSpec, intermediate: int, n_shared: int = 0, kernel: str = "auto",
                 z_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.gate = Router(hidden, spec)
        self.experts = Experts(spec.num_experts, hidden, intermediate, kernel)
        # DeepSeek-V3's shared experts: one SwiGLU n_shared times as wide, on every token
        self.shared_experts = SwiGLU(hidden, intermediate * n_shared) if n_shared else None
        self.z_loss_coef = z_loss_coef
        self.register_buffer("tokens_per_expert", torch.zeros(spec.num_experts), persistent=False)

    def reset_buffers(self) -> None:
        self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
        """`x` [..., hidden]; `counted` (bool, x's leading shape): the tokens load statistics count (None: all)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        route = self.gate(x)
        k = route.experts.shape[-1]
        flat = route.experts.flatten()  # [tokens · k]: token t's choices at t·k … t·k + k − 1
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts.num_experts)
        y = self.experts(x[order // k], counts)
        y = y * route.weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        out = y[back].view(-1, k, shape[-1]).sum(1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        mask = None if counted is None else counted.reshape(-1)
        if torch.is_grad_enabled():
            self._count(flat, mask, k)
            out = self._with_aux_gradient(out, route.logits, mask)
        return out.view(shape)

    @torch.compiler.disable
    def _count(self, flat: torch.Tensor, mask: torch.Tensor | None, k: int) -> None:
        if torch._C._current_graph_task_id() != -1:  # activation checkpointing's recomputation, inside backward
            return
        ones = torch.ones_like(flat, dtype=torch.float32)
        if mask is not None:
            ones = ones * mask.repeat_interleave(k).float()
        self.tokens_per_expert.index_add_(0, flat, ones)

    def _with_aux_gradient(self, out: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        scale = _AUX_SCALE[0]
        if scale is None or not self.z_loss_coef:
            return out
        z = torch.logsumexp(logits, dim=-1).square()
        if mask is not None:
            z = z * mask.float()
        return _AddGradient.apply(out, z.sum(), self.z_loss_coef * scale)


class _AddGradient(torch.autograd.Function):
    """Identity on `out`; in backward, `aux` receives gradient `scale` — a loss term that changes the
    gradient without changing the reported loss or needing a path to it (Megatron's aux-loss scaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        # a copy, not `out.view_as(out)`: compiled (AOTAutograd), the view's gradient lost the aux term's (tried)
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None
