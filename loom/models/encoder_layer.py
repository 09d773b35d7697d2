"""Pre-norm bidirectional transformer layer shared by the vision (SigLIP/ViT) and audio (Whisper) encoders."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from loom.data.spans import FILLER_PIECES, ROW_MULTIPLE, TokenSpans, filler_lengths
from loom.models.attention import attend
from loom.models.layers import GeluMLP, project


class EncoderAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, key_bias: bool = True) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=key_bias)  # Whisper's key projection has no bias
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, spans: TokenSpans) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in project(x, (self.q_proj, self.k_proj, self.v_proj)))
        return self.out_proj(attend(q, k, v, spans, causal=False).flatten(-2))


class EncoderLayer(nn.Module):
    def __init__(
        self, dim: int, num_heads: int, mlp_dim: int, eps: float, act: str = "none", key_bias: bool = True
    ) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = EncoderAttention(dim, num_heads, key_bias)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = GeluMLP(dim, mlp_dim, approximate=act)

    def forward(self, h: torch.Tensor, spans: TokenSpans) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h), spans)
        return h + self.mlp(self.layer_norm2(h))


# under CUDA graphs (train.compile_mode = "reduce-overhead") each distinct row count is captured once, and once
# more for every combination with the other encoders' counts (a graph tree's path, the LLM's graphs below it:
# 5–7 s each on an H200 at T = 8192): rows are rounded up to a quarter of the budget, so at most 4 per encoder
GRAPH_ROW_BUCKETS = 4
_warned: set[RowBudget] = set()


@dataclass(frozen=True)
class RowBudget:
    """Fixed shapes for compiled encoder layers (train.compile with a token budget): every call's items are
    padded to `items` segments and attention's longest item bounded by `rows`, while the rows themselves are
    only rounded up to ROW_MULTIPLE and compiled dynamic (parallel/compile.py) — one graph for any row count: the
    layers compute the rows the data has, not the budget (a ViT fed 3.5K patches under an 8K budget did 2.4×).
    Under CUDA graphs `multiple` is a quarter of the budget and each of those few counts compiles static."""

    rows: int
    items: int
    multiple: int = ROW_MULTIPLE  # the rows of a call are rounded up to this

    @property
    def segments(self) -> int:
        return self.items + FILLER_PIECES  # and the filler's pieces that round the rows up


def run_packed(h: torch.Tensor, lengths: list[int], layers: Iterable[nn.Module], budget: RowBudget | None = None
               ) -> torch.Tensor:
    """Runs the layers over items packed one after another in `h` ([sum of lengths, dim]); attention stays
    inside each item (one packed segment per image or clip), so no item is padded to the largest."""
    rows = h.shape[0]
    fits = budget is not None and rows <= budget.rows and len(lengths) <= budget.items
    if budget is not None and not fits and budget not in _warned:
        _warned.add(budget)
        warnings.warn(f"encoder microbatch of {rows} rows in {len(lengths)} items exceeds its fixed budget "
                      f"({budget.rows} rows, {budget.items} items): rounded up to {ROW_MULTIPLE} rows instead, "
                      "a new shape that compiles again; raise data.encoder_rows_per_microbatch", stacklevel=2)
    fill = -rows % (budget.multiple if budget is not None else ROW_MULTIPLE)
    if fill:
        h = torch.cat([h, h.new_zeros(fill, h.shape[1])])
        lengths = [*lengths, *filler_lengths(fill)]
    # the longest segment: an item (≤ rows) or a filler piece (< multiple, which may exceed a small budget's rows)
    spans = TokenSpans.from_lengths(lengths, device=h.device, segments=budget.segments if fits else 0,
                                      max_seqlen=max(budget.rows, budget.multiple) if fits else 0)
    for layer in layers:
        h = layer(h, spans)
    return h[:rows]
