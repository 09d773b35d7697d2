"""Mixtral's config.json (`mixtral`) ↔ loom's LLMConfig keys, and its tensor names: a Llama whose every MLP is a
softmax-routed mixture (top-k renormalised, no shared expert, each expert `intermediate_size` wide) stored under
`block_sparse_moe` with the experts' projections named w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from loom.models.hf.errors import HFError
from loom.models.llm import LLMConfig

# module-relative loom name → Mixtral's, per expert (stacked.py splits loom's [E, …] tensors first) and the router
RENAMES = [
    (r"^(layers\.\d+)\.mlp\.experts\.(\d+)\.gate_proj\.", r"\1.block_sparse_moe.experts.\2.w1."),
    (r"^(layers\.\d+)\.mlp\.experts\.(\d+)\.up_proj\.", r"\1.block_sparse_moe.experts.\2.w3."),
    (r"^(layers\.\d+)\.mlp\.experts\.(\d+)\.down_proj\.", r"\1.block_sparse_moe.experts.\2.w2."),
    (r"^(layers\.\d+)\.mlp\.gate\.", r"\1.block_sparse_moe.gate."),
]


def mixtral_keys(hf: dict, where: str) -> dict:
    if hf.get("router_jitter_noise"):
        raise HFError(f"{where}: router_jitter_noise = {hf['router_jitter_noise']} is not supported: loom's router "
                      f"adds no noise")
    return dict(num_experts=hf.get("num_local_experts", 8), num_experts_per_tok=hf.get("num_experts_per_tok", 2),
                moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True, router_score="softmax")


def mixtral_to_hf(cfg: LLMConfig) -> dict:
    return dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size, router_jitter_noise=0.0,
                sliding_window=None)


# what a Mixtral config cannot say: these keys must keep the values given
_NOT_IN_MIXTRAL = {"router_score": "softmax", "norm_topk_prob": True, "n_group": 1, "routed_scaling_factor": 1.0,
                   "n_shared_experts": 0, "first_k_dense_replace": 0, "decoder_sparse_step": 1, "mlp_only_layers": [],
                   "router_bias": False, "router_bias_update_rate": 0.0, "attention_bias": False}


def check_mixtral(cfg: LLMConfig) -> None:
    off = {k: getattr(cfg, k) for k, v in _NOT_IN_MIXTRAL.items() if getattr(cfg, k) != v}
    if cfg.moe_intermediate_size not in (0, cfg.intermediate_size):
        off["moe_intermediate_size"] = cfg.moe_intermediate_size
    if off:
        raise HFError(f"language: a softmax-routed mixture of experts without qk_norm exports as Mixtral, where "
                      f"model.language {off} have no counterpart (it needs "
                      f"{ {k: _NOT_IN_MIXTRAL.get(k, 'intermediate_size') for k in off} })")
