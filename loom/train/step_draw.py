"""Global batch s as a rank plans it: the shapes of its planning cells' samples (train/plan_cells.py; nothing
rendered) and the totals of the whole batch (train/step_totals.py).

From a dataset's shape table (data/shape_table.py: the built-in tasks', or a user's filled from the prescan's
shapes) a rank looks up only its cells' items, and the whole batch's totals as one number per sequence: both in
numpy, no Python per sample of the rest of the batch. A dataset without a table (a benchmark's synthetic steps)
measures the whole batch's shapes per step — an item found bad there must be found by every rank alike — and its
cells are cut from them. A user's line is never found bad when drawn (the prescan's problems are out of the
mixture); one found bad when rendered is dropped on every rank alike (train/step_data.py `agreed`), and dropped
items are left out of either draw. The rules that leave samples out are the same either way: dropped items and
items found bad are gone from their cell, and a too-long item (data.too_long = "skip") is skipped by its own length,
so every rank counts the same skips, and the one-process reference, drawing the whole batch as one cell, trains on
the same samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loom.config import JobConfig
from loom.data.conversations import BadSample
from loom.data.format import TokenCounter
from loom.data.loader import GlobalBatches
from loom.data.sample import Sample, SamplePair
from loom.data.shape_arrays import ShapeArrays
from loom.data.shape_columns import ShapeColumns
from loom.data.shape_table import ShapeTable
from loom.train.cell_batch import CellBatch
from loom.train.plan_cells import Cells
from loom.train.step_parts import fitting_arrays, fitting_mask
from loom.train.step_totals import step_totals


@dataclass
class Drawn:
    """Global batch s as a rank plans it: its planning cells' samples and the whole batch's totals (`batch`), and
    the items found bad when measured (dataset index → why; the same on every rank, left out)."""

    batch: CellBatch
    bad: dict[int, str]

    @property
    def shapes(self) -> ShapeArrays:
        return self.batch.shapes

    @property
    def indices(self) -> np.ndarray:  # a DPO pair's two sequences side by side, both with its index
        return self.batch.indices

    def sequence(self, p: int) -> int:
        """Which sequence of its item position p is (a DPO pair's rejected answer: 1)."""
        k = 0
        while p - k > 0 and self.indices[p - k - 1] == self.indices[p]:
            k += 1
        return k


def draw(batches: GlobalBatches[Sample | SamplePair], step: int, cfg: JobConfig, counters: dict[str, TokenCounter],
         multiple: int, shares: dict[str, tuple] | None = None) -> Drawn:
    """The samples this rank plans of global batch `step` (`shares`: its replicas, train/inputs.py `Share`; None:
    the whole batch, as the one-process reference takes it) as shapes, a DPO pair as its two sequences side by side
    (both with its index): looked up in arrays, planned over arrays (train/cell_placement.py)."""
    cells = Cells.of(cfg.data.balance_replicas, shares["language"][1]) if shares else Cells(1, 1)
    windows = cells.windows(shares) if shares else [range(1)]
    table = getattr(batches.dataset, "table", None)
    if not cells.single and table is not None:
        return Drawn(_from_table(batches, table, step, cfg, multiple, cells, windows), {})
    shapes, indices, bad = batches.sequence_shapes(step, counters)
    if not len(shapes):
        raise BadSample(f"step {step + 1}: every sample of the global batch is bad; nothing is left to train on")
    keep = fitting_mask(shapes.tokens, indices, cfg, multiple, lambda a, b: [shapes.shape(p) for p in range(a, b)],
                        named(batches))
    totals = step_totals(ShapeColumns.of(shapes), keep)
    if keep is not None:
        kept = np.flatnonzero(keep)
        shapes, indices = shapes.take(kept), indices[kept]
    if cells.single:
        return Drawn(CellBatch.whole(shapes, indices, 0, None, cells, windows, totals), bad)
    drawn = np.asarray(batches.indices(step), dtype=np.int64)
    order = np.argsort(drawn)  # each sample's item among those drawn (the samples keep the drawn order)
    item_of = order[np.searchsorted(drawn[order], indices)]
    return Drawn(CellBatch.whole(shapes, indices, len(drawn), item_of, cells, windows, totals), bad)


def _from_table(batches: GlobalBatches, table: ShapeTable, step: int, cfg: JobConfig, multiple: int, cells: Cells,
                windows: list[range]) -> CellBatch:
    """The cells' samples looked up in the dataset's shape table, and the whole batch's totals from its columns."""
    drawn = batches.index_array(step)
    dropped = np.fromiter(batches.dropped, np.int64, len(batches.dropped))

    def present(items: np.ndarray) -> np.ndarray:
        return items[~np.isin(items, dropped)] if len(dropped) else items

    everything = present(drawn)
    if not len(everything):
        raise BadSample(f"step {step + 1}: every sample of the global batch is bad; nothing is left to train on")
    columns, sequence_items = table.columns(everything)

    def group(a: int, b: int) -> list:  # an item's shapes, for the message of one that does not fit
        shapes, _ = table.shapes(sequence_items[a:a + 1])
        return [shapes.shape(p) for p in range(b - a)]

    totals = step_totals(columns, fitting_mask(columns.tokens, sequence_items, cfg, multiple, group, named(batches)))
    parts = []
    for c in cells.cells_of(windows):
        r = cells.items(c, len(drawn))
        shapes, indices = table.shapes(present(drawn[r.start:r.stop]))
        shapes, indices, _ = fitting_arrays(shapes, indices, cfg, multiple, named(batches))
        parts.append((shapes, indices))
    return CellBatch.joined(parts, cells, windows, totals)


def named(batches: GlobalBatches) -> Callable[[int], str]:
    """Dataset index → how messages name it: its file:line (a user's data), else its index."""
    return getattr(batches.dataset, "where", lambda i: f"sample {i} of the dataset")
