"""The benchmark's data: realistic multimodal samples from a fixed seed, grouped so each LLM replica's share
of a step packs into one sequence of `seq` tokens. Every contender sees the same samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loom.data.loader import measured_sequence_shapes
from loom.data.sample import Sample
from loom.data.shapes import SampleShape, shape_of
from loom.data.tokenizer import ByteTokenizer


@dataclass(frozen=True)
class Shape:
    patch: int = 14
    image_px: tuple[int, int] = (224, 448)  # image sides: 256–1024 patches at patch 14
    text: tuple[int, int] = (64, 1024)
    audio_every: int = 4  # one sample in this many carries a clip (0: none)
    audio_frames: tuple[int, int] = (200, 600)  # mel frames (100 per second): 100–300 tokens after the conv
    mels: int = 80
    images: int = 1  # images per sample (more: an encoder-heavy workload)
    images_max: int = 0  # > images: each sample draws its count from [images, images_max] (video-like)

    @property
    def longest(self) -> int:
        """The longest sample `sample` can draw (<bos>, the largest image's patches, the longest clip after
        the stride-2 conv, the longest text): known before any step, as a loom task's longest sample."""
        clip = self.audio_frames[1] // 2 if self.audio_every else 0
        return 1 + max(self.images, self.images_max) * (self.image_px[1] // self.patch) ** 2 + clip + self.text[1] - 1


SMALL = Shape(patch=4, image_px=(16, 32), text=(8, 48), audio_frames=(8, 24), mels=16)


def sample(rng: np.random.Generator, shape: Shape, tok: ByteTokenizer) -> Sample:
    side = lambda: int(rng.integers(shape.image_px[0], shape.image_px[1] + 1)) // shape.patch * shape.patch  # noqa: E731
    count = int(rng.integers(shape.images, shape.images_max + 1)) if shape.images_max > shape.images else shape.images
    sizes = [(side(), side()) for _ in range(count)]
    images = [torch.from_numpy(rng.standard_normal((3, h, w), dtype=np.float32)) for h, w in sizes]
    clips = []
    if shape.audio_every and rng.integers(shape.audio_every) == 0:
        frames = int(rng.integers(*shape.audio_frames))
        clips = [torch.from_numpy(rng.standard_normal((shape.mels, frames), dtype=np.float32))]
    text = rng.integers(0, 256, int(rng.integers(*shape.text))).tolist()
    patches = sum((h // shape.patch) * (w // shape.patch) for h, w in sizes)
    prompt = [tok.bos_id] + [tok.placeholder_ids["vision"]] * patches
    prompt += [tok.placeholder_ids["audio"]] * sum((c.shape[1] + 1) // 2 for c in clips)
    return Sample(prompt + text, [False] * len(prompt) + [True] * len(text), images, clips)


class PackedSteps:
    """Global batch `step`: `replicas × per_replica` samples; each replica's run of samples fits `seq`
    tokens (groups that would not fit are redrawn, deterministically)."""

    def __init__(self, shape: Shape, replicas: int, per_replica: int, seq: int, seed: int = 0) -> None:
        self.shape, self.replicas, self.per_replica, self.seq, self.seed = shape, replicas, per_replica, seq, seed
        self.tok = ByteTokenizer()
        self.dataset = None  # no files behind the samples: loom names them by index
        self.dropped: frozenset[int] = frozenset()  # nor is any ever found bad and dropped

    def global_batch(self, step: int) -> list[Sample]:
        if getattr(self, "_cached", (None,))[0] != step:  # the LLM and each encoder read the same step
            self._cached = (step, self.draw(step))
        return self._cached[1]

    def draw(self, step: int) -> list[Sample]:
        """Step `step`'s samples: every replica's group, in replica order."""
        return [s for r in range(self.replicas) for s in self.group(step, r)]

    def group(self, step: int, replica: int) -> list[Sample]:
        """Replica `replica`'s samples of step `step`: drawn from (seed, step, replica) alone."""
        rng = np.random.default_rng([self.seed, step, replica])
        while True:
            group = [sample(rng, self.shape, self.tok) for _ in range(self.per_replica)]
            if sum(len(s) for s in group) <= self.seq:
                return group

    def indices(self, step: int) -> list[int]:
        return list(range(self.replicas * self.per_replica))

    def shapes(self, step: int, counters: dict) -> list[tuple[SampleShape, ...]]:
        """loom plans a step from its samples' shapes (data/loader.py's GlobalBatches does the same)."""
        return [(shape_of(s, counters),) for s in self.global_batch(step)]

    def sequence_shapes(self, step: int, counters: dict):
        """The same as arrays, as loom's step draws them (no shape table: measured from the samples)."""
        return measured_sequence_shapes(self, step, counters)

    def item(self, step: int, i: int) -> Sample:
        return self.global_batch(step)[i]

    def shard(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> list[Sample]:
        batch = self.global_batch(step)
        share = len(batch) // dp_size
        return batch[dp_rank * share : (dp_rank + 1) * share]


class ReplicaSweep(PackedSteps):
    """One GPU working through an N-replica step one group at a time: its step k is replica k % N's group of
    step k // N, so N of its steps carry exactly the samples of one step of the N-GPU row (the like-for-like
    one-GPU row of a data-parallel comparison; replica 0's groups alone differ from the N groups' mean by chance)."""

    def __init__(self, shape: Shape, of_replicas: int, per_replica: int, seq: int, seed: int = 0) -> None:
        super().__init__(shape, 1, per_replica, seq, seed)
        self.of_replicas = of_replicas

    def draw(self, step: int) -> list[Sample]:
        return self.group(step // self.of_replicas, step % self.of_replicas)
