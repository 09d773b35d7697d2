"""The LLaVA family (`model_type = "llava"`): one folder holding a CLIP or SigLIP vision tower, the two-layer MLP
projector (`multi_modal_projector.linear_1/linear_2`) and a Llama / Qwen2 LLM.

Its config.json ↔ loom's module configs, and where each loom module's tensors sit in the folder. The tower runs
only up to the layer its LLM reads (`vision_feature_layer`), without the final norm; the layers after it, the
final norm and SigLIP's pooling head are left in the folder (and copied back by `loom export`).
"""

from __future__ import annotations

import dataclasses
import re

from loom.models.hf.errors import HFError
from loom.models.hf.mapping import config_from_hf
from loom.models.llm import LLMConfig
from loom.models.projector import PROJECTOR_ACTS
from loom.models.vision import VisionConfig

FAMILY = "llava"
TOWERS = ("clip_vision_model", "siglip_vision_model")
TEXTS = ("llama", "qwen2")
# what transformers' LlamaConfig / Qwen2Config assume for keys an older LLaVA config.json leaves out
TEXT_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, rms_norm_eps=1e-6),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-6),
}
CLIP_ACTS = {"quick_gelu": "quick", "gelu": "none", "gelu_pytorch_tanh": "tanh"}
# where each loom module's tensors sit: transformers 4 / 5.24's save_pretrained names first, then 5's in-memory ones
PREFIXES = {
    "language": ("language_model.model.", "model.language_model."),
    "vision": ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
               "model.vision_tower."),
    "projector": ("multi_modal_projector.", "model.multi_modal_projector."),
}
ANCHORS = {"language": "embed_tokens.weight", "vision": "embeddings.patch_embedding.weight",
           "projector": "linear_1.weight"}
LM_HEAD_PREFIXES = {"language_model.model.": "language_model.", "model.language_model.": ""}
PLACEHOLDER = "<image>"  # the image placeholder token of LLaVA's tokenizers and processors
NOT_READ = "LLaVA never reads it: the tower's output is the hidden state of vision_feature_layer"


def is_whole_model(hf: dict) -> bool:
    return hf.get("model_type") == FAMILY


def image_token(hf: dict) -> int:
    """The id of the image placeholder token (transformers 4 and 5.24 save `image_token_index`)."""
    return int(hf.get("image_token_index", hf.get("image_token_id", 32000)))


def sub_config(hf: dict, kind: str) -> dict:
    """The config of one module of a LLaVA config.json: text_config for the LLM, vision_config for the tower,
    the whole config for the projector; an older config's missing text keys filled with transformers' defaults."""
    if kind == "vision":
        return dict(hf.get("vision_config") or {"model_type": "clip_vision_model"})
    if kind == "projector":
        return hf
    text = dict(hf.get("text_config") or {})
    text.setdefault("model_type", "llama")
    for key, value in TEXT_DEFAULTS.get(text["model_type"], {}).items():
        text.setdefault(key, value)
    text["tie_word_embeddings"] = bool(text.get("tie_word_embeddings") or hf.get("tie_word_embeddings"))
    return text


def llava_configs(hf: dict, where: str, folder: str) -> tuple[LLMConfig, VisionConfig]:
    """The LLM's and the vision module's configs of a LLaVA config.json (the projector's act rides with vision)."""
    text, tower = sub_config(hf, "language"), sub_config(hf, "vision")
    if text["model_type"] not in TEXTS:
        raise HFError(f"{where}: text_config.model_type {text['model_type']!r} is not supported in LLaVA; loom "
                      f"loads {list(TEXTS)}")
    if tower.get("model_type") not in TOWERS:
        raise HFError(f"{where}: vision_config.model_type {tower.get('model_type')!r} is not supported; loom loads "
                      f"{list(TOWERS)}")
    if not hf.get("multimodal_projector_bias", True):
        raise HFError(f"{where}: multimodal_projector_bias = false is not supported: loom's projector has biases")
    act = hf.get("projector_hidden_act", "gelu")
    if act not in PROJECTOR_ACTS:
        raise HFError(f"{where}: projector_hidden_act = {act!r} is not supported; loom has {sorted(PROJECTOR_ACTS)}")
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise HFError(f"{where}: vision_feature_select_strategy = {strategy!r}: LLaVA has 'default' (each image's "
                      f"first row dropped) and 'full'")
    lm = config_from_hf(text, f"{where}: text_config", folder)
    if tower["model_type"] == "clip_vision_model":
        vision = clip_vision_config(tower, f"{where}: vision_config", folder)
    else:
        vision = config_from_hf(tower, f"{where}: vision_config", folder)
    vision = dataclasses.replace(vision, num_layers=feature_layers(hf, vision.num_layers, where), final_norm=False,
                                 drop_first_row=strategy == "default", projector_act=act)
    return lm, vision


