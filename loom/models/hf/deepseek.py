"""DeepSeek-V2's and -V3's config.json ↔ loom's LLMConfig keys for multi-head latent attention and their routing
(the rest of the config is read by mapping.py like any Llama-style config). Moonlight and other `deepseek_v3`
folders, and DeepSeek-V2-Lite, read the same way. Their routed experts are stored per expert, as Qwen3-MoE's
(models/hf/stacked.py).

transformers is the reference for what a key means:
- `deepseek_v3` routes by sigmoid scores with the selection bias (`e_score_correction_bias`), group-limited (a
  group scores its best two), renormalised as `norm_topk_prob` says;
- `deepseek_v2` routes by softmax, top-k over all experts (`topk_method = "greedy"`) or within the `topk_group`
  best of `n_group` groups (`"group_limited_greedy"`, a group scores its best), never renormalised (transformers'
  DeepseekV2 reads no `norm_topk_prob`), and rotates interleaved pairs (complex multiplication).
Other routing keys are refused rather than read as something else.
"""

from __future__ import annotations

from loom.models.hf.errors import HFError
from loom.models.llm import LLMConfig

FAMILIES = ("deepseek_v2", "deepseek_v3")
_V3_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
_V2_TOPK = ("greedy", "group_limited_greedy")


def deepseek_keys(hf: dict, family: str, where: str) -> dict:
    """The attention and expert keys of a DeepSeek config, absent ones at transformers' defaults."""
    v3 = family == "deepseek_v3"
    experts = hf.get("n_routed_experts", 256 if v3 else 64) or 0
    keys = dict(
        num_kv_heads=hf["num_attention_heads"],  # every head expands its own key and value from the latent
        head_dim=0,
        q_lora_rank=hf.get("q_lora_rank", 1536) or 0,  # null: one query projection
        kv_lora_rank=hf.get("kv_lora_rank", 512),
        qk_nope_head_dim=hf.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=hf.get("qk_rope_head_dim", 64),
        v_head_dim=hf.get("v_head_dim", 128),
        rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
        attention_bias=bool(hf.get("attention_bias", False)),
        num_experts=experts,
        moe_intermediate_size=hf.get("moe_intermediate_size", 2048 if v3 else 1407),
        first_k_dense_replace=hf.get("first_k_dense_replace", 3 if v3 else 0) if experts else 0,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        n_shared_experts=hf.get("n_shared_experts", 1 if v3 else 2) or 0,
    )
    if not experts:
        return keys
    if hf.get("num_experts_per_tok", 8 if v3 else None) is None:
        raise HFError(f"{where}: config.json lacks ['num_experts_per_tok']")
    keys["num_experts_per_tok"] = hf.get("num_experts_per_tok", 8)
    if v3:
        off = {k: hf[k] for k, v in _V3_ROUTING.items() if hf.get(k, v) != v}
        if off:
            raise HFError(f"{where}: {off} is not supported: transformers' DeepseekV3 (and loom) route by "
                          f"{_V3_ROUTING}")
        return {**keys, "router_score": "sigmoid", "router_bias": True,
                "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "n_group": hf.get("n_group", 8),
                "topk_group": hf.get("topk_group", 4)}
    method = hf.get("topk_method", "greedy")
    if method not in _V2_TOPK:
        raise HFError(f"{where}: topk_method = {method!r} is not supported: transformers' DeepseekV2 (and loom) "
                      f"route by {list(_V2_TOPK)}")
    grouped = method == "group_limited_greedy"
    return {**keys, "router_score": "softmax", "norm_topk_prob": False, "router_group_score": "max",
            "n_group": (hf.get("n_group") or 1) if grouped else 1,
            "topk_group": (hf.get("topk_group") or 1) if grouped else 1}


def routing_mismatches(cfg: LLMConfig, v2: bool = False) -> tuple[dict, dict]:
    """(loom keys a DeepSeek-style config cannot say, what it needs instead) for a loom LLM with routed experts:
    sparse from first_k_dense_replace on with a shared expert, routed as V3 (sigmoid scores with a selection
    bias, groups by their best two; GLM-4.5 too) or, `v2`, as V2 (softmax, not renormalised, groups by their best)."""
    want = {"decoder_sparse_step": 1, "mlp_only_layers": []}
    if v2:
        want.update(norm_topk_prob=False, router_bias=False, router_bias_update_rate=0.0, rope_interleave=True)
        if cfg.n_group > 1:
            want["router_group_score"] = "max"
    else:
        want["router_group_score"] = "top2_sum"
    off = {k: getattr(cfg, k) for k, v in want.items() if getattr(cfg, k) != v}
    if not v2 and not (cfg.router_bias or cfg.router_bias_update_rate > 0):
        off["router_bias"], want["router_bias"] = False, "a bias"
    if not cfg.n_shared_experts:
        off["n_shared_experts"], want["n_shared_experts"] = 0, "≥ 1"
    return off, {k: want[k] for k in off}


def routed_to_hf(cfg: LLMConfig) -> dict:
    """The routed-expert keys DeepSeek's and GLM-4.5's config.json share."""
    return dict(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size,
                norm_topk_prob=cfg.norm_topk_prob, first_k_dense_replace=cfg.first_k_dense_replace,
                n_group=cfg.n_group, topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                n_shared_experts=cfg.n_shared_experts)


def deepseek_family(cfg: LLMConfig) -> str:
    """Which DeepSeek config describes a loom LLM with latent attention (V2: softmax routing), checked: what the
    family's config cannot say about it is refused."""
    if not cfg.num_experts:
        return "deepseek_v3"
    v2 = cfg.router_score == "softmax"
    off, needs = routing_mismatches(cfg, v2)
    if off:
        family = "DeepSeek-V2 (softmax routing)" if v2 else "DeepSeek-V3 (sigmoid routing)"
        raise HFError(f"language: model.language {off} have no {family} counterpart (it needs {needs})")
    return "deepseek_v2" if v2 else "deepseek_v3"


def deepseek_to_hf(cfg: LLMConfig, family: str) -> dict:
    """The config.json keys of the same; a dense loom LLM with latent attention has every layer dense."""
    routed = routed_to_hf(cfg)
    if not cfg.num_experts:  # transformers builds a router for layers ≥ first_k_dense_replace: none here
        routed.update(n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
                      first_k_dense_replace=cfg.num_layers, n_shared_experts=1)
    if family == "deepseek_v3":
        routed.update(scoring_func="sigmoid", topk_method="noaux_tc", rope_interleave=cfg.rope_interleave)
    else:
        routed.update(topk_method="group_limited_greedy" if cfg.n_group > 1 else "greedy")
    return dict(q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim, attention_bias=cfg.attention_bias, **routed)
