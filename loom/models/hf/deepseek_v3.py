"""DeepSeek-V3's config.json ↔ loom's LLMConfig keys for multi-head latent attention and its routing (the rest
of the config is read by mapping.py like any Llama-style config). Moonlight and other `deepseek_v3` folders read
the same way. Its routed experts are stored per expert, as Qwen3-MoE's (models/hf/stacked.py).

transformers' DeepseekV3 always routes by sigmoid scores with the selection bias (`e_score_correction_bias`),
group-limited; `scoring_func` / `topk_method` other than that are refused rather than read as something else.
"""

from __future__ import annotations

from loom.models.hf.errors import HFError
from loom.models.llm import LLMConfig

_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def deepseek_v3_keys(hf: dict, where: str) -> dict:
    """The attention and expert keys of a `deepseek_v3` config, absent ones at DeepseekV3Config's defaults."""
    off = {k: hf[k] for k, v in _ROUTING.items() if hf.get(k, v) != v}
    if off:
        raise HFError(f"{where}: {off} is not supported: transformers' DeepseekV3 (and loom) route by {_ROUTING}")
    if hf.get("quantization_config"):
        raise HFError(f"{where}: quantized weights ({hf['quantization_config'].get('quant_method', '?')}) are not "
                      f"supported: convert the folder to bf16 first (DeepSeek's fp8_cast_bf16.py)")
    heads = hf["num_attention_heads"]
    experts = hf.get("n_routed_experts", 256) or 0
    return dict(
        num_kv_heads=heads,  # every head expands its own key and value from the latent
        head_dim=0,
        q_lora_rank=hf.get("q_lora_rank", 1536) or 0,  # null: one query projection
        kv_lora_rank=hf.get("kv_lora_rank", 512),
        qk_nope_head_dim=hf.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=hf.get("qk_rope_head_dim", 64),
        v_head_dim=hf.get("v_head_dim", 128),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
        num_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 2048),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        first_k_dense_replace=hf.get("first_k_dense_replace", 3) if experts else 0,
        router_score="sigmoid",
        n_group=hf.get("n_group", 8),
        topk_group=hf.get("topk_group", 4),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
        n_shared_experts=hf.get("n_shared_experts", 1) or 0,
        router_bias=bool(experts),
    )


def deepseek_v3_to_hf(cfg: LLMConfig) -> dict:
    """The config.json keys of the same; a dense loom LLM with latent attention has every layer dense."""
    routed = dict(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                  moe_intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size,
                  norm_topk_prob=cfg.norm_topk_prob, first_k_dense_replace=cfg.first_k_dense_replace,
                  n_group=cfg.n_group, topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                  n_shared_experts=cfg.n_shared_experts)
    if not cfg.num_experts:  # transformers builds a router for layers ≥ first_k_dense_replace: none here
        routed.update(n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
                      first_k_dense_replace=cfg.num_layers, n_shared_experts=0)
    return dict(q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim, rope_interleave=cfg.rope_interleave,
                attention_bias=cfg.attention_bias, scoring_func="sigmoid", topk_method="noaux_tc", **routed)


def check_deepseek_v3(cfg: LLMConfig) -> None:
    """What a DeepSeek-V3 config cannot say about a loom LLM with latent attention."""
    off = {}
    if cfg.num_experts:
        want = {"router_score": "sigmoid", "decoder_sparse_step": 1, "mlp_only_layers": []}
        off = {k: getattr(cfg, k) for k, v in want.items() if getattr(cfg, k) != v}
        if not (cfg.router_bias or cfg.router_bias_update_rate > 0):
            off["router_bias"] = False
    if off:
        raise HFError(f"language: model.language {off} have no DeepSeek-V3 counterpart (it routes by sigmoid "
                      f"scores with a selection bias, sparse from first_k_dense_replace on)")
