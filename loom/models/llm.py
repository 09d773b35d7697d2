"""Decoder LLM of the Llama / Qwen2 / Qwen3 family, numerically the same architecture as their checkpoints.

Parameter names follow the Hugging Face layout (`layers.N.self_attn.q_proj`, ...) so weights map one to one.
Layers live in a ModuleDict keyed by their index: a pipeline stage can drop layers and keep the names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.data.spans import TokenSpans
from loom.models.attention import attend
from loom.models.kv_cache import KVCache, LayerCache
from loom.models.latent_attention import LatentAttention
from loom.models.experts import Experts
from loom.models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary, project
from loom.models.moe import MoEBlock
from loom.models.router import Router, RouterSpec
from loom.typed_config import choice


@dataclass
class LLMConfig:
    vocab_size: int = 320
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_heads
    intermediate_size: int = 384
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # as in HF configs: {"rope_type": "llama3", "factor": 8.0, ...}
    partial_rotary_factor: float = 1.0  # the share of each head's dims rotated, the first ones (GLM-4.5: 0.5)
    tie_embeddings: bool = True
    attention_bias: bool = False  # bias on q/k/v (Qwen2, GLM-4.5); latent attention: its down-projections and o_proj
    qk_norm: bool = False  # Qwen3: RMSNorm on each query/key head before RoPE
    init_std: float = 0.02
    hf: str = ""  # Hugging Face folder to load this module from: its config.json replaces all but TRAINING_KEYS
    # mixture of experts (0 experts: every layer dense). Names as in Hugging Face's Qwen3-MoE / DeepSeek-V3 configs
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0  # each routed expert's width (0: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here ...
    first_k_dense_replace: int = 0  # ... and i ≥ this (DeepSeek-V3's first dense layers)
    router_score: str = choice("softmax", "softmax", "sigmoid")  # softmax: Qwen3-MoE; sigmoid: DeepSeek-V3
    n_group: int = 1  # group-limited routing (DeepSeek-V2/V3): experts in n_group groups, the topk_group best kept
    topk_group: int = 1
    router_group_score: str = choice("top2_sum", "top2_sum", "max")  # a group: the sum of its best two (V3) or max (V2)
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0  # shared experts every token goes through (one SwiGLU n × moe_intermediate_size)
    router_bias: bool = False  # a selection-only bias per expert (DeepSeek-V3's e_score_correction_bias)
    router_bias_update_rate: float = 0.0  # aux-loss-free balancing: the bias moves by this once per step
    router_z_loss_coef: float = 0.0  # router z-loss weight (mean over tokens of logsumexp(logits)²)
    router_seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance loss weight (mean over samples)
    expert_kernel: str = choice("auto", "auto", "loop", "grouped")  # auto: grouped GEMM on CUDA in bf16, else loop
    # multi-head latent attention (DeepSeek-V3's MLA; kv_lora_rank 0: standard attention), names as in its config
    kv_lora_rank: int = 0  # the latent every head's key and value are expanded from
    q_lora_rank: int = 0  # the queries' bottleneck (0: one projection)
    qk_nope_head_dim: int = 0  # a head's query/key dims without rotary embedding ...
    qk_rope_head_dim: int = 0  # ... and with it (one rotary key shared by every head)
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs interleaved (DeepSeek's checkpoints), not split in halves

    # how to train, not what the model is: a Hugging Face folder does not say these, so a job's values stand
    TRAINING_KEYS = ("init_std", "expert_kernel", "router_bias_update_rate", "router_z_loss_coef",
                     "router_seq_aux_loss_coef")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def latent(self) -> bool:
        """Whether attention is multi-head latent attention."""
        return self.kv_lora_rank > 0

    @property
    def key_dim(self) -> int:
        """A head's query and key width."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.latent else self.dim_per_head

    @property
    def value_dim(self) -> int:
        return self.v_head_dim if self.latent else self.dim_per_head

    @property
    def rope_dim(self) -> int:
        """The rotated dims of a head's query and key."""
        return self.qk_rope_head_dim if self.latent else int(self.dim_per_head * self.partial_rotary_factor)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has a mixture-of-experts MLP: Qwen3-MoE's and DeepSeek-V3's rules."""
        return (self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
                and layer not in self.mlp_only_layers and layer >= self.first_k_dense_replace)

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_sparse(i)]

    def router_spec(self) -> RouterSpec:
        return RouterSpec(self.num_experts, self.num_experts_per_tok, self.router_score, self.norm_topk_prob,
                          self.n_group, self.topk_group, self.routed_scaling_factor,
                          self.router_bias or self.router_bias_update_rate > 0, self.router_group_score)


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
