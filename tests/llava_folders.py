"""Tiny random-init LLaVA folders written by transformers' save_pretrained (no download), shared by the LLaVA
tests through conftest's `llava` fixture. Needs transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2Config,
    SiglipImageProcessorPil,
    SiglipVisionConfig,
)

IMAGE = 16  # pixels: 4 × 4 patches of 4
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=IMAGE,
             patch_size=4)
FOLDERS = {
    # LLaVA 1.5's shape: CLIP read at its second-to-last layer, [CLS] dropped ("default"), Llama, exact gelu
    "clip-llama": LlavaConfig(vision_config=CLIPVisionConfig(**TOWER, projection_dim=16),
                              text_config=LlamaConfig(**TEXT, tie_word_embeddings=False), image_token_index=299),
    # SigLIP (with its pooling head, unread) at layer 2 counted from the embeddings, every row kept, tied Qwen2
    "siglip-qwen2": LlavaConfig(vision_config=SiglipVisionConfig(**TOWER),
                                text_config=Qwen2Config(**TEXT, tie_word_embeddings=True), image_token_index=7,
                                vision_feature_layer=2, vision_feature_select_strategy="full",
                                projector_hidden_act="gelu_pytorch_tanh"),
}


def image_processor(name: str):
    """The folder's image processor (PIL backend), sized for the tiny tower."""
    if name == "clip-llama":
        return CLIPImageProcessorPil(size={"shortest_edge": IMAGE}, crop_size=IMAGE)
    return SiglipImageProcessorPil(size={"height": IMAGE, "width": IMAGE})


def write_llava(name: str, folder: Path):
    """(transformers' model with every weight far from its init, in eval mode; its folder, with the processor's
    preprocessor_config.json)."""
    from conftest import saved_far_from_init

    torch.manual_seed(0)
    model, folder = saved_far_from_init(LlavaForConditionalGeneration(FOLDERS[name]), folder)
    image_processor(name).save_pretrained(folder)
    return model.eval(), folder