def feature_layers(hf: dict, total: int, where: str) -> int:
    """How many of the tower's `total` layers run: hidden state `vision_feature_layer` (0: the embeddings, as
    transformers counts them; negative: from the end) is the output of that many."""
    f = hf.get("vision_feature_layer", -2)
    if not isinstance(f, int):
        raise HFError(f"{where}: vision_feature_layer = {f!r} is not supported: loom reads one layer's output, "
                      f"not several concatenated")
    layers = f if f >= 0 else total + 1 + f
    if not 0 <= layers <= total:
        raise HFError(f"{where}: vision_feature_layer = {f} is outside the tower's hidden states: 0 … {total}, or "
                      f"-{total + 1} … -1")
    return layers


def clip_vision_config(v: dict, where: str, folder: str) -> VisionConfig:
    """A CLIP vision tower (CLIPVisionConfig's defaults for keys it leaves out)."""
    act = v.get("hidden_act", "quick_gelu")
    if act not in CLIP_ACTS:
        raise HFError(f"{where}: hidden_act = {act!r} is not supported; loom's vision MLP has {sorted(CLIP_ACTS)}")
    image, patch = v.get("image_size", 224), v.get("patch_size", 32)
    if not isinstance(image, int) or not isinstance(patch, int) or image % patch:
        raise HFError(f"{where}: image_size = {image}, patch_size = {patch}: loom's CLIP tower needs square "
                      f"images of whole patches")
    return VisionConfig(
        channels=v.get("num_channels", 3), patch_size=patch, hidden_size=v.get("hidden_size", 768),
        num_layers=v.get("num_hidden_layers", 12), num_heads=v.get("num_attention_heads", 12),
        intermediate_size=v.get("intermediate_size", 3072), layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)),
        position_grid=image // patch, act=CLIP_ACTS[act], class_token=True, patch_bias=False, pre_norm=True,
        hf=folder)


def part_prefix(kind: str, names, where: str) -> tuple[str, str]:
    """(prefix of the module's tensors, prefix of the LM head's) in a LLaVA folder's tensor `names`."""
    for prefix in PREFIXES[kind]:
        if prefix + ANCHORS[kind] in names:
            return prefix, LM_HEAD_PREFIXES.get(prefix, "")
    tried = [p + ANCHORS[kind] for p in PREFIXES[kind]]
    raise HFError(f"{where}: no LLaVA {kind} tensors found: none of {tried} is in the checkpoint")


def other_part(kind: str, name: str, prefix: str, head_prefix: str) -> bool:
    """Whether tensor `name` of a LLaVA folder belongs to another loom module than `kind`'s."""
    return not name.startswith(prefix) and not (kind == "language" and name.startswith(head_prefix + "lm_head."))


def unread_tower_reason(name: str, prefix: str, layers: int) -> str | None:
    """Why a vision tower tensor is not loaded: a layer after the one LLaVA reads, the final norm, SigLIP's head."""
    layer = re.match(rf"^{re.escape(prefix)}encoder\.layers\.(\d+)\.", name)
    if (layer and int(layer.group(1)) >= layers) or name.startswith((prefix + "post_layernorm.", prefix + "head.")):
        return NOT_READ
    return None


configs = llava_configs  # the whole-model families' interface (whole.py)
