"""A dataset's items' shapes in numpy arrays, each item measured once per run, so planning a step looks its samples
up by index instead of measuring them (a built-in task's outline costs ~75 µs a sample: at 8,192 ranks a global
batch of 16,384 samples took 1.2 s a step on every rank; bench/RESULTS.md, issue 50).

A shape depends only on the item's index (the dataset is seeded), never on the step. In a world of several ranks
`measured_table` splits the items over the ranks as the prescan splits a user's lines (train/prescan.py): each
measures every world-th item, one all_gather_object over a gloo group combines them, so start-up costs
data.train_size / world measurements a rank. On one process the table fills as steps draw items (the same
measurements, spread over the first epoch). A user's lines are measured by the prescan, which leaves every line's
shapes on every rank: `known_table` fills their table at load, each rank alone, no collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch.distributed as dist

from loom.distributed import host_world_group
from loom.data.shape_arrays import ShapeArrays
from loom.data.shape_columns import ShapeColumns
from loom.data.shapes import SampleShape

Measure = Callable[[int], tuple[SampleShape, ...]]  # item index → its shapes, one per sequence
KNOWN_CHUNK = 65_536  # items put at once by `known_table`


class ShapeTable:
    """Item i's `sequences` shapes at rows i·sequences … of the arrays; an item not measured yet is measured when
    asked for (`known`)."""

    def __init__(self, size: int, sequences: int, encoders: Sequence[str], measure: Measure) -> None:
        self.size, self.sequences, self.encoders, self.measure = size, sequences, list(encoders), measure
        n = size * sequences
        self.known, self.complete = np.zeros(size, dtype=bool), size == 0
        self.tokens, self.targets = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.counts = {e: np.zeros(n, np.int64) for e in self.encoders}  # items per sequence
        self.rows = {e: np.zeros((n, 1), np.int64) for e in self.encoders}  # their rows, padded to the most items
        self.tower: dict[str, np.ndarray] | None = None  # their tower rows as `rows`, once any differ (anyres tiles)
        # per sequence, what the step's totals read (`columns`), side by side so one gather takes them all; built at
        # the first `columns` after a `put` (only a rank that plans cells reads them: 72 bytes a sequence)
        self.numbers: np.ndarray | None = None
        self.field_set, self.fields = np.zeros(n, np.int64), {}  # field set → its code

    def put(self, items: np.ndarray, shapes: ShapeArrays) -> None:
        """Items `items`' shapes, `sequences` of them per item in item order, into the table."""
        items = np.asarray(items, dtype=np.int64)
        k = self.sequences
        if len(shapes) != len(items) * k:
            raise ValueError(f"{len(shapes)} shapes for {len(items)} items of {k} sequences each")
        seqs = (items[:, None] * k + np.arange(k)).reshape(-1)
        self.tokens[seqs], self.targets[seqs] = shapes.tokens, shapes.targets
        codes = np.array([self.fields.setdefault(f, len(self.fields)) for f in shapes.fields], np.int64)
        self.field_set[seqs] = codes[shapes.field_set] if len(codes) else 0
        if shapes.tower and self.tower is None:  # the first tower rows that differ: the rest so far are `rows`
            self.tower = {e: r.copy() for e, r in self.rows.items()}
        for e in self.encoders:
            counts = np.diff(shapes.offsets[e])
            self.counts[e][seqs] = counts
            self.rows[e] = _placed(self.rows[e], seqs, counts, shapes.offsets[e], shapes.rows[e])
            if self.tower is not None:
                self.tower[e] = _placed(self.tower[e], seqs, counts, shapes.offsets[e], shapes.tower_of(e))
        self.numbers = None
        self.known[items] = True
        self.complete = bool(self.known.all())  # every item measured (a world's start-up): no check per lookup

    def measured(self, items: list[int]) -> ShapeArrays:
        """Items `items` measured now, as arrays (one after another, their sequences side by side)."""
        return ShapeArrays.of([s for i in items for s in self.measure(i)], self.encoders)

    def shapes(self, indices: np.ndarray, measure: bool = True) -> tuple[ShapeArrays, np.ndarray]:
        """The sequences of items `indices` (a pair's two side by side) as arrays, and each one's item index."""
        indices, seqs = self._sequences(indices, measure)
        offsets, rows, tower = {}, {}, {}
        for e in self.encoders:
            counts = self.counts[e][seqs]
            offsets[e] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            table = self.rows[e][seqs]
            rows[e] = table[np.arange(table.shape[1]) < counts[:, None]]  # row-major: sample after sample
            if self.tower is not None:
                table = self.tower[e][seqs]
                tower[e] = table[np.arange(table.shape[1]) < counts[:, None]]
        fields = tuple(self.fields)
        return (ShapeArrays(self.tokens[seqs], self.targets[seqs], offsets, rows, fields, self.field_set[seqs],
                            tower=tower or None),
                seqs if self.sequences == 1 else np.repeat(indices, self.sequences))

    def columns(self, indices: np.ndarray) -> tuple[ShapeColumns, np.ndarray]:
        """`shapes` as the step's totals read them: numbers per sequence, no item rows (data/shape_columns.py)."""
        indices, seqs = self._sequences(indices)
        if self.numbers is None:
            self.numbers = self._numbers()
        return (ShapeColumns(np.take(self.numbers, seqs, axis=0), tuple(self.fields), tuple(self.encoders)),
                seqs if self.sequences == 1 else np.repeat(indices, self.sequences))

    def _numbers(self) -> np.ndarray:
        """`ShapeColumns.matrix` of every sequence, from the table's arrays (its rows padded with zeros)."""
        t = self.tokens
        columns = [t, t * t, self.targets, self.targets > 0, self.field_set]
        for e in self.encoders:
            columns += [self.rows[e].sum(axis=1), np.einsum("ij,ij->i", self.rows[e], self.rows[e])]
        return np.stack(columns, axis=1).astype(np.int64)

    def _sequences(self, indices: np.ndarray, measure: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Items `indices` (measured now where not yet known) and the table rows of their sequences."""
        indices = np.asarray(indices, dtype=np.int64)
        if measure and not self.complete and not self.known[indices].all():
            unknown = np.unique(indices[~self.known[indices]])
            self.put(unknown, self.measured(unknown.tolist()))
        k = self.sequences
        return indices, indices if k == 1 else (indices[:, None] * k + np.arange(k)).reshape(-1)

    def share(self, rank: int, world: int) -> tuple[np.ndarray, ShapeArrays]:
        """Every world-th item from `rank`, measured: this rank's part of the start-up's measuring."""
        items = np.arange(rank, self.size, world, dtype=np.int64)
        return items, self.measured(items.tolist())


def _placed(table: np.ndarray, seqs: np.ndarray, counts: np.ndarray, offsets: np.ndarray, values: np.ndarray
            ) -> np.ndarray:
    """`table` (a row per sequence, its items' values padded with zeros) with sequences `seqs`' items set to
    `values` (sample after sample, `offsets` into them), widened when a sequence has more items than it holds."""
    most = int(counts.max(initial=0))
    if most > table.shape[1]:  # more items to a sample than any before: widen
        wider = np.zeros((len(table), most), np.int64)
        wider[:, :table.shape[1]] = table
        table = wider
    table[seqs] = 0
    # each item's cell: its sample's row, its rank among that sample's items
    column = np.arange(len(values)) - np.repeat(offsets[:-1], counts)
    table[np.repeat(seqs, counts), column] = values
    return table


def known_table(size: int, sequences: int, encoders: Sequence[str], measure: Measure) -> ShapeTable:
    """A table of `size` items whose shapes every rank already holds (a user's lines, prescanned): filled now from
    `measure` on this rank alone, no collective."""
    table = ShapeTable(size, sequences, encoders, measure)
    for start in range(0, size, KNOWN_CHUNK):  # in chunks: no list of every line's shape objects at once
        items = np.arange(start, min(start + KNOWN_CHUNK, size), dtype=np.int64)
        table.put(items, table.measured(items.tolist()))
    return table


def measured_table(size: int, sequences: int, encoders: Sequence[str], measure: Measure) -> ShapeTable:
    """A table of `size` items, every item measured now when the world has several ranks (each rank its share,
    combined by `gathered`), else as steps ask."""
    table = ShapeTable(size, sequences, encoders, measure)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        parts = gathered(table.share(dist.get_rank(), world), world)
        table.put(np.concatenate([items for items, _ in parts]), ShapeArrays.joined([s for _, s in parts]))
    return table


def gathered(mine: tuple[np.ndarray, ShapeArrays], world: int) -> list[tuple[np.ndarray, ShapeArrays]]:
    """Every rank's part (one all_gather_object over a temporary gloo group of the world: the job's groups may be
    NCCL's)."""
    with host_world_group() as group:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        return everyone
