"""Rotary embedding's keys in a config.json ↔ loom's `rope_theta` and `rope_scaling`, in either format:
transformers 4's (`rope_theta` + `rope_scaling`) or 5's (`rope_parameters` holding both)."""

from __future__ import annotations

from loom.models.hf.errors import HFError
from loom.models.layers import rope_type
from loom.models.llm import LLMConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "mrope")  # mrope: transformers 4's name of Qwen2-VL's
YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def rope_from_hf(hf: dict, where: str, partial_default: float = 1.0) -> dict:
    """LLMConfig's rope_theta, rope_scaling and partial_rotary_factor from either format: transformers 4
    (`rope_theta` + `rope_scaling`) or 5 (`rope_parameters` holding both). As in transformers, `rope_scaling` wins
    when both are present. `partial_default`: the family's share of rotated dims when the config does not say."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", partial_default)))
    if not 0 < partial <= 1:
        raise HFError(f"{where}: partial_rotary_factor = {partial} is not supported: loom rotates a share in (0, 1] "
                      f"of each head")
    theta, scaling = _theta_and_scaling(hf, params, where)
    return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": partial}


def _theta_and_scaling(hf: dict, params: dict, where: str) -> tuple[float, dict | None]:
    if params and all(isinstance(v, dict) for v in params.values()):
        raise HFError(f"{where}: rope parameters per layer type are not supported: loom uses one rotary embedding "
                      f"for every layer")
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HFError(f"{where}: rope type {kind!r} is not supported: loom implements {list(ROPE_TYPES)}")
    if params.get("mrope_section"):  # Qwen2-VL's M-RoPE: default frequencies over three position streams
        if kind not in ("default", "mrope"):
            raise HFError(f"{where}: mrope_section with rope type {kind!r}: loom's M-RoPE has default frequencies")
        return theta, {"rope_type": "mrope", "mrope_section": [int(n) for n in params["mrope_section"]]}
    if kind in ("default", "mrope"):
        return theta, None
    if kind == "linear":
        if "factor" not in params:
            raise HFError(f"{where}: linear rope scaling lacks 'factor'")
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}
    original = (  # where transformers looks for it, in its order
        hf.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings")
    )
    if kind == "yarn":
        factor = params.get("factor") or (hf.get("max_position_embeddings") or 0) / (original or 1)
        if not original or not factor:
            raise HFError(f"{where}: yarn rope scaling lacks 'factor' and 'original_max_position_embeddings'")
        return theta, {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original),
                       **{k: params[k] for k in YARN_KEYS if params.get(k) is not None}}
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing or not original:
        raise HFError(f"{where}: llama3 rope scaling lacks {missing or ['original_max_position_embeddings']}")
    return theta, {
        "rope_type": "llama3",
        "factor": float(params["factor"]),
        "low_freq_factor": float(params["low_freq_factor"]),
        "high_freq_factor": float(params["high_freq_factor"]),
        "original_max_position_embeddings": int(original),
    }


def rope_to_hf(cfg: LLMConfig) -> dict:
    """The rope keys of a config.json, in both formats: transformers 4 reads rope_theta + rope_scaling, 5 reads
    rope_parameters; max_position_embeddings as the scaling implies (loom does not model it otherwise: it does
    not change the numerics of these rope types)."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise HFError(f"language: rope type {kind!r} cannot be exported; loom implements {list(ROPE_TYPES)}")
    max_pos = 32768
    if scaling and "original_max_position_embeddings" in scaling:
        max_pos = int(scaling["original_max_position_embeddings"] * scaling["factor"])
    partial = {"partial_rotary_factor": cfg.partial_rotary_factor} if cfg.partial_rotary_factor != 1 else {}
    if kind == "mrope":  # transformers 5 reads M-RoPE as default frequencies with an mrope_section
        return {"max_position_embeddings": max_pos, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                    "mrope_section": scaling["mrope_section"]}}
    return {"max_position_embeddings": max_pos, "rope_theta": cfg.rope_theta, "rope_scaling": scaling, **partial,
            "rope_parameters": {"rope_type": kind, "rope_theta": cfg.rope_theta, **(scaling or {}), **partial}}
