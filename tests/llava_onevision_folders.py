"""Tiny random-init LLaVA-OneVision folders written by transformers' save_pretrained (no download), shared by its
tests through conftest's `llava_onevision` fixture. Needs transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessorPil,
    Qwen2Config,
    SiglipVisionConfig,
)

TILE = 16  # pixels: 4 × 4 patches of 4
# canvases of 1 … 3 tiles each way; anyres_max_4 pools a 3 × 3 grid's 12 × 12 map (more than 1.1 × 4 tiles' worth)
PINPOINTS = [[TILE * i, TILE * j] for i in (1, 2, 3) for j in (1, 2, 3)]
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=TILE,
             patch_size=4)
FOLDERS = {
    # OneVision's shape: SigLIP (its head unread) read at its last layer, every row kept, Qwen2
    "ov": LlavaOnevisionConfig(vision_config=SiglipVisionConfig(**TOWER), text_config=Qwen2Config(**TEXT),
                               image_token_index=7, image_grid_pinpoints=PINPOINTS, vision_aspect_ratio="anyres_max_4"),
}


def image_processor(name: str = "ov") -> LlavaOnevisionImageProcessorPil:
    """The folder's image processor (PIL backend), sized for the tiny tower."""
    return LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE},
                                           image_grid_pinpoints=FOLDERS[name].image_grid_pinpoints)


def write_llava_onevision(name: str, folder: Path):
    """(transformers' model with every weight far from its init, in eval mode; its folder, with the processor's
    preprocessor_config.json)."""
    from conftest import saved_far_from_init

    torch.manual_seed(0)
    model, folder = saved_far_from_init(LlavaOnevisionForConditionalGeneration(FOLDERS[name]), folder)
    image_processor(name).save_pretrained(folder)
    return model.eval(), folder
