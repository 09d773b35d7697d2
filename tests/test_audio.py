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


def test_load_audio_decodes_averages_channels_and_resamples(tmp_path):
    import soundfile

    from loom.data.audio import load_audio

    t = np.arange(24_000) / 48_000  # 0.5 s at 48 kHz, stereo: a 1 kHz tone on the left, silence on the right
    left = 0.5 * np.sin(2 * np.pi * 1000 * t)
    soundfile.write(tmp_path / "a.wav", np.stack([left, np.zeros_like(left)], axis=1), 48_000)
    wave = load_audio(tmp_path / "a.wav")
    assert wave.shape == (8000,) and wave.dtype == torch.float32
    want = 0.25 * np.sin(2 * np.pi * 1000 * np.arange(8000) / 16_000)  # the channels' mean, at 16 kHz
    assert np.abs(wave.numpy()[200:-200] - want[200:-200]).max() < 2e-3  # away from the filter's edges


def test_an_undecodable_clip_names_the_sample_and_the_file(tmp_path):
    from loom.data.audio import load_audio

    (tmp_path / "bad.wav").write_bytes(b"RIFF nothing")
    with pytest.raises(ValueError, match=r"data\.jsonl:9: cannot decode audio '.*bad\.wav'"):
        load_audio(tmp_path / "bad.wav", "data.jsonl:9")
