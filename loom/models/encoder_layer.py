"""Pre-norm bidirectional transformer layer shared by the vision (SigLIP/ViT) and audio (Whisper) encoders."""

from __future__ import annotations

import torch
import torch.nn as nn

from loom.models.attention import TokenLayout, attend
from loom.models.layers import GeluMLP


class EncoderAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, key_bias: bool = True) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=key_bias)  # Whisper's key projection has no bias
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(attend(q, k, v, layout, causal=False).flatten(-2))


class EncoderLayer(nn.Module):
    def __init__(
        self, dim: int, num_heads: int, mlp_dim: int, eps: float, act: str = "none", key_bias: bool = True
    ) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = EncoderAttention(dim, num_heads, key_bias)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = GeluMLP(dim, mlp_dim, approximate=act)

    def forward(self, h: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h), layout)
        return h + self.mlp(self.layer_norm2(h))


# the packed stream is rounded up to this many rows with a filler item (attending only to itself, dropped
# after the layers): the layers then see few distinct sizes, which keeps torch.compile's variants few
ROW_MULTIPLE = 64


def run_packed(h: torch.Tensor, lengths: list[int], layers: nn.ModuleList) -> torch.Tensor:
    """Runs the layers over items packed one after another in `h` ([sum of lengths, dim]); attention stays
    inside each item (one packed segment per image or clip), so no item is padded to the largest."""
    rows = h.shape[0]
    fill = -rows % ROW_MULTIPLE
    if fill:
        h = torch.cat([h, h.new_zeros(fill, h.shape[1])])
        lengths = [*lengths, fill]
    layout = TokenLayout.from_lengths(lengths, device=h.device)
    for layer in layers:
        h = layer(h, layout)
    return h[:rows]
