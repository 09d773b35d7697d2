"""A tiny random-init Qwen2-Audio model (transformers' own, no download) and its processor's files, shared by the
Qwen2-Audio tests. Needs transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

from qwen2vl_folders import far_from_init

AUDIO_ID = 300
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
# Whisper's 128 mel bins and 1500 positions (30 s), as Qwen2-Audio's processor pads every clip to
TOWER = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
             max_source_positions=1500)
CONFIG = dict(text_config=TEXT, audio_config=TOWER, audio_token_index=AUDIO_ID)


def qwen2audio_model() -> Qwen2AudioForConditionalGeneration:
    torch.manual_seed(0)
    return far_from_init(Qwen2AudioForConditionalGeneration(Qwen2AudioConfig(**CONFIG))).eval()


def write_qwen2audio(folder: Path):
    """(transformers' model far from its init, in eval mode; its save_pretrained folder with the processor's
    preprocessor_config.json: WhisperFeatureExtractor's defaults at 128 mel bins)."""
    from transformers import WhisperFeatureExtractor

    model = qwen2audio_model()
    model.save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(folder)
    return model, Path(folder)
