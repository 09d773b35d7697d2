"""A mixture-of-experts MLP block: a router (models/router.py), E routed experts (models/experts.py) and
optional shared experts that every token goes through.

Tokens are sorted by expert (a stable sort: the same order on every run), each expert computes on its run,
and the results come back to their tokens by the inverse permutation and a sum over each token's k choices
(no scatter-add, forward or backward: models/row_moves.py; deterministic on any device). `experts(x_sorted,
counts)` goes through the experts' `exchange` seam, which expert parallelism sets from outside (parallel/); the
model never sees a grid.

The block also keeps what load balancing needs, off the autograd graph:
- `tokens_per_expert`: the counted tokens (a sample's own, not padding or filler: `TokenSpans.counted`) each
  expert received in the training forwards since the last optimizer step; train/expert_load.py sums them over
  the data-parallel ranks, moves the router's choice bias and clears them once per step. A recomputation
  under activation checkpointing runs inside backward and is not counted twice.
- the router z-loss (`z_loss_coef`: logsumexp(logits)² per counted token) and DeepSeek-V3's sequence-wise
  balance loss (`seq_aux_loss_coef`: per sample, Σ_e f_e·P_e with f_e = E/(k·T)·(tokens sent to e) and P_e the
  mean normalised score of e over the sample's T counted tokens) are added to the gradient, not the forward:
  each token's z term is divided by the step's global normaliser and each sample's balance term by the global
  sample count (the block's `aux_scale`, which the step sets on the model's blocks: `aux_loss_scale`), so neither
  gradient depends on microbatching or layout. A sample's counts are whole-sample counts: under context
  parallelism its shards add them (`spans.context`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from loom.models.experts import Experts, compute_dtype
from loom.models.layers import SwiGLU
from loom.data.spans import TokenSpans
from loom.models.router import Router, Routing, RouterSpec
from loom.models.row_moves import spread_rows, take_rows


@contextlib.contextmanager
def aux_loss_scale(model: nn.Module, per_token: float, per_sample: float = 0.0):
    """Within it, the auxiliary losses of `model`'s MoE blocks reach the gradient: each token's z-loss term
    times `per_token`, each sample's balance term times `per_sample`."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    scales: dict[torch.device, torch.Tensor] = {}
    for block in blocks:
        device = block.gate.weight.device
        if device not in scales:  # a tensor, not floats: a compiled block reads it as an input (no recompile)
            scales[device] = torch.tensor([per_token, per_sample], dtype=torch.float64, device=device)
        block.aux_scale = scales[device]
    try:
        yield
    finally:
        for block in blocks:
            block.aux_scale = None


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, spec: RouterSpec, intermediate: int, n_shared: int = 0, kernel: str = "auto",
                 z_loss_coef: float = 0.0, seq_aux_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.gate = Router(hidden, spec)
        self.experts = Experts(spec.num_experts, hidden, intermediate, kernel)
        # DeepSeek-V3's shared experts: one SwiGLU n_shared times as wide, on every token
        self.shared_experts = SwiGLU(hidden, intermediate * n_shared) if n_shared else None
        self.z_loss_coef, self.seq_aux_loss_coef = z_loss_coef, seq_aux_loss_coef
        self.register_buffer("tokens_per_expert", torch.zeros(spec.num_experts), persistent=False)
        # [per token, per sample] (fp64) scales of the auxiliary losses' gradients, set from outside for a training
        # step's forwards and backwards (`aux_loss_scale`); None: they are not added
        self.aux_scale: torch.Tensor | None = None

    def reset_buffers(self) -> None:
        self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor, spans: TokenSpans | None = None) -> torch.Tensor:
        """`x` [..., hidden]; `spans`: its samples, and which tokens load statistics count (None: one sample,
        every token counted)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        route = self.gate(x)
        k = route.experts.shape[-1]
        flat = route.experts.flatten()  # [tokens · k]: token t's choices at t·k … t·k + k − 1
        # expert parallelism's chunks (`experts.chunks`, set with its exchange): runs of consecutive tokens, each
        # sorted by expert — a valid exchange of its own, made by this sort at no extra row move
        key, chunks, num = flat, self.experts.chunks, self.experts.num_experts
        if chunks > 1:
            token = torch.arange(flat.numel(), device=flat.device) // k
            key = token * chunks // max(1, flat.numel() // k) * num + flat
        order = key.argsort(stable=True)
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        # a static shape [E] (bincount's depends on the data: a graph break under compile); integer adds are exact
        counts = flat.new_zeros(chunks * num).scatter_add_(0, key, torch.ones_like(flat))
        if chunks > 1:
            counts = counts.view(chunks, num)
        # cast before the k copies are made (autocast's fp32 stream: half the bytes moved, and sent under EP)
        y = self.experts(spread_rows(x.to(compute_dtype(x)), order, back, k), counts)
        y = y * route.weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        out = take_rows(y, back).view(-1, k, shape[-1]).sum(1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        mask = None if spans is None or spans.counted is None else spans.counted.reshape(-1)
        if torch.is_grad_enabled():
            weight = torch.ones_like(flat, dtype=torch.float32) if mask is None else mask.repeat_interleave(k).float()
            _count_routed(self.tokens_per_expert, flat, weight)
            out = self._with_aux_gradient(out, route, mask, spans)
        return out.view(shape)

    def _with_aux_gradient(self, out: torch.Tensor, route: Routing, mask: torch.Tensor | None,
                           spans: TokenSpans | None) -> torch.Tensor:
        scales = self.aux_scale
        if scales is None or not (self.z_loss_coef or self.seq_aux_loss_coef):
            return out
        aux = out.new_zeros((), dtype=torch.float32)
        if self.z_loss_coef:
            z = torch.logsumexp(route.logits, dim=-1).square()
            # coefficient × scale in fp64, then fp32: the rounding Python floats gave when the scale was one
            aux = aux + (self.z_loss_coef * scales[0]).float() * (z if mask is None else z * mask.float()).sum()
        if self.seq_aux_loss_coef:
            aux = aux + (self.seq_aux_loss_coef * scales[1]).float() * _sequence_balance(route, mask, spans)
        return _AddGradient.apply(out, aux, 1.0)


# under CUDA graphs a replay would skip the recomputation check: inductor leaves the op outside the graph
_CUDAGRAPH_UNSAFE = tuple(t for t in [getattr(torch.Tag, "cudagraph_unsafe", None)] if t is not None)


@torch.library.custom_op("loom::count_routed", mutates_args=("total",), tags=_CUDAGRAPH_UNSAFE)
def _count_routed(total: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor) -> None:
    """total[e] += the weights of the choices of e, except in activation checkpointing's recomputation (it runs
    inside backward): an op, so that compile keeps this run-time check in its graph instead of breaking it."""
    if torch._C._current_graph_task_id() == -1:
        total.index_add_(0, experts, weight)


@torch.compiler.disable  # sample bounds from the host, and under cp a collective: eager
def _sequence_balance(route: Routing, mask: torch.Tensor | None, spans: TokenSpans | None) -> torch.Tensor:
    """Σ over samples of Σ_e f_e · P_e (DeepSeek-V3's sequence-wise balance loss), this rank's part of it: the
    counts f are whole-sample (summed over cp, detached), the scores P this rank's tokens' share."""
    tokens, experts = route.scores.shape
    k = route.experts.shape[-1]
    sample, n = _sample_of_token(spans, tokens, route.scores.device)
    weight = torch.ones(tokens, device=sample.device) if mask is None else mask.float()
    counts = torch.zeros(n * experts, device=sample.device).index_add_(
        0, (sample[:, None] * experts + route.experts).flatten(), weight.repeat_interleave(k)).view(n, experts)
    if spans is not None and spans.context is not None:
        counts = spans.context.sum_over_context(counts)
    size = (counts.sum(-1) / k).clamp(min=1.0)[:, None]  # each sample's counted tokens
    f = counts * experts / (k * size)
    probs = route.scores / route.scores.sum(-1, keepdim=True)  # sigmoid scores normalised per token, as DeepSeek-V3
    p_sum = torch.zeros(n, experts, device=sample.device).index_add_(0, sample, probs * weight[:, None])
    return (f * p_sum / size).sum()


def _sample_of_token(spans: TokenSpans | None, tokens: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Each token's sample index (packed: its cu_seqlens segment; padded: its row) and the number of samples."""
    if spans is None or (not spans.packed and spans.pad_mask is None):
        return torch.zeros(tokens, dtype=torch.long, device=device), 1
    if not spans.packed:
        rows, seq = spans.pad_mask.shape
        return torch.arange(rows, device=device).repeat_interleave(seq), rows
    bounds = spans.bounds if spans.bounds is not None else tuple(spans.cu_seqlens.tolist())
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths), len(lengths)


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
