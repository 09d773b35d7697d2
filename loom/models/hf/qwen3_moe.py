"""Qwen3-MoE's config.json ↔ the mixture-of-experts keys of loom's LLMConfig (the rest of a Qwen3-MoE config
is Qwen3's, read by mapping.py); its per-expert tensor names are models/hf/stacked.py's."""

from __future__ import annotations

from loom.models.hf.errors import HFError
from loom.models.llm import LLMConfig


def qwen3_moe_keys(hf: dict) -> dict:
    """Qwen3-MoE's expert keys, absent ones at Qwen3MoeConfig's defaults; transformers 5 writes `num_experts`
    as `num_local_experts` (its attribute map), 4 as `num_experts`."""
    return dict(
        num_experts=hf.get("num_local_experts", hf.get("num_experts", 128)),
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=list(hf.get("mlp_only_layers") or []),
    )


def qwen3_moe_to_hf(cfg: LLMConfig) -> dict:
    """The expert keys of a config.json; `num_experts` is what transformers 4 reads and 5 maps."""
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size,
                norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
                mlp_only_layers=list(cfg.mlp_only_layers))


# what a Qwen3-MoE config cannot say: these keys must keep the values given
_NOT_IN_QWEN3_MOE = {"router_score": "softmax", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                     "n_shared_experts": 0, "first_k_dense_replace": 0, "router_bias": False,
                     "router_bias_update_rate": 0.0}


def check_qwen3_moe(cfg: LLMConfig) -> None:
    if not cfg.qk_norm or cfg.attention_bias:
        raise HFError("language: a mixture-of-experts LLM exports as Qwen3-MoE, which has qk_norm = true and "
                      "attention_bias = false")
    off = {k: getattr(cfg, k) for k, v in _NOT_IN_QWEN3_MOE.items() if getattr(cfg, k) != v}
    if off:
        raise HFError(f"language: model.language {off} have no Qwen3-MoE counterpart (it needs "
                      f"{ {k: _NOT_IN_QWEN3_MOE[k] for k in off} })")
