"""Tiny random-init LLaVA-OneVision folders written by transformers' save_pretrained (no download), shared by its
tests through conftest's `llava_onevision` fixture: examples/make_tiny_onevision.py's config, processor and folder,
at test sizes. Needs transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlavaOnevisionForConditionalGeneration

from qwen2vl_folders import far_from_init
from vlm_jobs import example

ov = example("make_tiny_onevision")
TILE = 16  # pixels: 4 × 4 patches of 4
# canvases of 1 … 3 tiles each way; anyres_max_4 pools a 3 × 3 grid's 12 × 12 map (more than 1.1 × 4 tiles' worth)
PINPOINTS = [[TILE * i, TILE * j] for i in (1, 2, 3) for j in (1, 2, 3)]
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=TILE,
             patch_size=4)
FOLDERS = {"ov": ov.onevision_config(TEXT, TOWER, image_token=7, pinpoints=PINPOINTS, max_tiles=4)}


def image_processor(name: str = "ov"):
    """The folder's image processor (PIL backend), sized for the tiny tower."""
    return ov.image_processor(TILE, FOLDERS[name].image_grid_pinpoints)


def write_llava_onevision(name: str, folder: Path):
    """(transformers' model with every weight far from its init, in eval mode; its folder, with the processor's
    preprocessor_config.json)."""
    torch.manual_seed(0)
    model = far_from_init(LlavaOnevisionForConditionalGeneration(FOLDERS[name]))
    return model.eval(), ov.save_folder(model, folder, FOLDERS[name])
