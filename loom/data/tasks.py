"""The embedded default dataset: small, real, learnable tasks that need no download.

Four tasks, each a pure function of (task, split, index, seed, sizes):

* ``digits``: real handwritten 8x8 digits from scikit-learn, rescaled to a varying size;
  the answer is the English word ("seven").
* ``shapes``: one coloured square, circle or triangle on a dark background ("red circle").
* ``tones``: 1-3 low/mid/high tones as a log-mel spectrogram ("low high").
* ``sums``: text only, two numbers below 100 to add ("sum:12+35=" → "47"): a job with no encoder.

Randomness comes only from a ``numpy`` generator seeded by those arguments, never from
global RNG state, so the same arguments always give bit-identical tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from loom.data.sample import Example

TASKS = ("digits", "shapes", "tones", "sums")
SPLITS = ("train", "heldout")

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SHAPE_NAMES = ("square", "circle", "triangle")
COLOUR_NAMES = ("red", "green", "blue")
TONE_NAMES = ("low", "mid", "high")

SUM_BELOW = 100  # sums: both numbers are drawn from 0 … SUM_BELOW − 1

# exact-match accuracy of guessing uniformly; tones: uniform over all 3 + 9 + 27 sequences
CHANCE: dict[str, float] = {
    "digits": 1 / len(DIGIT_WORDS),
    "shapes": 1 / (len(SHAPE_NAMES) * len(COLOUR_NAMES)),
    "tones": 1 / sum(len(TONE_NAMES) ** n for n in (1, 2, 3)),
    "sums": 1 / (2 * SUM_BELOW - 1),  # uniform over 0 … 2·(SUM_BELOW − 1)
}

PROMPTS = {"digits": "digit:", "shapes": "shape:", "tones": "tones:", "sums": "sum:"}

# image sides are these multiples of patch_size, so every image splits into whole patches
DIGIT_SIDE_MULTIPLES = (2, 3, 4)
SHAPE_SIDE_MULTIPLES = (3, 4, 5, 6)

N_HELDOUT_DIGITS = 297
_DIGIT_SPLIT_SEED = 20240917  # fixed, so the held-out digits never depend on the run's seed

SAMPLE_RATE = 8000
N_FFT = 256
HOP = 80  # 10 ms frames: 1 short tone gives ~11 frames, 3 long ones ~57
TONE_HZ = (300.0, 800.0, 2000.0)  # far apart on the mel scale, so classes separate cleanly
TONE_SECONDS = (0.08, 0.14)
GAP_SECONDS = (0.02, 0.05)
EDGE_SECONDS = (0.01, 0.02)
# fixed affine map of log-mel power, measured once, so features are O(1) whatever the batch
LOG_MEL_SHIFT = 8.5
LOG_MEL_SCALE = 2.5


def _check(task: str, split: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


def _rng(task: str, split: str, index: int, seed: int) -> np.random.Generator:
    # SeedSequence hashes the whole tuple, so neighbouring indices get unrelated streams
    words = [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, TASKS.index(task), SPLITS.index(split), index]
    return np.random.default_rng(np.random.SeedSequence(words))


# ---------------------------------------------------------------- digits


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, np.ndarray, dict[str, np.ndarray]]:
    """All 1797 images normalised to zero mean and unit variance, labels, and split indices."""
    from sklearn.datasets import load_digits  # imported lazily: only this task needs it

    data = load_digits()
    images = data.images.astype(np.float32)
    images = (images - images.mean()) / images.std()
    order = np.random.default_rng(_DIGIT_SPLIT_SEED).permutation(len(images))
    splits = {"train": order[:-N_HELDOUT_DIGITS], "heldout": order[-N_HELDOUT_DIGITS:]}
    return torch.from_numpy(images), data.target.astype(np.int64), splits


def digit_source_index(split: str, index: int) -> int:
    """The scikit-learn index of the digit behind ``make_example("digits", split, index)``."""
    _check("digits", split)
    subset = _digits()[2][split]
    return int(subset[index % len(subset)])


def _make_digit(split: str, index: int, rng: np.random.Generator, patch_size: int) -> Example:
    images, labels, _ = _digits()
    source = digit_source_index(split, index)
    # height and width drawn separately, so some images are not square
    height, width = (int(rng.choice(DIGIT_SIDE_MULTIPLES)) * patch_size for _ in range(2))
    image = images[source][None, None]  # [1, 1, 8, 8] for interpolate
    image = F.interpolate(image, size=(height, width), mode="bilinear", align_corners=False)
    image = image[0].expand(3, height, width).contiguous()  # grey replicated to the 3 channels encoders expect
    return Example(task="digits", prompt=PROMPTS["digits"], answer=DIGIT_WORDS[labels[source]], images=[image])


# ---------------------------------------------------------------- shapes


def _shape_mask(shape: str, height: int, width: int, top: float, left: float, size: float) -> np.ndarray:
    """Boolean mask of a shape inside the box [top, top + size) x [left, left + size)."""
    y = np.arange(height, dtype=np.float32)[:, None] + 0.5  # pixel centres
    x = np.arange(width, dtype=np.float32)[None, :] + 0.5
    if shape == "square":
        return (y >= top) & (y < top + size) & (x >= left) & (x < left + size)
    if shape == "circle":
        r = size / 2
        return (y - top - r) ** 2 + (x - left - r) ** 2 <= r * r
    # upright triangle: apex at the top centre, base along the bottom of the box
    depth = (y - top) / size
    return (depth >= 0) & (depth <= 1) & (np.abs(x - left - size / 2) <= depth * size / 2)


def _make_shape(rng: np.random.Generator, patch_size: int) -> Example:
    height, width = (int(rng.choice(SHAPE_SIDE_MULTIPLES)) * patch_size for _ in range(2))
    shape = SHAPE_NAMES[rng.integers(len(SHAPE_NAMES))]
    colour_id = int(rng.integers(len(COLOUR_NAMES)))
    # at least 45% of the smaller side, so the shape stays recognisable at 12x12
    size = rng.uniform(0.45, 0.8) * min(height, width)
    top = rng.uniform(0, height - size)
    left = rng.uniform(0, width - size)
    mask = _shape_mask(shape, height, width, top, left, size)

    colour = rng.uniform(0.0, 0.25, size=3)
    colour[colour_id] = rng.uniform(0.75, 1.0)  # one dominant channel names the colour
    background = rng.uniform(0.0, 0.2)
    image = np.full((3, height, width), background, dtype=np.float32)
    image[:, mask] = colour[:, None]
    image += rng.normal(0.0, 0.03, size=image.shape)
    image = (image - 0.17) / 0.22  # fixed shift and scale measured once: zero mean, unit variance like digits
    answer = f"{COLOUR_NAMES[colour_id]} {shape}"
    tensor = torch.from_numpy(image.astype(np.float32))
    return Example(task="shapes", prompt=PROMPTS["shapes"], answer=answer, images=[tensor])


# ---------------------------------------------------------------- tones


def _hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + np.asarray(hz) / 700.0)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


@functools.lru_cache(maxsize=8)
def mel_filterbank(n_mels: int) -> torch.Tensor:
    """[n_mels, N_FFT // 2 + 1] triangular filters, each averaging the power in its band."""
    bin_hz = np.linspace(0.0, SAMPLE_RATE / 2, N_FFT // 2 + 1)
    edges = _mel_to_hz(np.linspace(0.0, _hz_to_mel(SAMPLE_RATE / 2), n_mels + 2))
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bin_hz - lower) / (centre - lower)
    falling = (upper - bin_hz) / (upper - centre)
    weights = np.clip(np.minimum(rising, falling), 0.0, None)
    # with many mels the low filters are narrower than an FFT bin: give them their nearest bin
    for row in np.flatnonzero(weights.sum(axis=1) == 0):
        weights[row, np.argmin(np.abs(bin_hz - centre[row, 0]))] = 1.0
    weights /= weights.sum(axis=1, keepdims=True)  # band average, so wide and narrow bands share a scale
    return torch.from_numpy(weights.astype(np.float32))


@functools.lru_cache(maxsize=1)
def _hann() -> torch.Tensor:
    return torch.hann_window(N_FFT)


def log_mel(wave: torch.Tensor, n_mels: int) -> torch.Tensor:
    """[n_mels, n_frames] normalised log-mel spectrogram of a mono waveform at SAMPLE_RATE."""
    spec = torch.stft(wave, N_FFT, hop_length=HOP, window=_hann(), center=True, return_complex=True)
    power = spec.abs().pow(2) / _hann().sum()  # per-sample scale: white noise of variance v gives ~0.75 v
    mel = mel_filterbank(n_mels) @ power
    return (torch.log(mel + 1e-6) + LOG_MEL_SHIFT) / LOG_MEL_SCALE


def _tone_wave(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """A noisy float64 waveform at SAMPLE_RATE of 1-3 tones and its answer ("low high")."""
    n_tones = int(rng.integers(1, 4))
    classes = rng.integers(len(TONE_NAMES), size=n_tones)
    pieces = [np.zeros(int(rng.uniform(*EDGE_SECONDS) * SAMPLE_RATE))]
    for k, cls in enumerate(classes):
        if k:
            pieces.append(np.zeros(int(rng.uniform(*GAP_SECONDS) * SAMPLE_RATE)))
        n = int(rng.uniform(*TONE_SECONDS) * SAMPLE_RATE)
        hz = TONE_HZ[cls] * rng.uniform(0.97, 1.03)  # slight detuning, so the task is not one exact bin
        t = np.arange(n) / SAMPLE_RATE
        ramp = np.minimum(1.0, np.minimum(np.arange(n), np.arange(n)[::-1]) / (0.005 * SAMPLE_RATE))  # no clicks
        pieces.append(rng.uniform(0.3, 0.6) * ramp * np.sin(2 * math.pi * hz * t + rng.uniform(0, 2 * math.pi)))
    pieces.append(np.zeros(int(rng.uniform(*EDGE_SECONDS) * SAMPLE_RATE)))
    wave = np.concatenate(pieces)
    wave = wave + rng.normal(0.0, rng.uniform(0.005, 0.02), size=wave.shape)
    return wave, " ".join(TONE_NAMES[c] for c in classes)


def tone_wave(split: str, index: int, *, seed: int) -> tuple[np.ndarray, int, str]:
    """(waveform, its sample rate, answer) behind ``make_example("tones", split, index, seed=seed, ...)``:
    the clip before its log-mel, e.g. to write it as an audio file."""
    _check("tones", split)
    wave, answer = _tone_wave(_rng("tones", split, index, seed))
    return wave, SAMPLE_RATE, answer


def _make_tones(rng: np.random.Generator, n_audio_features: int) -> Example:
    wave, answer = _tone_wave(rng)
    features = log_mel(torch.from_numpy(wave.astype(np.float32)), n_audio_features)
    return Example(task="tones", prompt=PROMPTS["tones"], answer=answer, audio=[features])


# ---------------------------------------------------------------- sums


def _make_sum(rng: np.random.Generator) -> Example:
    a, b = (int(x) for x in rng.integers(0, SUM_BELOW, size=2))
    return Example(task="sums", prompt=f"{PROMPTS['sums']}{a}+{b}=", answer=str(a + b))


# ---------------------------------------------------------------- public API


def make_example(task: str, split: str, index: int, *, seed: int, patch_size: int, n_audio_features: int) -> Example:
    """One example, a pure function of its arguments."""
    _check(task, split)
    if patch_size < 1 or n_audio_features < 1:
        raise ValueError(f"patch_size and n_audio_features must be positive, got {patch_size}, {n_audio_features}")
    rng = _rng(task, split, index, seed)
    if task == "digits":
        return _make_digit(split, index, rng, patch_size)
    if task == "shapes":
        return _make_shape(rng, patch_size)
    if task == "sums":
        return _make_sum(rng)
    return _make_tones(rng, n_audio_features)


def longest_example(task: str, patch_size: int, n_audio_features: int) -> Example:
    """The largest example `task` can emit (its largest image or longest clip, its longest answer), so the
    longest sample is known before any data is drawn."""
    _check(task, "train")
    if task in ("digits", "shapes"):
        side = max(DIGIT_SIDE_MULTIPLES if task == "digits" else SHAPE_SIDE_MULTIPLES) * patch_size
        words = DIGIT_WORDS if task == "digits" else [f"{c} {s}" for c in COLOUR_NAMES for s in SHAPE_NAMES]
        return Example(task, PROMPTS[task], max(words, key=len), images=[torch.zeros(3, side, side)])
    if task == "sums":
        top = SUM_BELOW - 1
        return Example(task, f"{PROMPTS[task]}{top}+{top}=", str(2 * top))
    seconds = 2 * EDGE_SECONDS[1] + 3 * TONE_SECONDS[1] + 2 * GAP_SECONDS[1]  # three tones, widest gaps
    clip = log_mel(torch.zeros(int(seconds * SAMPLE_RATE) + 1), n_audio_features)
    return Example(task, PROMPTS[task], " ".join([max(TONE_NAMES, key=len)] * 3), audio=[clip])


class TaskDataset:
    """A finite, indexable mix of tasks: item i is example i // len(tasks) of task tasks[i % len(tasks)]."""

    def __init__(
        self, tasks: Sequence[str], split: str, size: int, *, seed: int, patch_size: int, n_audio_features: int
    ) -> None:
        if not tasks:
            raise ValueError(f"need at least one task; expected some of {TASKS}")
        for task in tasks:
            _check(task, split)
        if size < 0:
            raise ValueError(f"size must be non-negative, got {size}")
        self.tasks = tuple(tasks)
        self.split = split
        self.size = size
        self.seed = seed
        self.patch_size = patch_size
        self.n_audio_features = n_audio_features

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Example:
        return self.example(i, make_example)

    def example(self, i: int, maker=make_example) -> Example:
        """Item i made by `maker` (make_example's signature): data/task_outlines.py's `example_outline` gives its
        images and clips as meta tensors of their sizes, for planning."""
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"index {i} out of range for a dataset of {self.size}")
        task = self.tasks[i % len(self.tasks)]
        return maker(task, self.split, i // len(self.tasks), seed=self.seed, patch_size=self.patch_size,
                     n_audio_features=self.n_audio_features)
