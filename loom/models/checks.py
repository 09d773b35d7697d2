"""The [model] table's sizes, checked before anything is built: caught here, not by a failing forward or a
silently degenerate model. Layout-dependent checks (a tp degree splitting the heads, ...) are
topology/checks.py's; sizes read from a Hugging Face folder are filled in first (models/hf/load.py).
"""

from __future__ import annotations

import dataclasses

import torch

from loom.data.anyres import check_pinpoints
from loom.models.experts import grouped_mm
from loom.models.layers import rope_type
from loom.models.llm import LLMConfig
from loom.models.multimodal import ModelConfig
from loom.typed_config import ConfigError, check_non_negative, check_positive

# sizes that must be ≥ 1 in every model config that has them (head_dim 0 means "derived")
SIZE_FIELDS = {
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "channels", "patch_size", "position_grid", "num_features", "max_positions",
}


def check_model(m: ModelConfig, tokenizer_vocab: int) -> None:
    """The LLM and the encoders in use; `tokenizer_vocab`: the ids the LLM's vocabulary must hold (0 when the
    tokenizer is a user's, whose added ids train/job_data.py grows the vocabulary by)."""
    check_positive({f"model.{name}.{k}": v for name in ("language", *m.encoders)
                    for k, v in dataclasses.asdict(getattr(m, name)).items()
                    if k in SIZE_FIELDS and not (k == "head_dim" and v == 0)})
    check_language(m.language, tokenizer_vocab)
    for name in m.encoders:
        enc = getattr(m, name)
        if enc.hidden_size % enc.num_heads:
            raise ConfigError(
                f"model.{name}.hidden_size = {enc.hidden_size} is not divisible by "
                f"model.{name}.num_heads = {enc.num_heads}"
            )
    if m.vision.position_grid < 1 or m.vision.patch_size < 1:
        raise ConfigError("model.vision.patch_size and model.vision.position_grid must be ≥ 1")
    v = m.vision
    if "vision" in m.encoders and v.grid_pinpoints:  # LLaVA-OneVision's anyres canvases, whole tiles each
        bad = check_pinpoints(v.grid_pinpoints, v.position_grid * v.patch_size)
        if bad or v.max_tiles < 1:
            raise ConfigError(f"model.vision.grid_pinpoints = {v.grid_pinpoints}, max_tiles = {v.max_tiles}: "
                              f"{bad or 'max_tiles must be ≥ 1'}")


def check_language(lm: LLMConfig, tokenizer_vocab: int) -> None:
    if lm.num_heads % lm.num_kv_heads:
        raise ConfigError(
            f"model.language.num_heads = {lm.num_heads} is not divisible by num_kv_heads = {lm.num_kv_heads} "
            f"(grouped-query attention shares each KV head among an equal number of query heads)"
        )
    if not lm.head_dim and lm.hidden_size % lm.num_heads:
        raise ConfigError(
            f"model.language.hidden_size = {lm.hidden_size} is not divisible by num_heads = {lm.num_heads}; "
            f"set model.language.head_dim explicitly"
        )
    if not 0 < lm.partial_rotary_factor <= 1:
        raise ConfigError(f"model.language.partial_rotary_factor = {lm.partial_rotary_factor} must be in (0, 1]")
    if lm.rope_dim % 2 and not lm.latent:
        what = "head dim" if lm.partial_rotary_factor == 1 else "rotated dims (head dim × partial_rotary_factor)"
        raise ConfigError(f"model.language {what} = {lm.rope_dim} must be even for rotary embedding")
    check_rope_scaling(lm)
    check_latent_attention(lm)
    check_experts(lm)
    if lm.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.language.vocab_size = {lm.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids"
        )


# each rope type's keys that have no default (Hugging Face's names)
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings"), "mrope": ()}


