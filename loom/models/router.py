"""Which experts each token goes to, and with what weight: the router of a mixture-of-experts block.

Two scoring rules, as the checkpoints that use them define them:
- ``softmax`` (Qwen3-MoE, Mixtral): softmax over the experts, the top k, optionally renormalised to sum 1;
- ``sigmoid`` (DeepSeek-V3): a sigmoid per expert; the *choice* adds a per-expert bias (auxiliary-loss-free
  load balancing, updated outside the model); the weights are the unbiased scores of the chosen experts,
  renormalised when asked, times `routed_scaling_factor`.
Either may first keep only the `topk_group` best of `n_group` expert groups: a group scores the sum of its two
best (DeepSeek-V3, `group_score = "top2_sum"`) or its best (DeepSeek-V2's softmax routing, `"max"`).

Everything here runs in fp32 whatever the model's dtype: a bf16 router flips near-tied choices from step to
step and between layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.model_config import RouterSpec


@dataclass
class Routing:
    """One batch's routing: `experts` [tokens, k] (int64), `weights` [tokens, k] fp32, `scores` [tokens, E]
    fp32 (the unbiased scores: auxiliary losses read them), `logits` [tokens, E] fp32 (the z-loss reads them)."""

    experts: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    logits: torch.Tensor


class Router(nn.Module):
    """Named `gate` in its block, with `weight` [E, hidden] and the optional `e_score_correction_bias` [E], as
    in Hugging Face's Qwen3-MoE and DeepSeek-V3 checkpoints."""

    def __init__(self, hidden: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden))
        if spec.choice_bias:
            # a buffer, not a parameter: no gradient moves it; the load-balance update does (train/expert_load.py)
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts))
        else:
            self.e_score_correction_bias = None

    def reset_buffers(self) -> None:
        """Zero bias after storage is given on `meta` (a folder or checkpoint that holds it overwrites it)."""
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor) -> Routing:
        s = self.spec
        with torch.autocast(x.device.type, enabled=False):  # fp32 even under bf16 autocast
            logits = F.linear(x.float(), self.weight.float())
            scores = logits.softmax(-1) if s.score == "softmax" else logits.sigmoid()
            choice = scores.detach()
            if self.e_score_correction_bias is not None:
                choice = choice + self.e_score_correction_bias.float()
            if s.n_group > 1:
                choice = _best_groups_only(choice, s.n_group, s.topk_group, s.group_score)
            experts = choice.topk(s.top_k, dim=-1).indices
            weights = scores.gather(-1, experts)
            if s.norm_topk_prob:
                # DeepSeek-V3's epsilon keeps a sigmoid's tiny scores finite; softmax top-k sums are never 0
                weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if s.score == "sigmoid" else 0.0))
            weights = weights * s.routed_scaling_factor
        return Routing(experts, weights, scores, logits)


def _best_groups_only(choice: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """`choice` with the experts outside each token's `topk_group` best groups set to 0 (scores are ≥ 0 but a
    negative bias may push them below: DeepSeek-V3 masks with 0 too, so do we)."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, n_group, experts // n_group)
    best = 1 if group_score == "max" else min(2, experts // n_group)
    score = grouped.topk(best, dim=-1).values.sum(-1)
    keep = torch.zeros_like(score).scatter_(1, score.topk(topk_group, dim=-1).indices, 1.0)
    return grouped.masked_fill(keep.unsqueeze(-1) == 0, 0.0).view(tokens, experts)
