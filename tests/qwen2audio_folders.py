"""A tiny random-init Qwen2-Audio model (transformers' own, no download) and its processor's files, shared by the
Qwen2-Audio tests: examples/make_tiny_qwen2audio.py's config and folder, at test sizes. Needs transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2AudioForConditionalGeneration

from qwen2vl_folders import far_from_init
from vlm_jobs import example

qa = example("make_tiny_qwen2audio")
AUDIO_ID = 300
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
TOWER = dict(qa.TOWER, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32)


def qwen2audio_model() -> Qwen2AudioForConditionalGeneration:
    torch.manual_seed(0)
    return far_from_init(Qwen2AudioForConditionalGeneration(qa.qwen2audio_config(TEXT, TOWER, AUDIO_ID))).eval()


def write_qwen2audio(folder: Path):
    """(transformers' model far from its init, in eval mode; its save_pretrained folder with the processor's
    preprocessor_config.json: WhisperFeatureExtractor's defaults at 128 mel bins)."""
    model = qwen2audio_model()
    return model, qa.save_folder(model, folder)
