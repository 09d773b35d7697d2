"""GLM-4.5's config.json (`glm4_moe`: GLM-4.5, -4.5-Air, -4.6) ↔ loom's LLMConfig keys: grouped-query attention
with q/k/v bias (`attention_bias`), optional QK-norm (`use_qk_norm`), rotary on the first half of each head
(`partial_rotary_factor`, 0.5 when absent, as transformers assumes), and DeepSeek-V3's routing (sigmoid scores,
a selection bias, groups scored by their best two, a shared expert). The rest is read by mapping.py like any
Llama-style config; its multi-token-prediction layer after the last is skipped as DeepSeek's is.
"""

from __future__ import annotations

from loom.models.hf.deepseek import routed_to_hf, routing_mismatches
from loom.models.hf.errors import HFError
from loom.models.llm import LLMConfig

PARTIAL_ROTARY_DEFAULT = 0.5


def glm4_moe_keys(hf: dict) -> dict:
    """The keys a `glm4_moe` config sets beyond a Llama's, absent ones at Glm4MoeConfig's defaults."""
    return dict(
        attention_bias=bool(hf.get("attention_bias", False)),  # q/k/v only: o_proj has none, as loom's
        qk_norm=bool(hf.get("use_qk_norm", False)),
        num_experts=hf.get("n_routed_experts", 128),
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 1408),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        first_k_dense_replace=hf.get("first_k_dense_replace", 1),
        router_score="sigmoid",
        router_bias=True,
        n_group=hf.get("n_group", 1),
        topk_group=hf.get("topk_group", 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_shared_experts=hf.get("n_shared_experts", 1),
    )


def glm4_moe_to_hf(cfg: LLMConfig) -> dict:
    return dict(attention_bias=cfg.attention_bias, use_qk_norm=cfg.qk_norm, **routed_to_hf(cfg))


def check_glm4_moe(cfg: LLMConfig) -> None:
    """What a GLM-4.5 config cannot say about a loom LLM with sigmoid-routed experts (DeepSeek-V3's routing)."""
    off, _ = routing_mismatches(cfg)
    if off:
        raise HFError(f"language: model.language {off} have no GLM-4.5 (glm4_moe) counterpart: it routes by sigmoid "
                      f"scores with a selection bias and a shared expert, sparse from first_k_dense_replace on")
