"""The two shapes of one training example: as a task emits it, and as the model reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Example:
    """What a task produces: raw modality inputs plus prompt and answer text."""

    task: str
    prompt: str
    answer: str
    images: list[torch.Tensor] = field(default_factory=list)  # each [channels, height, width], float
    audio: list[torch.Tensor] = field(default_factory=list)  # each [n_features, n_frames], float


@dataclass
class Sample:
    """An example turned into tokens: placeholders sized to what each encoder emits for its input."""

    tokens: list[int]
    supervised: list[bool]  # True where tokens[i] is a target (answer and <eos>)
    images: list[torch.Tensor]
    audio: list[torch.Tensor]
    task: str = ""

    def __len__(self) -> int:
        return len(self.tokens)

    def items(self, modality: str) -> list[torch.Tensor]:
        """This sample's inputs of one modality ("vision" or "audio"), in placeholder order."""
        return {"vision": self.images, "audio": self.audio}[modality]
