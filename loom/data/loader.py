"""Global batches in an order fixed by the seed alone, so every layout sees the same samples.

Step s reads the global batch `indices(s)`; a data-parallel replica takes its contiguous share. The order
is a fresh permutation per epoch; the state to resume is just the step number. A step is planned from its
items' shapes (`shapes`: a dataset's own, measured once, or else measured from the items rendered) and renders
only the items a rank takes (`item`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np
import torch

from loom.data.conversations import BadSample
from loom.data.format import TokenCounter
from loom.data.sample import sequences_of
from loom.data.shape_arrays import ShapeArrays
from loom.data.shapes import SampleShape, shape_of

T = TypeVar("T")


class GlobalBatches(Generic[T]):
    def __init__(self, dataset: Sequence, global_batch_size: int, seed: int,
                 transform: Callable[..., T] = lambda x: x) -> None:
        if global_batch_size > len(dataset):
            raise ValueError(f"global batch size {global_batch_size} exceeds the dataset size {len(dataset)}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.transform = transform
        self.dropped: set[int] = set()  # indices found bad and reported: None whenever drawn again
        self._perm_epoch, self._perm = -1, None
        self._step, self._samples = -1, {}  # the current step's transformed samples, by dataset index

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.dataset), generator=g), epoch
        return self._perm

    def indices(self, step: int) -> list[int]:
        """Dataset indices of global batch `step` (an epoch's leftover is dropped, so batches stay full)."""
        return self.index_array(step).tolist()

    def index_array(self, step: int) -> np.ndarray:
        """`indices(step)` as an int64 array, a view of the epoch's order: no list of the whole batch (a rank that
        plans only its cells of the step slices it)."""
        per_epoch = len(self.dataset) // self.global_batch_size
        epoch, k = divmod(step, per_epoch)
        b = self.global_batch_size
        return self._permutation(epoch)[k * b : (k + 1) * b].numpy()

    def drop(self, index: int) -> None:
        """Dataset item `index` is bad (e.g. its file failed to decode): None from now on."""
        self.dropped.add(index)
        self._samples[index] = None

    def shard(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> list[T | BadSample | None]:
        """This replica's samples of global batch `step`, transformed: a BadSample where the transform found
        the item bad (the caller reports it and `drop`s it), None where it was dropped before."""
        idx = self.indices(step)
        if len(idx) % dp_size:
            raise ValueError(f"global batch size {len(idx)} is not divisible by dp={dp_size}")
        share = len(idx) // dp_size
        return [self.item(step, i) for i in idx[dp_rank * share : (dp_rank + 1) * share]]

    def shapes(self, step: int, counters: dict[str, TokenCounter]) -> list[tuple[SampleShape, ...] | BadSample | None]:
        """The shapes of global batch `step`'s items, one per sequence of each (a DPO pair: two): the dataset's
        own (`dataset.shape(i)`, measured once: nothing rendered), else measured from the item rendered now (kept
        for `item`); a BadSample where the item is bad, None where it was dropped."""
        own = getattr(self.dataset, "shape", None)
        out = []
        for i in self.indices(step):
            if i in self.dropped:
                out.append(None)
                continue
            try:
                out.append(own(i) if own is not None else self._measured(step, i, counters))
            except BadSample as e:  # the same on every rank: they all measure the same bytes
                out.append(e)
        return out

    def sequence_shapes(self, step: int, counters: dict[str, TokenCounter]
                        ) -> tuple[ShapeArrays, np.ndarray, dict[int, str]]:
        """The shapes of global batch `step`'s sequences as arrays (a DPO pair's two side by side), each one's
        dataset index, and the items found bad (index → why; left out, as are the items dropped before): looked
        up in the dataset's `table` (data/shape_table.py) where it has one, else as `shapes` finds them."""
        table = getattr(self.dataset, "table", None)
        if table is None:
            return measured_sequence_shapes(self, step, counters)
        indices = np.array(self.indices(step), dtype=np.int64)
        if self.dropped:
            indices = indices[~np.isin(indices, list(self.dropped))]
        shapes, items = table.shapes(indices)
        return shapes, items, {}

    def _measured(self, step: int, i: int, counters: dict[str, TokenCounter]) -> tuple[SampleShape, ...]:
        item = self.item(step, i)
        if isinstance(item, BadSample):
            raise item
        return tuple(shape_of(s, counters) for s in sequences_of(item))

    def item(self, step: int, i: int) -> T | BadSample | None:
        """Dataset item `i` of global batch `step`, transformed (rendered once per step, whoever asks)."""
        if step != self._step:
            self._step, self._samples = step, {}
        if i not in self._samples:
            self._samples[i] = None if i in self.dropped else self._transformed(i)
        return self._samples[i]

    def _transformed(self, i: int) -> T | BadSample:
        try:
            return self.transform(self.dataset[i])
        except BadSample as e:  # the same on every rank: they all read the same bytes
            return e


def measured_sequence_shapes(batches, step: int, counters: dict[str, TokenCounter]
                             ) -> tuple[ShapeArrays, np.ndarray, dict[int, str]]:
    """GlobalBatches.sequence_shapes of a dataset without a shape table, from `batches.shapes(step, counters)` and
    `batches.indices(step)` (any object that has them: a benchmark's synthetic steps too)."""
    found, shapes, items, bad = batches.shapes(step, counters), [], [], {}
    for i, item in zip(batches.indices(step), found):
        if isinstance(item, BadSample):
            bad[i] = str(item)
        elif item is not None:
            shapes += item
            items += [i] * len(item)
    return ShapeArrays.of(shapes, list(counters)), np.array(items, dtype=np.int64), bad
