"""What a Hugging Face checkpoint's config.json means to loom: config.json ↔ loom config (its tensor names are
names.py's).

Three kinds of module, named as loom's modules are:
- ``language``: Llama 3.x (``llama``), Mistral and Mixtral (``mistral``, ``mixtral``, without a sliding window),
  Qwen2/Qwen2.5 (``qwen2``), Qwen3 (``qwen3``), Qwen3-MoE (``qwen3_moe``), GLM-4.5 (``glm4_moe``), DeepSeek-V2
  and -V3 (``deepseek_v2``, ``deepseek_v3``: latent attention, routed experts) causal LMs → DecoderLM;
- ``vision``: a SigLIP vision tower (``siglip_vision_model``, or the vision half of ``siglip``) → VisionEncoder;
- ``audio``: a Whisper encoder (``whisper``: WhisperForConditionalGeneration, WhisperModel or WhisperEncoder)
  → AudioEncoder.

Everything a loom module cannot express exactly is rejected with the config key that asks for it; nothing
is approximated. No transformers needed: the loader and the exporter share these tables.
"""

from __future__ import annotations

import math

from loom.models.audio import AudioConfig
from loom.models.hf.deepseek import FAMILIES as DEEPSEEK, deepseek_family, deepseek_keys, deepseek_to_hf
from loom.models.hf.errors import HFError
from loom.models.hf.fp8 import weight_blocks
from loom.models.hf.glm4_moe import PARTIAL_ROTARY_DEFAULT, check_glm4_moe, glm4_moe_keys, glm4_moe_to_hf
from loom.models.hf.mixtral import check_mixtral, mixtral_keys, mixtral_to_hf
from loom.models.hf.qwen3_moe import check_qwen3_moe, qwen3_moe_keys, qwen3_moe_to_hf
from loom.models.hf.rope import rope_from_hf, rope_to_hf
from loom.models.llm import LLMConfig
from loom.models.vision import VisionConfig

MODEL_TYPES = {
    "llama": "language",
    "mistral": "language",
    "mixtral": "language",
    "qwen2": "language",
    "qwen3": "language",
    "qwen3_moe": "language",
    "glm4_moe": "language",
    "deepseek_v2": "language",
    "deepseek_v3": "language",
    "siglip_vision_model": "vision",
    "siglip": "vision",
    "whisper": "audio",
}
# what `loom export` writes for each family (a Mistral exports as the Llama it is without a window)
CAUSAL_LMS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
              "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
ARCHITECTURES = {
    "llama": {"LlamaForCausalLM", "LlamaModel"},
    "mistral": {"MistralForCausalLM", "MistralModel"},
    "mixtral": {"MixtralForCausalLM", "MixtralModel"},
    "qwen2": {"Qwen2ForCausalLM", "Qwen2Model"},
    "qwen3": {"Qwen3ForCausalLM", "Qwen3Model"},
    "qwen3_moe": {"Qwen3MoeForCausalLM", "Qwen3MoeModel"},
    "glm4_moe": {"Glm4MoeForCausalLM", "Glm4MoeModel"},
    "deepseek_v2": {"DeepseekV2ForCausalLM", "DeepseekV2Model"},
    "deepseek_v3": {"DeepseekV3ForCausalLM", "DeepseekV3Model"},
    "siglip_vision_model": {"SiglipVisionModel"},
    "siglip": {"SiglipModel", "SiglipVisionModel"},
    "whisper": {"WhisperForConditionalGeneration", "WhisperModel", "WhisperEncoder"},
}
WHISPER_LAYER_NORM_EPS = 1e-5  # fixed in Whisper (nn.LayerNorm default), not in its config


# ---------------------------------------------------------------- config.json → loom config


def model_type(hf: dict, where: str) -> str:
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        raise HFError(
            f"{where}: model_type {mt!r} (architectures {hf.get('architectures')}) is not supported; "
            f"loom loads {sorted(MODEL_TYPES)}"
        )
    archs = [a for a in hf.get("architectures") or [] if a not in ARCHITECTURES[mt]]
    if archs:
        raise HFError(
            f"{where}: architectures {archs} are not supported for model_type {mt!r}; "
            f"loom loads {sorted(ARCHITECTURES[mt])}"
        )
    return mt


def kind_of(hf: dict, where: str) -> str:
    return MODEL_TYPES[model_type(hf, where)]


