"""Keys and values kept across forwards for generation: the prompts prefilled packed, then one token per sequence
per decode step.

The cache is padded ([sequences, capacity, kv heads, key or value dim] per layer) with each sequence's length kept
beside it. A forward hands each layer its `LayerCache`, whose `attend` replaces the layer's attention:
- prefill (packed spans, THD): every prompt's keys and values are written at positions 0..len − 1 of its row,
  and the prompts attend among themselves causally, exactly as in training;
- decode (padded spans, one token per row): the new key and value are written at each row's length, and the
  query attends to that row's keys up to and including it (a mask per row: rows have different lengths).
`advance(n)` moves the lengths after every layer has written (n: the tokens each row just received). Decode
attends over the whole capacity with a mask, so its shapes never change (a compiled step traces once).

Under multi-head latent attention a layer keeps each token's latent and rotary key ([sequences, capacity, latent
width]: DeepSeek-V3's 576 values a token against 40,960 for its expanded keys and values); prefill expands the
prompts' rows as training does, and decode attends in the latent space (`LatentAttention.attend_absorbed`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.data.spans import TokenSpans
from loom.models.attention import attend, attend_latent, host_bounds


class KVCache:
    def __init__(self, cfg, layers: list[str], sequences: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """`cfg`: the LLM's LLMConfig (which attention, its widths); `layers`: the names of the layers to serve."""
        def rows(*dims: int) -> torch.Tensor:
            return torch.zeros((sequences, capacity, *dims), dtype=dtype, device=device)

        if cfg.latent:
            width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
            self.layers = {name: LatentLayerCache(self, rows(width)) for name in layers}
        else:
            self.layers = {name: LayerCache(self, rows(cfg.num_kv_heads, cfg.key_dim),
                                            rows(cfg.num_kv_heads, cfg.value_dim)) for name in layers}
        self.lengths = torch.zeros(sequences, dtype=torch.long, device=device)  # keys each row holds
        self.capacity = capacity

    def layer(self, name: str) -> LayerCache | LatentLayerCache:
        return self.layers[name]

    def advance(self, tokens: torch.Tensor | int) -> None:
        """Every layer has written this forward's keys: each row holds `tokens` (per row, or all alike) more."""
        self.lengths += tokens


class LayerCache:
    def __init__(self, cache: KVCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.cache, self.keys, self.values = cache, keys, values

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: TokenSpans) -> torch.Tensor:
        if spans.packed:
            return self._prefill(q, k, v, spans)
        return self._decode(q, k, v)

    def _prefill(self, q, k, v, spans: TokenSpans) -> torch.Tensor:
        """Packed prompts [tokens, heads, dim]: row r's prompt goes to positions lengths[r]… of row r."""
        row, place = _places(self.cache.lengths, spans, k.device)
        self.keys[row, place] = k.to(self.keys.dtype)
        self.values[row, place] = v.to(self.values.dtype)
        return attend(q, k, v, spans, causal=True)

    def _decode(self, q, k, v) -> torch.Tensor:
        """One new token per row ([rows, 1, heads, dim]): written at the row's length, attending to its keys."""
        rows = torch.arange(q.shape[0], device=q.device)
        at = self.cache.lengths
        self.keys[rows, at] = k[:, 0].to(self.keys.dtype)
        self.values[rows, at] = v[:, 0].to(self.values.dtype)
        # over the whole capacity, masked per row: one shape at every step, so a compiled decode step is
        # traced once (reading the unused tail costs less than a recompile per length)
        keys, values = self.keys, self.values
        mask = torch.arange(self.cache.capacity, device=q.device)[None, :] <= at[:, None]  # [rows, keys]
        # grouped heads read in place (enable_gqa), not repeated: a decode step reads the whole cache once
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2).to(q.dtype),
                                             values.transpose(1, 2).to(q.dtype), attn_mask=mask[:, None, None, :],
                                             enable_gqa=True)
        return out.transpose(1, 2)


def _places(lengths: torch.Tensor, spans: TokenSpans, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed prompts: each token's row, and its position in that row (after what the row already holds)."""
    bounds = host_bounds(spans)
    row = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=device),
                                  torch.as_tensor([e - s for s, e in zip(bounds, bounds[1:])], device=device))
    offset = torch.arange(bounds[-1], device=device) - torch.as_tensor(bounds[:-1], device=device)[row]
    return row, lengths[row] + offset


class LatentLayerCache:
    """One latent-attention layer's cache: each token's latent and rotary key, `[rows, capacity, width]`."""

    def __init__(self, cache: KVCache, latents: torch.Tensor) -> None:
        self.cache, self.latents = cache, latents

    def attend(self, q: torch.Tensor, latent: torch.Tensor, spans: TokenSpans, expand, absorbed) -> torch.Tensor:
        """`latent`: this forward's compressed rows; `expand(rows) -> (k, v)` for a prefill; `absorbed(q, rows,
        mask)`: attention over cached rows in the latent space, for a decode step."""
        if spans.packed:  # prefill: the prompts' rows written, then attended among themselves as in training
            row, place = _places(self.cache.lengths, spans, latent.device)
            self.latents[row, place] = latent.to(self.latents.dtype)
            return attend_latent(q, latent, expand, spans, causal=True)
        rows, at = torch.arange(q.shape[0], device=q.device), self.cache.lengths
        self.latents[rows, at] = latent[:, 0].to(self.latents.dtype)
        mask = torch.arange(self.cache.capacity, device=q.device)[None, :] <= at[:, None]  # [rows, keys]
        return absorbed(q, self.latents.to(q.dtype), mask)
