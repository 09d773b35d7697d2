"""The Qwen2-VL family (`model_type = "qwen2_vl"`, and Qwen2.5-VL's `"qwen2_5_vl"`): one folder holding the vision
tower with its 2×2 patch merger and a Qwen2 LLM with M-RoPE. Qwen2.5-VL's tower has RMSNorm, a SwiGLU MLP and
windowed attention; its names, its LLM and its images' positions are Qwen2-VL's.

Its config.json ↔ loom's module configs, and where each loom module's tensors sit in the folder (transformers 4's
names, which 5's save_pretrained writes too, then 5's in-memory ones). The tower's `blocks.N` are loom's `layers.N`;
the merger's norm belongs to the tower (it normalises each patch before the 2×2 groups are joined) and its MLP
(`merger.mlp.0` / `.2`) is the vision module's projector. Each block's fused `attn.qkv` is loom's `attn.q_proj`,
`attn.k_proj` and `attn.v_proj` (FUSED_ROWS).
"""

from __future__ import annotations

from loom.models.hf.errors import HFError
from loom.models.hf.mapping import config_from_hf
from loom.models.llm import LLMConfig
from loom.models.vision import VisionConfig

FAMILY = "qwen2_vl"
MODEL_TYPES = (FAMILY, "qwen2_5_vl")
PLACEHOLDER = "<|image_pad|>"  # the image placeholder of its tokenizer and processor
PREFIXES = {
    "language": ("model.", "model.language_model."),
    "vision": ("visual.", "model.visual."),
    "projector": ("visual.", "model.visual."),
}
ANCHORS = {"language": "embed_tokens.weight", "vision": "patch_embed.proj.weight", "projector": "merger.mlp.0.weight"}
# loom's names (after names.py's vision rules) → the folder's, per sub-config model_type
TOWER_RENAMES = [(r"^encoder\.layers\.", "blocks."), (r"^ln_q\.", "merger.ln_q."),
                 (r"\.attn\.[qkv]_proj\.", ".attn.qkv.")]
# loom's q/k/v Linears are the row blocks of the folder's fused attn.qkv, in this order (split on load, joined on
# export: tensor parallel splits each by heads, which one contiguous shard of [q; k; v] would not be)
FUSED_ROWS = [(r"\.attn\.q_proj\.", 0, 3), (r"\.attn\.k_proj\.", 1, 3), (r"\.attn\.v_proj\.", 2, 3)]
FUSED = {"qwen2_vl_vision": FUSED_ROWS, "qwen2_5_vl_vision": FUSED_ROWS}
MERGER_RENAMES = [(r"^linear_1\.", "merger.mlp.0."), (r"^linear_2\.", "merger.mlp.2.")]  # the projector's
RENAMES = {"qwen2_vl_vision": TOWER_RENAMES, FAMILY: MERGER_RENAMES,
           "qwen2_5_vl_vision": TOWER_RENAMES, "qwen2_5_vl": MERGER_RENAMES}  # Qwen2.5-VL's names alike
ACTS = {"quick_gelu": "quick", "gelu": "none", "gelu_pytorch_tanh": "tanh"}
# Qwen2VLConfig's text defaults (Qwen2-VL-7B), for keys an older flat config.json leaves out
TEXT_DEFAULTS = dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                     num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0)
TOWER_KEYS = ("vision_config", "text_config", "image_token_id", "video_token_id", "vision_start_token_id",
              "vision_end_token_id", "model_type", "architectures")
NOT_READ = "Qwen2-VL never reads it"  # nothing of the folder is left unread: kept for export_whole's interface


def is_whole_model(hf: dict) -> bool:
    return hf.get("model_type") in MODEL_TYPES


def image_token(hf: dict) -> int:
    return int(hf.get("image_token_id", 151655))


def sub_config(hf: dict, kind: str) -> dict:
    """The config of one module: the tower's vision_config, the whole config for the projector (the merger MLP),
    text_config (transformers 5) or the flat keys (4) for the LLM, read as a Qwen2 LLM."""
    if kind == "vision":
        return dict(hf.get("vision_config") or {}, model_type=f"{hf['model_type']}_vision")
    if kind == "projector":
        return hf
    text = dict(hf.get("text_config") or {k: v for k, v in hf.items() if k not in TOWER_KEYS})
    for key, value in TEXT_DEFAULTS.items():
        text.setdefault(key, value)
    text["tie_word_embeddings"] = bool(text.get("tie_word_embeddings") or hf.get("tie_word_embeddings"))
    return dict(text, model_type="qwen2")