def config_from_hf(hf: dict, where: str, folder: str = "") -> LLMConfig | VisionConfig | AudioConfig:
    """The loom config of the module that config.json `hf` describes; `folder` is recorded in its `hf`."""
    mt = model_type(hf, where)
    weight_blocks(hf, where)  # a quantization loom cannot read is refused here, before any weight is
    if MODEL_TYPES[mt] == "language":
        return _llm_config(hf, mt, where, folder)
    if MODEL_TYPES[mt] == "vision":
        return _vision_config((hf.get("vision_config") or {}) if mt == "siglip" else hf, where, folder)
    return _audio_config(hf, where, folder)


def _reject(where: str, what: str, why: str) -> None:
    raise HFError(f"{where}: {what} is not supported: {why}")


def _required(hf: dict, keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if hf.get(k) is None]
    if missing:
        raise HFError(f"{where}: config.json lacks {missing}")


def _llm_config(hf: dict, mt: str, where: str, folder: str) -> LLMConfig:
    _required(hf, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
              where)
    if hf.get("hidden_act", "silu") != "silu":
        _reject(where, f"hidden_act = {hf['hidden_act']!r}", "loom's MLP is SwiGLU (silu)")
    if mt in ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe") and hf.get("attention_bias"):
        _reject(where, "attention_bias = true", f"{mt} then adds a bias to o_proj too, and loom's o_proj has none")
    if hf.get("mlp_bias"):
        _reject(where, "mlp_bias = true", "loom's MLP projections have no bias")
    sliding = _sliding_layers(hf)
    if sliding:
        _reject(where, f"sliding-window attention (layers {sliding})", "loom attends over the whole sample")
    heads = hf["num_attention_heads"]
    qwen3 = mt in ("qwen3", "qwen3_moe")
    default_head_dim = 128 if qwen3 else hf["hidden_size"] // heads  # Qwen3Config's default is 128
    keys = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or default_head_dim,
        intermediate_size=hf["intermediate_size"],
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        **rope_from_hf(hf, where, PARTIAL_ROTARY_DEFAULT if mt == "glm4_moe" else 1.0),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=mt == "qwen2",  # Qwen2 always has q/k/v bias (and never o_proj bias)
        qk_norm=qwen3,
        hf=folder,
    )
    if mt == "qwen3_moe":
        keys.update(qwen3_moe_keys(hf))
    if mt == "glm4_moe":
        keys.update(glm4_moe_keys(hf))
    if mt == "mixtral":
        keys.update(mixtral_keys(hf, where))
    if mt in DEEPSEEK:
        keys.update(deepseek_keys(hf, mt, where))
    return LLMConfig(**keys)


def _sliding_layers(hf: dict) -> list[int]:
    """Layers that attend in a sliding window, by the rules of Qwen2/Qwen3 and Mistral configs."""
    types = hf.get("layer_types")
    if types:
        return [i for i, t in enumerate(types) if t != "full_attention"]
    if hf.get("model_type") in ("mistral", "mixtral") and hf.get("sliding_window"):  # on whenever it is set
        return list(range(hf["num_hidden_layers"]))
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        first = hf.get("max_window_layers", 0)
        return list(range(first, hf["num_hidden_layers"]))
    return []


