"""Decoder LLM of the Llama / Qwen2 / Qwen3 family, numerically the same architecture as their checkpoints.

Parameter names follow the Hugging Face layout (`layers.N.self_attn.q_proj`, ...) so weights map one to one.
Layers live in a ModuleDict keyed by their index: a pipeline stage can drop layers and keep the names.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.data.spans import TokenSpans
from loom.model_config import LLMConfig
from loom.models.attention import attend
from loom.models.kv_cache import KVCache, LayerCache
from loom.models.latent_attention import LatentAttention
from loom.models.experts import Experts
from loom.models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary, project
from loom.models.moe import MoEBlock
from loom.models.router import Router


class Attention(nn.Module):
    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        d = cfg.dim_per_head
        self.head_dim = d
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], spans: TokenSpans,
                cache: LayerCache | None = None) -> torch.Tensor:
        # one fused matmul when training or scoring; a decode step keeps three (the concatenated weights would
        # be one more pass over them per token)
        linears = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = project(x, linears) if cache is None else (p(x) for p in linears)
        # heads inferred (-1) so a tensor-parallel shard with fewer local heads runs unchanged
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        # under autocast the qk norms' fp32 weights promote q, k to fp32: attend in v's dtype (varlen needs bf16)
        q, k = q.to(v.dtype), k.to(v.dtype)
        out = attend(q, k, v, spans, causal=True) if cache is None else cache.attend(q, k, v, spans)
        return self.o_proj(out.flatten(-2))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LLMConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg) if cfg.latent else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sparse = cfg.is_sparse(index)
        if self.sparse:
            self.mlp = MoEBlock(cfg.hidden_size, cfg.router_spec(), cfg.moe_intermediate_size or cfg.intermediate_size,
                                cfg.n_shared_experts, cfg.expert_kernel, cfg.router_z_loss_coef,
                                cfg.router_seq_aux_loss_coef)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], spans: TokenSpans,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = self.input_layernorm(h)
        # the cache only when there is one: tensor parallel's input plans count a module's arguments
        h = h + (self.self_attn(x, rope, spans) if cache is None else self.self_attn(x, rope, spans, cache))
        x = self.post_attention_layernorm(h)
        # an expert block is told the samples and which tokens its load statistics count (not padding or filler)
        return h + (self.mlp(x, spans) if self.sparse else self.mlp(x))


class DecoderLM(nn.Module):
    """Token embedding → decoder layers → final norm → LM head. Each part may be absent on a PP stage."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=self.cfg.init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (Router, Experts)):  # the router's rows and the stacked experts: as a Linear's weight
                for p in m.parameters(recurse=False):
                    nn.init.normal_(p, std=self.cfg.init_std)
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        spans: TokenSpans,
        inserts: dict[int, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every token ([tokens] packed or [batch, seq] padded ids). `inserts` maps a placeholder
        token id to the embeddings that replace its occurrences, in order (modality embeddings); `cache`:
        generation's keys and values (models/kv_cache.py), written and attended to by every layer; `logits_at`:
        the indices of the flattened tokens whose logits are wanted (a step's targets, a prefill's last prompt
        tokens), all when None.
        Everything runs inside this forward so FSDP's hooks gather the embedding and head weights."""
        h = embed_with_inserts(self.embed_tokens, input_ids, inserts)
        rope = self.rotary(positions, h.dtype, input_ids.dim())
        for name, layer in self.layers.items():
            h = layer(h, rope, spans) if cache is None else layer(h, rope, spans, cache.layer(name))
        return self.lm_head(self.norm(h if logits_at is None else at_rows(h, logits_at)))


def at_rows(h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Hidden states [..., hidden] at the given flattened token indices: [rows, hidden]. `index_select`, whose
    backward adds each row back once (advanced indexing's index_put would sort the indices first)."""
    return h.flatten(0, -2).index_select(0, rows)


def embed_with_inserts(embed: nn.Embedding, input_ids: torch.Tensor, inserts: dict[int, torch.Tensor] | None
                       ) -> torch.Tensor:
    """Token embeddings, with each placeholder id's occurrences replaced, in order, by its rows."""
    h = embed(input_ids)
    for token_id, rows in (inserts or {}).items():
        h = _place_rows(h, input_ids == token_id, rows.to(h.dtype))
    return h


def _place_rows(h: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`h` with its masked tokens replaced, in order, by `rows`: masked_scatter's result, but nothing here
    waits for the device (masked_scatter's backward selects by the mask, whose size the host must read)."""
    # a zero row for the unmasked tokens to point at; it also keeps an empty `rows` in the graph, so an
    # encoder without inputs this step still gets its (zero) gradients
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
    source = torch.where(mask, mask.flatten().cumsum(0).view(mask.shape) - 1, rows.shape[0])
    # an embedding lookup, not `padded[source]`: every unmasked token points at the zero row, and advanced
    # indexing's backward (index_put with accumulate) adds such duplicates one by one — 9 ms a step at 8K tokens
    # on an H200; the embedding's backward skips padding_idx, and each real row is read once (same sums)
    return torch.where(mask.unsqueeze(-1), F.embedding(source, padded, padding_idx=rows.shape[0]), h)