def check_rope_scaling(lm: LLMConfig) -> None:
    """model.language.rope_scaling: a known type with its keys, here rather than when the model is built."""
    if lm.rope_scaling is None:
        return
    kind = rope_type(lm.rope_scaling)
    if kind not in ROPE_KEYS:
        raise ConfigError(f"model.language.rope_scaling: rope type {kind!r} is not supported; use one of "
                          f"{sorted(ROPE_KEYS)}")
    if kind == "mrope":  # Qwen2-VL: three sections of the rotary frequencies, one per position stream
        section = lm.rope_scaling.get("mrope_section")
        if not (isinstance(section, list) and len(section) == 3 and sum(section) == lm.rope_dim // 2):
            raise ConfigError(f"model.language.rope_scaling: mrope needs mrope_section, three counts summing to half "
                              f"the rotary dims ({lm.rope_dim // 2}); it has {lm.rope_scaling}")
        return
    missing = [k for k in ROPE_KEYS[kind] if not isinstance(lm.rope_scaling.get(k), (int, float))]
    if missing:
        raise ConfigError(f"model.language.rope_scaling: {kind} scaling needs {missing} (numbers); it has "
                          f"{lm.rope_scaling}")


def check_latent_attention(lm: LLMConfig) -> None:
    """The multi-head latent attention keys of [model.language]; without kv_lora_rank, none of them may be set."""
    key = "model.language"
    mla = {f"{key}.{k}": getattr(lm, k) for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                                    "qk_rope_head_dim", "v_head_dim")}
    check_non_negative(mla)
    if not lm.latent:
        stray = [k for k, v in mla.items() if v] + ([f"{key}.rope_interleave"] if lm.rope_interleave else [])
        if stray:
            raise ConfigError(f"{stray} belong to multi-head latent attention, which {key}.kv_lora_rank = 0 "
                              f"turns off: set kv_lora_rank, or drop them")
        return
    check_positive({f"{key}.qk_rope_head_dim": lm.qk_rope_head_dim, f"{key}.v_head_dim": lm.v_head_dim})
    if lm.qk_rope_head_dim % 2:
        raise ConfigError(f"{key}.qk_rope_head_dim = {lm.qk_rope_head_dim} must be even for rotary embedding")
    if lm.num_kv_heads != lm.num_heads:
        raise ConfigError(f"{key}.num_kv_heads = {lm.num_kv_heads} must equal num_heads = {lm.num_heads} under "
                          f"multi-head latent attention (kv_lora_rank = {lm.kv_lora_rank}): every head expands its "
                          f"own key and value from the latent")
    if lm.partial_rotary_factor != 1:
        raise ConfigError(f"{key}.partial_rotary_factor = {lm.partial_rotary_factor} has no meaning under multi-head "
                          f"latent attention: qk_rope_head_dim = {lm.qk_rope_head_dim} says which dims rotate")
    if lm.qk_norm:
        raise ConfigError(f"{key}.qk_norm has no meaning under multi-head latent attention (kv_lora_rank = "
                          f"{lm.kv_lora_rank}): its latents have norms of their own")
    if lm.v_head_dim > lm.key_dim:
        raise ConfigError(f"{key}.v_head_dim = {lm.v_head_dim} must be ≤ qk_nope_head_dim + qk_rope_head_dim = "
                          f"{lm.key_dim}: FlashAttention takes one head width, and values are padded to the keys'")


def check_experts(lm: LLMConfig) -> None:
    """The mixture-of-experts keys of [model.language]; nothing to check for a dense LLM (num_experts = 0)."""
    key = "model.language"
    if lm.num_experts < 0:
        raise ConfigError(f"{key}.num_experts = {lm.num_experts} must be ≥ 0 (0: every layer dense)")
    if not lm.num_experts:
        return
    check_positive({f"{key}.num_experts_per_tok": lm.num_experts_per_tok, f"{key}.n_group": lm.n_group,
                    f"{key}.topk_group": lm.topk_group, f"{key}.decoder_sparse_step": lm.decoder_sparse_step,
                    f"{key}.routed_scaling_factor": lm.routed_scaling_factor})
    check_non_negative({f"{key}.moe_intermediate_size": lm.moe_intermediate_size,
                        f"{key}.n_shared_experts": lm.n_shared_experts,
                        f"{key}.first_k_dense_replace": lm.first_k_dense_replace,
                        f"{key}.router_bias_update_rate": lm.router_bias_update_rate,
                        f"{key}.router_z_loss_coef": lm.router_z_loss_coef,
                        f"{key}.router_seq_aux_loss_coef": lm.router_seq_aux_loss_coef})
    if lm.num_experts_per_tok > lm.num_experts:
        raise ConfigError(f"{key}.num_experts_per_tok = {lm.num_experts_per_tok} must be ≤ num_experts = "
                          f"{lm.num_experts} (valid: 1…{lm.num_experts})")
    if lm.num_experts % lm.n_group:
        raise ConfigError(f"{key}.n_group = {lm.n_group} must divide num_experts = {lm.num_experts} (valid: "
                          f"{[d for d in range(1, lm.num_experts + 1) if lm.num_experts % d == 0]})")
    if lm.topk_group > lm.n_group:
        raise ConfigError(f"{key}.topk_group = {lm.topk_group} must be ≤ n_group = {lm.n_group}")
    reachable = lm.topk_group * (lm.num_experts // lm.n_group)
    if lm.num_experts_per_tok > reachable:
        raise ConfigError(f"{key}.num_experts_per_tok = {lm.num_experts_per_tok} exceeds the {reachable} experts "
                          f"of the topk_group = {lm.topk_group} groups a token may use (valid: 1…{reachable})")
    bad = [i for i in lm.mlp_only_layers if not 0 <= i < lm.num_layers]
    if bad:
        raise ConfigError(f"{key}.mlp_only_layers = {lm.mlp_only_layers}: layers {bad} do not exist "
                          f"(valid: 0…{lm.num_layers - 1})")
    if lm.expert_kernel == "grouped" and grouped_mm is None:
        raise ConfigError(f"{key}.expert_kernel = 'grouped' needs torch's grouped_mm, which torch "
                          f"{torch.__version__} lacks; use 'auto' or 'loop'")