SIGLIP_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def _square(value, key: str, where: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            _reject(where, f"{key} = {value}", "loom's vision encoder uses square patches and position grids")
        value = value[0]
    return int(value)


def _vision_config(v: dict, where: str, folder: str) -> VisionConfig:
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in SIGLIP_ACTS:
        _reject(where, f"hidden_act = {act!r}", f"loom's vision MLP supports {sorted(SIGLIP_ACTS)}")
    image = _square(v.get("image_size", 224), "image_size", where)
    patch = _square(v.get("patch_size", 16), "patch_size", where)
    return VisionConfig(
        channels=v.get("num_channels", 3),
        patch_size=patch,
        hidden_size=v.get("hidden_size", 768),
        num_layers=v.get("num_hidden_layers", 12),
        num_heads=v.get("num_attention_heads", 12),
        intermediate_size=v.get("intermediate_size", 3072),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        position_grid=image // patch,  # as SigLIP: so400m's 384 / 14 gives a 27 × 27 grid (the conv drops the rest)
        act=SIGLIP_ACTS[act],
        hf=folder,
    )


def _audio_config(hf: dict, where: str, folder: str) -> AudioConfig:
    if hf.get("activation_function", "gelu") != "gelu":
        _reject(where, f"activation_function = {hf['activation_function']!r}", "loom's audio MLP uses exact gelu")
    return AudioConfig(
        num_features=hf.get("num_mel_bins", 80),
        hidden_size=hf.get("d_model", 384),
        num_layers=hf.get("encoder_layers", 4),
        num_heads=hf.get("encoder_attention_heads", 6),
        intermediate_size=hf.get("encoder_ffn_dim", 1536),
        layer_norm_eps=WHISPER_LAYER_NORM_EPS,
        max_positions=hf.get("max_source_positions", 1500),
        hf=folder,
    )


# ---------------------------------------------------------------- loom config → config.json


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_to_hf(kind: str, cfg, dtype) -> dict:
    """A config.json that transformers reads back as the same architecture. Written by hand: no transformers."""
    if kind == "language":
        return _llm_to_hf(cfg, dtype)
    if kind == "vision":
        return _vision_to_hf(cfg, dtype)
    return _audio_to_hf(cfg, dtype)


def llm_family(cfg: LLMConfig) -> str:
    if cfg.latent:
        return deepseek_family(cfg)
    if cfg.num_experts and cfg.router_score == "sigmoid":
        check_glm4_moe(cfg)
        return "glm4_moe"
    if cfg.partial_rotary_factor != 1:
        raise HFError(f"language: partial_rotary_factor = {cfg.partial_rotary_factor} exports only as GLM-4.5 "
                      f"(glm4_moe), a mixture of experts with sigmoid routing (router_score = 'sigmoid')")
    if cfg.attention_bias and cfg.qk_norm:
        raise HFError(
            "language: attention_bias and qk_norm together have no Hugging Face counterpart "
            "(Qwen3's attention_bias also adds an o_proj bias)"
        )
    if cfg.num_experts and not cfg.qk_norm:
        check_mixtral(cfg)
        return "mixtral"
    if cfg.num_experts:
        check_qwen3_moe(cfg)
        return "qwen3_moe"
    return "qwen2" if cfg.attention_bias else "qwen3" if cfg.qk_norm else "llama"


def _llm_to_hf(cfg: LLMConfig, dtype) -> dict:
    mt = llm_family(cfg)
    out = {
        "architectures": [CAUSAL_LMS[mt]],
        "model_type": mt,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.dim_per_head,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        **rope_to_hf(cfg),
        "dtype": _dtype_name(dtype),
        "torch_dtype": _dtype_name(dtype),
    }
    if mt in ("llama", "mixtral", "qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if mt == "qwen3_moe":
        out.update(qwen3_moe_to_hf(cfg))
    if mt in DEEPSEEK:
        out.update(deepseek_to_hf(cfg, mt))
    if mt == "glm4_moe":
        out.update(glm4_moe_to_hf(cfg))
    if mt == "mixtral":
        out.update(mixtral_to_hf(cfg))
    if mt in ("llama", "mixtral", "glm4_moe", *DEEPSEEK):
        out["mlp_bias"] = False
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    return out


def _vision_to_hf(cfg: VisionConfig, dtype) -> dict:
    acts = {v: k for k, v in SIGLIP_ACTS.items()}
    if cfg.act not in acts:
        raise HFError(f"vision: act = {cfg.act!r} has no SigLIP counterpart; use one of {sorted(acts)}")
    return {
        "architectures": ["SiglipVisionModel"],
        "model_type": "siglip_vision_model",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_channels": cfg.channels,
        "image_size": cfg.position_grid * cfg.patch_size,
        "patch_size": cfg.patch_size,
        "hidden_act": acts[cfg.act],
        "layer_norm_eps": cfg.layer_norm_eps,
        "vision_use_head": False,  # loom has no pooling head; without this transformers would add a random one
        "dtype": _dtype_name(dtype),
        "torch_dtype": _dtype_name(dtype),
    }


def _audio_to_hf(cfg: AudioConfig, dtype) -> dict:
    if not math.isclose(cfg.layer_norm_eps, WHISPER_LAYER_NORM_EPS):
        raise HFError(f"audio: layer_norm_eps = {cfg.layer_norm_eps} cannot be exported; Whisper's is fixed at 1e-5")
    # a full WhisperConfig (WhisperEncoder reads it); the decoder sizes mirror the encoder's and are unused
    return {
        "architectures": ["WhisperEncoder"],
        "model_type": "whisper",
        "num_mel_bins": cfg.num_features,
        "d_model": cfg.hidden_size,
        "encoder_layers": cfg.num_layers,
        "encoder_attention_heads": cfg.num_heads,
        "encoder_ffn_dim": cfg.intermediate_size,
        "decoder_layers": cfg.num_layers,
        "decoder_attention_heads": cfg.num_heads,
        "decoder_ffn_dim": cfg.intermediate_size,
        "max_source_positions": cfg.max_positions,
        "activation_function": "gelu",
        "dtype": _dtype_name(dtype),
        "torch_dtype": _dtype_name(dtype),
    }
