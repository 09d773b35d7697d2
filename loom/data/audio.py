"""Waveforms → the audio encoder's input: Whisper's log-mel features, computed with torch.

Whisper's recipe (and transformers' WhisperFeatureExtractor's, which tests/test_audio.py compares against):
16 kHz audio, a 400-sample Hann-window STFT every 160 samples (100 frames per second, the last frame
dropped), power spectrum through a Slaney-scale, Slaney-normalised mel filter bank, log10 clamped at 1e-10,
floored at 8 below the clip's maximum, then (x + 4) / 4. No padding to 30 s: loom packs clips of any length.
`load_audio` decodes a file (soundfile: WAV, FLAC, OGG, …), averages its channels and resamples it to
16 kHz (scipy's polyphase filter).

Qwen2-Audio's processor pads every clip to 30 s (`padded_to` samples) before its log-mel and counts a clip's
frames by its attention mask, ceil(samples / 160); its tower's convolutions read two frames past them. Such a clip
is its own frames plus those two (CONTEXT_FRAMES) as that padded log-mel has them, and no longer than 30 s.
"""

from __future__ import annotations

import functools
import io
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from loom.data.conversations import BadSample
from loom.data.sample import MediaFile

SAMPLE_RATE, N_FFT, HOP = 16_000, 400, 160
CONTEXT_FRAMES = 2  # mel frames past a padded clip's end that its tower's convolutions read (models/qwen2_audio.py)
# what a Whisper feature extractor's preprocessor_config.json must say for these features to be its own
WHISPER_KEYS = {"sampling_rate": SAMPLE_RATE, "hop_length": HOP, "n_fft": N_FFT, "dither": 0.0, "padding_value": 0.0}


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    """Slaney's scale: linear below 1 kHz, logarithmic above."""
    log_step = math.log(6.4) / 27.0
    return torch.where(f < 1000.0, 3.0 * f / 200.0, 15.0 + torch.log(f.clamp(min=1e-10) / 1000.0) / log_step)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    log_step = math.log(6.4) / 27.0
    return torch.where(m < 15.0, 200.0 * m / 3.0, 1000.0 * torch.exp(log_step * (m - 15.0)))


@functools.lru_cache(maxsize=8)
def mel_filters(n_mels: int) -> torch.Tensor:
    """[n_mels, N_FFT // 2 + 1]: triangles evenly spaced in mel between 0 and 8 kHz, each scaled to unit area
    in Hz (Slaney normalisation), in float64 for exactness."""
    freqs = torch.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1, dtype=torch.float64)
    top = _hz_to_mel(torch.tensor(SAMPLE_RATE / 2, dtype=torch.float64))
    edges = _mel_to_hz(torch.linspace(0.0, float(top), n_mels + 2, dtype=torch.float64))
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising, falling = (freqs - lower) / (center - lower), (upper - freqs) / (upper - center)
    triangles = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return triangles * (2.0 / (upper - lower))


def log_mel(waveform: torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """[samples] at 16 kHz → [n_mels, samples // 160] float32 features."""
    wave = waveform.to(torch.float64)
    window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float64)
    spectrum = torch.stft(wave, N_FFT, HOP, window=window, center=True, pad_mode="reflect", return_complex=True)
    power = spectrum[:, :-1].abs() ** 2
    mel = mel_filters(n_mels) @ power
    logs = torch.clamp(mel, min=1e-10).log10()
    logs = torch.maximum(logs, logs.max() - 8.0)
    return ((logs + 4.0) / 4.0).to(torch.float32)


