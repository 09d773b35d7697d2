"""Waveforms → the audio encoder's input: Whisper's log-mel features, computed with torch.

Whisper's recipe (and transformers' WhisperFeatureExtractor's, which tests/test_audio.py compares against):
16 kHz audio, a 400-sample Hann-window STFT every 160 samples (100 frames per second, the last frame
dropped), power spectrum through a Slaney-scale, Slaney-normalised mel filter bank, log10 clamped at 1e-10,
floored at 8 below the clip's maximum, then (x + 4) / 4. No padding to 30 s: loom packs clips of any length.
`load_audio` decodes a file (soundfile: WAV, FLAC, OGG, …), averages its channels and resamples it to
16 kHz (scipy's polyphase filter).
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


def audio_file(source: str | Path | bytes | tuple, n_mels: int, where: str = "", name: str = "") -> MediaFile:
    """The clip at `source` as log-mel features — a file, its bytes, or (waveform, rate) held in a table row
    (`name` says where) — its frame count read from the header alone (the length after resampling to 16 kHz,
    one frame per hop); decoded on `load()`."""
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
    return MediaFile(label, (n_mels, samples // HOP), functools.partial(_features, source, n_mels, where, name))


def _features(source, n_mels: int, where: str, name: str) -> torch.Tensor:
    return log_mel(load_audio(source, where, name), n_mels)


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
