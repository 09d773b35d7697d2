"""Global batches in an order fixed by the seed alone, so every layout sees the same samples.

Step s reads the global batch `indices(s)`; a data-parallel replica takes its contiguous share. The order
is a fresh permutation per epoch; the state to resume is just the step number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class GlobalBatches(Generic[T]):
    def __init__(self, dataset: Sequence, global_batch_size: int, seed: int, transform: Callable[..., T]) -> None:
        if global_batch_size > len(dataset):
            raise ValueError(f"global batch size {global_batch_size} exceeds the dataset size {len(dataset)}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.transform = transform
        self._perm_epoch, self._perm = -1, None
        self._step, self._samples = -1, {}  # the current step's transformed samples, by dataset index

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.dataset), generator=g), epoch
        return self._perm

    def indices(self, step: int) -> list[int]:
        """Dataset indices of global batch `step` (an epoch's leftover is dropped, so batches stay full)."""
        per_epoch = len(self.dataset) // self.global_batch_size
        epoch, k = divmod(step, per_epoch)
        b = self.global_batch_size
        return self._permutation(epoch)[k * b : (k + 1) * b].tolist()

    def shard(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> list[T]:
        """This replica's samples of global batch `step`, transformed."""
        idx = self.indices(step)
        if len(idx) % dp_size:
            raise ValueError(f"global batch size {len(idx)} is not divisible by dp={dp_size}")
        share = len(idx) // dp_size
        if step != self._step:  # the LLM's and each encoder's shares of one step overlap: build each once
            self._step, self._samples = step, {}
        out = []
        for i in idx[dp_rank * share : (dp_rank + 1) * share]:
            if i not in self._samples:
                self._samples[i] = self.transform(self.dataset[i])
            out.append(self._samples[i])
        return out
