"""A built-in task's example without its pixels or waveform: the same prompt and answer, its images and clips as
`meta` tensors of the sizes `make_example` would draw. What planning a step needs (data/shapes.py): every rank
plans the bins of the whole global batch from its samples' shapes, and drawing each image and clip of it to
measure them cost 15 s a step per rank at 16,384 samples (bench/RESULTS.md, issue 50); this replays only the
generator's draws that decide the sizes and the answer.

Each outline replays `make_example`'s draws in its order (data/tasks.py), up to the last one that decides a size
or the answer; a change to a maker's draws must change its outline too. A mismatch cannot train silently: a
sample rendered for a step is checked against the shape it was planned with (train/step_data.py `rendered`),
and tests/test_task_outlines.py compares outline and example on every task.
"""

from __future__ import annotations

import torch

from loom.data import tasks as t
from loom.data.sample import Example


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")  # sizes only: nothing allocated, nothing drawn


def example_outline(task: str, split: str, index: int, *, seed: int, patch_size: int,
                    n_audio_features: int) -> Example:
    """`make_example(task, split, index, ...)` with its media as meta tensors of the same shapes."""
    if task == "sums":  # text only: the example itself is as cheap
        return t.make_example(task, split, index, seed=seed, patch_size=patch_size, n_audio_features=n_audio_features)
    t._check(task, split)
    rng = t._rng(task, split, index, seed)
    if task in ("digits", "shapes"):
        sides = t.DIGIT_SIDE_MULTIPLES if task == "digits" else t.SHAPE_SIDE_MULTIPLES
        height, width = (int(rng.choice(sides)) * patch_size for _ in range(2))
        if task == "digits":
            answer = t.DIGIT_WORDS[t._digits()[1][t.digit_source_index(split, index)]]
        else:  # _make_shape: the shape's name, then its colour
            shape = t.SHAPE_NAMES[rng.integers(len(t.SHAPE_NAMES))]
            answer = f"{t.COLOUR_NAMES[int(rng.integers(len(t.COLOUR_NAMES)))]} {shape}"
        return Example(task=task, prompt=t.PROMPTS[task], answer=answer, images=[_meta(3, height, width)])
    samples, answer = _tone_length(rng)
    frames = samples // t.HOP + 1  # torch.stft with center=True
    return Example(task="tones", prompt=t.PROMPTS["tones"], answer=answer, audio=[_meta(n_audio_features, frames)])


def _tone_length(rng) -> tuple[int, str]:
    """`_tone_wave`'s length in samples and its answer: its draws in its order, none of its arrays."""
    n_tones = int(rng.integers(1, 4))
    classes = rng.integers(len(t.TONE_NAMES), size=n_tones)
    samples = int(rng.uniform(*t.EDGE_SECONDS) * t.SAMPLE_RATE)
    for k in range(n_tones):
        if k:
            samples += int(rng.uniform(*t.GAP_SECONDS) * t.SAMPLE_RATE)
        samples += int(rng.uniform(*t.TONE_SECONDS) * t.SAMPLE_RATE)
        rng.uniform(0.97, 1.03), rng.uniform(0.3, 0.6), rng.uniform(0, 2 * 3.141592653589793)  # detune, level, phase
    samples += int(rng.uniform(*t.EDGE_SECONDS) * t.SAMPLE_RATE)
    return samples, " ".join(t.TONE_NAMES[c] for c in classes)
