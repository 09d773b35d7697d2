"""Multi-head latent attention (DeepSeek-V2/V3's MLA), numerically Hugging Face's DeepseekV3Attention.

Keys and values come from one low-rank latent per token: `kv_a_proj_with_mqa` makes the latent (`kv_lora_rank`
wide) and one rotary key (`qk_rope_head_dim` wide) that every head shares; `kv_b_proj` expands the normed latent
into each head's non-rotary key (`qk_nope_head_dim`) and its value (`v_head_dim`). Queries pass a bottleneck of
their own (`q_a_proj` → norm → `q_b_proj`) when `q_lora_rank` is set. A head's query and key are
[non-rotary | rotary]; its value may be narrower. Training expands the latent per head before attending, as
Hugging Face does (absorbing `kv_b_proj` into the queries only pays when decoding from a latent cache).
Names follow the Hugging Face layout, so checkpoints map one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from loom.data.spans import TokenSpans
from loom.models.attention import attend_latent
from loom.models.kv_cache import LatentLayerCache
from loom.models.layers import RMSNorm, apply_rotary, rope_type, yarn_mscale


class LatentAttention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.nope, self.rope, self.value_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        hidden, heads, key = cfg.hidden_size, cfg.num_heads, cfg.key_dim
        bias = cfg.attention_bias  # DeepSeek's: on the two down-projections and o_proj
        # the bottlenecks' norms keep RMSNorm's default ε whatever rms_norm_eps says, as DeepseekV3Attention's
        self.query_bottleneck = cfg.q_lora_rank > 0
        if self.query_bottleneck:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * key, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * key, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, cfg.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (self.nope + self.value_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.value_dim, hidden, bias=bias)
        # YaRN's mscale_all_dim sharpens the softmax by mscale² on top of 1/√key; applied to the queries, so
        # every attention backend keeps its default scale
        scaling = cfg.rope_scaling or {}
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) if (
            rope_type(scaling) == "yarn" and scaling.get("mscale_all_dim")) else 1.0
        self.query_scale = mscale * mscale

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], spans: TokenSpans,
                cache: LatentLayerCache | None = None) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.query_bottleneck else self.q_proj(x)
        # heads inferred (-1) so a tensor-parallel shard with fewer local heads runs unchanged
        q_nope, q_rot = q.unflatten(-1, (-1, self.nope + self.rope)).split([self.nope, self.rope], -1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], -1)
        k_rot = k_rot.unsqueeze(-2)  # one head, read by every query head
        if self.interleave:
            q_rot, k_rot = _halves(q_rot), _halves(k_rot)
        q_rot, k_rot = apply_rotary(q_rot, *rope), apply_rotary(k_rot, *rope)
        q = torch.cat([q_nope, q_rot], -1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        # per token: the normed latent and the rotated key, from which every head's key and value are expanded; in
        # the projections' dtype (under autocast the fp32 norm weight promotes, and kv_b_proj would cast back)
        compressed = torch.cat([self.kv_a_layernorm(latent).to(k_rot.dtype), k_rot.squeeze(-2)], -1)
        if cache is None:
            out = attend_latent(q, compressed, self._expand, spans, causal=True)
        else:
            out = cache.attend(q, compressed, spans, self._expand, self.attend_absorbed)
        return self.o_proj(out.flatten(-2))

    def attend_absorbed(self, q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per row (`q` [rows, 1, heads, key]) over cached latent rows (`rows` [rows, keys, latent + rope],
        `mask` [rows, keys]) without expanding them: `kv_b_proj`'s key part folded into the queries and its value
        part applied after the weighted sum (DeepSeek's absorbed decode; the same scores and outputs up to
        rounding). Returns [rows, 1, heads, value]. Generation runs on a whole copy of the model (no tp), so
        `kv_b_proj`'s weight is every head's."""
        heads_w = self.kv_b_proj.weight.view(-1, self.nope + self.value_dim, self.kv_lora_rank)  # [heads, ·, latent]
        latent, k_rot = rows.split([self.kv_lora_rank, self.rope], -1)
        q_nope, q_rot = q[:, 0].split([self.nope, self.rope], -1)  # [rows, heads, ·]
        q_latent = torch.einsum("rhn,hnc->rhc", q_nope, heads_w[:, : self.nope])
        scores = (torch.einsum("rhc,rtc->rht", q_latent, latent) + torch.einsum("rhp,rtp->rht", q_rot, k_rot))
        weights = (scores / math.sqrt(self.nope + self.rope)).masked_fill(~mask[:, None, :], float("-inf"))
        mixed = torch.einsum("rht,rtc->rhc", weights.softmax(-1), latent)
        return torch.einsum("rhc,hvc->rhv", mixed, heads_w[:, self.nope :]).unsqueeze(1)

    def _expand(self, compressed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's key [nope | shared rotary] and value from the per-token latent and rotary key."""
        latent, k_rot = compressed.split([self.kv_lora_rank, self.rope], -1)
        k_nope, v = self.kv_b_proj(latent).unflatten(-1, (-1, self.nope + self.value_dim)).split(
            [self.nope, self.value_dim], -1)
        k = torch.cat([k_nope, k_rot.unsqueeze(-2).expand(*k_nope.shape[:-1], -1).to(k_nope.dtype)], -1)
        return k, v


def _halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary pairs (x0, x1), (x2, x3), … laid out as halves (x0, x2, … | x1, x3, …): the half-split
    rotation of this is DeepSeek's pairwise one, in the layout Hugging Face's interleaved rotation returns."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)