def audio_file(source: str | Path | bytes | tuple, n_mels: int, where: str = "", name: str = "",
               padded_to: int = 0) -> MediaFile:
    """The clip at `source` as log-mel features — a file, its bytes, or (waveform, rate) held in a table row
    (`name` says where) — its frame count read from the header alone (the length after resampling to 16 kHz,
    one frame per hop); decoded on `load()`. `padded_to`: the samples a processor pads it to (Qwen2-Audio's)."""
    import soundfile

    label = name or str(source)
    if isinstance(source, tuple):
        frames, rate = source[0].shape[-1], source[1]
    else:
        try:
            info = soundfile.info(_opened(source))
        except (RuntimeError, OSError, soundfile.LibsndfileError) as e:
            raise BadSample(f"{where + ': ' if where else ''}cannot read audio {label!r} ({e})") from None
        frames, rate = info.frames, info.samplerate
    ratio = Fraction(SAMPLE_RATE, rate)
    samples = -(-frames * ratio.numerator // ratio.denominator)  # resample_poly's output length
    if not padded_to:
        return MediaFile(label, (n_mels, samples // HOP), functools.partial(_features, source, n_mels, where, name))
    at = f"{where + ': ' if where else ''}audio {label!r}"
    if samples > padded_to:
        raise BadSample(f"{at} is {samples / SAMPLE_RATE:.2f} s, longer than the {padded_to / SAMPLE_RATE:g} s the "
                        f"model's processor pads a clip to (preprocessor_config.json n_samples = {padded_to}); cut it "
                        f"into clips of at most that")
    if -(-samples // HOP) < 3:
        raise BadSample(f"{at} is {samples} samples at 16 kHz: under 3 frames of {HOP}, it gives the model no row")
    return MediaFile(label, (n_mels, -(-samples // HOP) + CONTEXT_FRAMES),
                     functools.partial(_padded_features, source, n_mels, where, name, padded_to))


def _features(source, n_mels: int, where: str, name: str) -> torch.Tensor:
    return log_mel(load_audio(source, where, name), n_mels)


def _padded_features(source, n_mels: int, where: str, name: str, padded_to: int) -> torch.Tensor:
    return padded_log_mel(load_audio(source, where, name), n_mels, padded_to)


def padded_log_mel(waveform: torch.Tensor, n_mels: int, padded_to: int) -> torch.Tensor:
    """[samples] → [n_mels, ceil(samples / 160) + CONTEXT_FRAMES]: the clip's frames of the log-mel of it padded with
    silence to `padded_to` samples (its maximum over all of them), then the two frames after them (zeros past the
    padding, as the convolutions pad)."""
    frames = -(-waveform.shape[0] // HOP)
    mel = log_mel(torch.nn.functional.pad(waveform, (0, padded_to - waveform.shape[0])), n_mels)
    return torch.nn.functional.pad(mel, (0, CONTEXT_FRAMES))[:, : frames + CONTEXT_FRAMES]


def processor_samples(folder: str | Path, n_mels: int) -> int:
    """The samples a whole-model folder's Whisper feature extractor pads each clip to, its preprocessor_config.json
    checked to describe loom's features; a ValueError naming the file, the key and both values."""
    import json

    path = Path(folder) / "preprocessor_config.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing: loom reads the audio processor's padding and mel bins from it (save "
                         f"the folder's processor, e.g. AutoProcessor.from_pretrained(...).save_pretrained(folder))")
    cfg = json.loads(path.read_text())
    kind = cfg.get("feature_extractor_type", "WhisperFeatureExtractor")
    want = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": n_mels, **WHISPER_KEYS}
    have = {"feature_extractor_type": kind, "feature_size": cfg.get("feature_size", 80),
            **{k: cfg.get(k, v) for k, v in WHISPER_KEYS.items()}}
    bad = [f"{k} = {have[k]!r} (loom's features: {v!r})" for k, v in want.items() if have[k] != v]
    if bad:
        raise ValueError(f"{path}: {', '.join(bad)}")
    return int(cfg.get("n_samples", cfg.get("chunk_length", 30) * SAMPLE_RATE))


def load_audio(source: str | Path | bytes | tuple, where: str = "", name: str = "") -> torch.Tensor:
    """[samples] float32 at 16 kHz, the channels averaged; an undecodable file is a BadSample naming `where`
    (file:line) and the file. `source`: a file, its bytes, or (waveform [samples] or [channels, samples], rate)."""
    import soundfile
    from scipy.signal import resample_poly

    if isinstance(source, tuple):
        data, rate = source
        wave = data.mean(axis=0) if data.ndim == 2 else data
    else:
        try:
            data, rate = soundfile.read(_opened(source), dtype="float32", always_2d=True)
        except (RuntimeError, OSError, soundfile.LibsndfileError) as e:
            raise BadSample(f"{where + ': ' if where else ''}cannot decode audio {name or str(source)!r} "
                            f"({e})") from None
        wave = data.mean(axis=1)
    if rate != SAMPLE_RATE:
        ratio = Fraction(SAMPLE_RATE, rate)
        wave = resample_poly(wave, ratio.numerator, ratio.denominator)
    return torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))


def _opened(source: str | Path | bytes):
    """What soundfile reads: a path (as a string), or a file's bytes (a `datasets` Audio feature's)."""
    return io.BytesIO(source) if isinstance(source, bytes) else str(source)
