"""The two shapes of one training example: as a task emits it, and as the model reads it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Example:
    """What a task produces: raw modality inputs plus prompt and answer text."""

    task: str
    prompt: str
    answer: str
    images: list[torch.Tensor] = field(default_factory=list)  # each [channels, height, width], float
    audio: list[torch.Tensor] = field(default_factory=list)  # each [n_features, n_frames], float


@dataclass(frozen=True)
class MediaFile:
    """An image or clip not decoded yet. Its decoded shape is known from the file's header, and that is all the
    token counts need, so every rank can plan a whole global batch while decoding only the items its encoder
    replicas take (`load`)."""

    path: Path | str  # the file, or how an item embedded in a table row is named
    shape: tuple[int, ...]  # of the tensor `decode` returns
    decode: Callable[[], torch.Tensor]

    def load(self) -> torch.Tensor:
        x = self.decode()
        if tuple(x.shape) != self.shape:  # the header promised another size: the row counts would be wrong
            raise ValueError(f"{self.path}: decoded to {tuple(x.shape)}, its header said {self.shape}")
        return x


Item = torch.Tensor | MediaFile


def decoded(item: Item) -> torch.Tensor:
    return item.load() if isinstance(item, MediaFile) else item


@dataclass
class Sample:
    """An example turned into tokens: placeholders sized to what each encoder emits for its input."""

    tokens: list[int]
    supervised: list[bool]  # True where tokens[i] is a target (answer and <eos>)
    images: list[Item]  # each [channels, height, width] once decoded
    audio: list[Item]  # each [n_features, n_frames] once decoded
    task: str = ""  # the task or source it came from (held-out metrics are reported per task)
    where: str = ""  # file:line of a user's conversation
    # per-token values an objective reads beside the labels (advantages, behaviour or reference logprobs, …):
    # name → one value per token, aligned with the labels (value i belongs to the target at position i)
    token_fields: dict[str, list[float]] = field(default_factory=dict)
    # M-RoPE models (Qwen2-VL): each token's (time, height, width) position (data/mrope.py); None: 0, 1, 2, …
    rope_positions: list[tuple[int, int, int]] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def items(self, modality: str) -> list[Item]:
        """This sample's inputs of one modality ("vision" or "audio"), in placeholder order."""
        return {"vision": self.images, "audio": self.audio}[modality]


@dataclass
class SamplePair:
    """A DPO line: two answers to one prompt, each a sample that trains its answer alone. Drawn as one dataset
    item, so its two sequences always share a step, a replica and a microbatch (train/inputs.py)."""

    chosen: Sample
    rejected: Sample

    @property
    def sequences(self) -> list[Sample]:
        """Chosen first: the DPO objective pairs a microbatch's sequences 2j (chosen) and 2j + 1 (rejected)."""
        return [self.chosen, self.rejected]


def sequences_of(item: Sample | SamplePair) -> list[Sample]:
    """The sequences one dataset item trains: a sample alone, or a pair's two."""
    return item.sequences if isinstance(item, SamplePair) else [item]
