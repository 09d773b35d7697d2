"""The Qwen2-Audio family (`model_type = "qwen2_audio"`): one folder holding a Whisper-style audio tower (its output
rows pooled in pairs: models/qwen2_audio.py), a one-matmul projector (`multi_modal_projector.linear`) and a Qwen2 LLM.

Its config.json ↔ loom's module configs, and where each loom module's tensors sit in the folder (transformers 4's
and 5.24's save_pretrained names first, then 5's in-memory ones). The tower's tensors are named as Whisper's
encoder's (names.py's audio rules); the pooling has none.
"""

from __future__ import annotations

from loom.model_config import AudioConfig, LLMConfig
from loom.models.hf import llava
from loom.models.hf.errors import HFError
from loom.models.hf.mapping import WHISPER_LAYER_NORM_EPS, config_from_hf

FAMILY = "qwen2_audio"
ENCODER = "audio"  # the loom module its tower and projector are
PLACEHOLDER = "<|AUDIO|>"  # the audio placeholder of its tokenizer and processor
PREFIXES = {
    "language": ("language_model.model.", "model.language_model."),
    "audio": ("audio_tower.", "model.audio_tower."),
    "projector": ("multi_modal_projector.", "model.multi_modal_projector."),
}
ANCHORS = {"language": "embed_tokens.weight", "audio": "conv1.weight", "projector": "linear.weight"}
LM_HEAD_PREFIXES = {"language_model.model.": "language_model.", "model.language_model.": ""}
# Qwen2AudioConfig's audio_config defaults (Qwen2-Audio-7B's tower), for keys a config.json leaves out
AUDIO_DEFAULTS = dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                      d_model=1280, max_source_positions=1500, scale_embedding=False, activation_function="gelu")
NOT_READ = "Qwen2-Audio never reads it"  # nothing of the folder is left unread: kept for export_whole's interface


def is_whole_model(hf: dict) -> bool:
    return hf.get("model_type") == FAMILY


def audio_token(hf: dict) -> int:
    """The id of `<|AUDIO|>` (transformers 4 and 5 save `audio_token_index`)."""
    return int(hf.get("audio_token_index", hf.get("audio_token_id", 151646)))


def sub_config(hf: dict, kind: str) -> dict:
    """The config of one module: audio_config for the tower, the whole config for the projector, text_config (a
    Qwen2 LLM, LLaVA's defaults for keys it leaves out) for the LLM."""
    if kind == "audio":
        return {**AUDIO_DEFAULTS, **(hf.get("audio_config") or {}), "model_type": "qwen2_audio_encoder"}
    if kind == "projector":
        return hf
    return llava.sub_config({**hf, "text_config": {"model_type": "qwen2", **(hf.get("text_config") or {})}}, kind)


def configs(hf: dict, where: str, folder: str) -> tuple[LLMConfig, AudioConfig]:
    """The LLM's and the audio module's configs; a key loom cannot follow is an HFError naming it and its value."""
    lm = config_from_hf(sub_config(hf, "language"), f"{where}: text_config", folder)
    a = sub_config(hf, "audio")
    where = f"{where}: audio_config"
    if a["activation_function"] != "gelu":
        raise HFError(f"{where}: activation_function = {a['activation_function']!r} is not supported; loom's audio "
                      f"MLP uses exact gelu")
    if a["scale_embedding"]:
        raise HFError(f"{where}: scale_embedding = true is not supported: loom's tower adds its positions to the "
                      f"convolutions' output unscaled, as Qwen2-Audio's released folders do")
    return lm, AudioConfig(family=FAMILY, num_features=int(a["num_mel_bins"]), hidden_size=int(a["d_model"]),
                           num_layers=int(a["encoder_layers"]), num_heads=int(a["encoder_attention_heads"]),
                           intermediate_size=int(a["encoder_ffn_dim"]), layer_norm_eps=WHISPER_LAYER_NORM_EPS,
                           max_positions=int(a["max_source_positions"]), hf=folder)


def part_prefix(kind: str, names, where: str) -> tuple[str, str]:
    """(prefix of the module's tensors, prefix of the LM head's) in a Qwen2-Audio folder's tensor `names`."""
    for prefix in PREFIXES[kind]:
        if prefix + ANCHORS[kind] in names:
            return prefix, LM_HEAD_PREFIXES.get(prefix, "")
    tried = [p + ANCHORS[kind] for p in PREFIXES[kind]]
    raise HFError(f"{where}: no Qwen2-Audio {kind} tensors found: none of {tried} is in the checkpoint")


other_part = llava.other_part  # a tensor outside the module's prefix (but for the LM head) is another module's


def unread_tower_reason(name: str, prefix: str, layers: int) -> str | None:
    return None  # the whole tower is read
