"""The LLaVA-OneVision family (`model_type = "llava_onevision"`): LLaVA's parts and names (llava.py) — a SigLIP
tower read at `vision_feature_layer` (by default its last layer, before the final norm), the MLP projector, a Qwen2
LLM — with anyres images: `image_grid_pinpoints` (the canvases an image is tiled to), `vision_aspect_ratio`
"anyres_max_N" (when the tile grid's map is pooled) and the `image_newline` row, which loom's `vision.tiles` holds.
"""

from __future__ import annotations

import dataclasses
import re

from loom.data.anyres import check_pinpoints
from loom.models.hf import llava
from loom.models.hf.errors import HFError
from loom.models.llm import LLMConfig
from loom.models.vision import VisionConfig

FAMILY = "llava_onevision"
PLACEHOLDER = llava.PLACEHOLDER
PREFIXES = {**llava.PREFIXES, "tiles": ("", "model.")}
ANCHORS = {**llava.ANCHORS, "tiles": "image_newline"}
NOT_READ = llava.NOT_READ
# LlavaOnevisionConfig's tower for keys its vision_config leaves out (SigLIP so400m at 384 pixels)
TOWER_DEFAULTS = dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, patch_size=14,
                      image_size=384, num_hidden_layers=26, num_attention_heads=16)
# its canvases when config.json names none: 1 … 6 tiles of 384 pixels each way
PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]
ASPECT = re.compile(r"anyres_max_(\d+)")


def is_whole_model(hf: dict) -> bool:
    return hf.get("model_type") == FAMILY


def image_token(hf: dict) -> int:
    return int(hf.get("image_token_index", hf.get("image_token_id", 151646)))


def sub_config(hf: dict, kind: str) -> dict:
    if kind == "vision":
        return {**TOWER_DEFAULTS, **(hf.get("vision_config") or {})}
    if kind in ("projector", "tiles"):
        return hf
    return llava.sub_config({**hf, "text_config": {"model_type": "qwen2", **(hf.get("text_config") or {})}}, kind)


def configs(hf: dict, where: str, folder: str) -> tuple[LLMConfig, VisionConfig]:
    """LLaVA's configs of its parts, the tower's with the anyres keys; a key loom cannot follow is an HFError naming
    it and its value."""
    strategy = hf.get("vision_feature_select_strategy", "full")
    if strategy != "full":
        raise HFError(f"{where}: vision_feature_select_strategy = {strategy!r}: a LLaVA-OneVision tile's rows are "
                      f"laid out as its side × side map, so loom reads 'full' only")
    read = {**hf, "vision_config": sub_config(hf, "vision"), "vision_feature_select_strategy": "full",
            "text_config": {"model_type": "qwen2", **(hf.get("text_config") or {})},
            "vision_feature_layer": hf.get("vision_feature_layer", -1)}
    lm, vision = llava.llava_configs(read, where, folder)
    tile = vision.position_grid * vision.patch_size
    pinpoints = hf.get("image_grid_pinpoints") or PINPOINTS
    bad = check_pinpoints(pinpoints, tile)
    if bad:
        raise HFError(f"{where}: image_grid_pinpoints: {bad}")
    aspect = hf.get("vision_aspect_ratio", "anyres_max_9")
    found = ASPECT.fullmatch(str(aspect))
    if found is None or int(found.group(1)) < 1:
        raise HFError(f"{where}: vision_aspect_ratio = {aspect!r}: loom reads 'anyres_max_N' (N ≥ 1: the tile grid's "
                      f"map pooled when it holds more than N tiles' worth)")
    return lm, dataclasses.replace(vision, grid_pinpoints=[list(p) for p in pinpoints],
                                   max_tiles=int(found.group(1)))


def part_prefix(kind: str, names, where: str) -> tuple[str, str]:
    """(prefix of the module's tensors, prefix of the LM head's) among a LLaVA-OneVision folder's tensor `names`."""
    if kind != "tiles":
        return llava.part_prefix(kind, names, where)
    for prefix in PREFIXES[kind]:
        if prefix + ANCHORS[kind] in names:
            return prefix, ""
    raise HFError(f"{where}: no image_newline: none of {[p + ANCHORS[kind] for p in PREFIXES[kind]]} is in the "
                  f"checkpoint")


def other_part(kind: str, name: str, prefix: str, head_prefix: str) -> bool:
    if kind == "tiles":
        return name != prefix + ANCHORS["tiles"]
    return llava.other_part(kind, name, prefix, head_prefix)


unread_tower_reason = llava.unread_tower_reason
