"""Waveforms → Whisper log-mel features (loom/data/audio.py) against transformers' WhisperFeatureExtractor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.data.audio import log_mel


@pytest.mark.parametrize("n_mels,seconds", [(80, 2.0), (128, 0.73), (80, 0.05)])
def test_log_mel_matches_whisper_feature_extractor(n_mels, seconds):
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(n_mels)
    t = np.arange(int(16_000 * seconds)) / 16_000
    wave = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    want = WhisperFeatureExtractor(feature_size=n_mels)(wave, sampling_rate=16_000, return_tensors="np",
                                                        padding=False)["input_features"][0]
    ours = log_mel(torch.from_numpy(wave), n_mels).numpy()
    assert ours.shape == want.shape == (n_mels, t.size // 160)
    assert np.abs(ours - want).max() < 1e-4
