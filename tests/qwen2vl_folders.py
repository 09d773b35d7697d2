"""A tiny random-init Qwen2-VL model (transformers' own, no download), shared by the Qwen2-VL tests. Needs
transformers."""

from __future__ import annotations

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

IMAGE_ID, VIDEO_ID, START_ID, END_ID = 300, 301, 302, 303
MERGE = 2
# head_dim 16: 8 rotary frequencies, split 2 / 3 / 3 over time, height and width
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
TOWER = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64, patch_size=14, spatial_merge_size=MERGE,
             temporal_patch_size=2, hidden_act="quick_gelu")
CONFIG = dict(text_config=TEXT, vision_config=TOWER, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
              vision_start_token_id=START_ID, vision_end_token_id=END_ID, tie_word_embeddings=False)


def far_from_init(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight redrawn far from its init (as conftest's saved_far_from_init), so each one moves the logits."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.15 if p.ndim >= 2 else 1 + noise * 0.1)
    return model


def qwen2vl_model() -> Qwen2VLForConditionalGeneration:
    torch.manual_seed(0)
    return far_from_init(Qwen2VLForConditionalGeneration(Qwen2VLConfig(**CONFIG))).eval()


def write_qwen2vl(folder):
    """(transformers' model far from its init, in eval mode; its save_pretrained folder with the processor's
    preprocessor_config.json, sized small: 1 to 4 merged tokens an image)."""
    from transformers import Qwen2VLImageProcessorPil

    model = qwen2vl_model()
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 4).save_pretrained(folder)
    return model, folder


# Qwen2.5-VL: its tower with RMSNorm, SwiGLU, 112-pixel windows and one full-attention layer; Qwen2-VL's LLM
TOWER_2_5 = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                 spatial_merge_size=MERGE, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1])


def write_qwen2_5_vl(folder):
    """(transformers' Qwen2.5-VL model far from its init, in eval mode; its save_pretrained folder with a processor
    that sizes every image to 20–30 merged tokens: more than one 112-pixel window)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(**dict(CONFIG, vision_config=TOWER_2_5))
    model = far_from_init(Qwen2_5_VLForConditionalGeneration(config)).eval()
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 20, max_pixels=28 * 28 * 30).save_pretrained(folder)
    return model, folder