def configs(hf: dict, where: str, folder: str) -> tuple[LLMConfig, VisionConfig]:
    lm = config_from_hf(sub_config(hf, "language"), f"{where}: text_config", folder)
    if not (lm.rope_scaling or {}).get("mrope_section"):
        raise HFError(f"{where}: text_config has no rope mrope_section: a Qwen2-VL LLM turns its rotary frequencies "
                      f"with three position streams")
    tower = vision_config if hf["model_type"] == FAMILY else vision_config_2_5
    return lm, tower(sub_config(hf, "vision"), f"{where}: vision_config", lm.hidden_size, folder)


def vision_config(v: dict, where: str, llm_hidden: int, folder: str = "") -> VisionConfig:
    act = v.get("hidden_act", "quick_gelu")
    if act not in ACTS:
        raise HFError(f"{where}: hidden_act = {act!r} is not supported; loom's vision MLP has {sorted(ACTS)}")
    if v.get("hidden_size", llm_hidden) != llm_hidden:
        raise HFError(f"{where}: hidden_size = {v['hidden_size']} (the merger's output) differs from the LLM's "
                      f"hidden_size {llm_hidden}")
    d = int(v.get("embed_dim", 1280))
    rope = v.get("rope_parameters") or {}
    return VisionConfig(family="qwen2_vl", channels=int(v.get("in_channels", v.get("in_chans", 3))),
                             patch_size=int(v.get("patch_size", 14)),
                             temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                             merge_size=int(v.get("spatial_merge_size", 2)), hidden_size=d,
                             num_layers=int(v.get("depth", 32)), num_heads=int(v.get("num_heads", 16)),
                             intermediate_size=int(d * v.get("mlp_ratio", 4)), act=ACTS[act],
                             rope_theta=float(rope.get("rope_theta", 10000.0)), layer_norm_eps=1e-6,
                             projector_act="gelu", hf=folder)


def vision_config_2_5(v: dict, where: str, llm_hidden: int, folder: str = "") -> VisionConfig:
    """Qwen2.5-VL's tower: `hidden_size` its width, `out_hidden_size` the merger's output (Qwen2_5_VLVisionConfig's
    defaults for keys it leaves out)."""
    if v.get("hidden_act", "silu") != "silu":
        raise HFError(f"{where}: hidden_act = {v['hidden_act']!r} is not supported; loom's Qwen2.5-VL MLP is SwiGLU "
                      f"(silu)")
    if v.get("out_hidden_size", llm_hidden) != llm_hidden:
        raise HFError(f"{where}: out_hidden_size = {v['out_hidden_size']} (the merger's output) differs from the "
                      f"LLM's hidden_size {llm_hidden}")
    rope = v.get("rope_parameters") or {}
    return VisionConfig(family="qwen2_5_vl", channels=int(v.get("in_channels", v.get("in_chans", 3))),
                        patch_size=int(v.get("patch_size", 14)),
                        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                        merge_size=int(v.get("spatial_merge_size", 2)), hidden_size=int(v.get("hidden_size", 3584)),
                        num_layers=int(v.get("depth", 32)), num_heads=int(v.get("num_heads", 16)),
                        intermediate_size=int(v.get("intermediate_size", 3420)), act="none",
                        rope_theta=float(rope.get("rope_theta", 10000.0)), layer_norm_eps=1e-6,
                        window_size=int(v.get("window_size", 112)),
                        full_attention_layers=[int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))],
                        projector_act="gelu", hf=folder)


def part_prefix(kind: str, names, where: str) -> tuple[str, str]:
    """(prefix of the module's tensors, prefix of the LM head's) in a Qwen2-VL folder's tensor `names`."""
    for prefix in PREFIXES[kind]:
        if prefix + ANCHORS[kind] in names:
            return prefix, ""
    tried = [p + ANCHORS[kind] for p in PREFIXES[kind]]
    raise HFError(f"{where}: no Qwen2-VL {kind} tensors found: none of {tried} is in the checkpoint")


def part_of(name: str) -> str:
    """The loom module a Qwen2-VL folder's tensor belongs to."""
    if name.startswith(("visual.", "model.visual.")):
        return "projector" if ".merger.mlp." in name else "vision"
    return "language"


def other_part(kind: str, name: str, prefix: str, head_prefix: str) -> bool:
    return part_of(name) != kind


def unread_tower_reason(name: str, prefix: str, layers: int) -> str | None:
    return None  # the whole tower is read
