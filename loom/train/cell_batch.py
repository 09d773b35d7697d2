"""The samples a rank plans a step from: those of its planning cells (train/plan_cells.py), cell after cell, beside
the totals of the whole global batch (train/step_totals.py). With one cell, the whole batch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from loom.data.shape_arrays import ShapeArrays
from loom.train.plan_cells import Cells
from loom.train.step_parts import item_starts
from loom.train.step_totals import StepTotals


@dataclass(frozen=True)
class CellBatch:
    shapes: ShapeArrays  # the planned cells' samples (left out: bad and too long ones), cell after cell
    indices: np.ndarray  # their dataset indices (a DPO pair's two sequences side by side, both with its index)
    cells: Cells
    planned: tuple[int, ...]  # the cells, ascending
    bounds: np.ndarray  # planned cell j's samples are positions bounds[j] … bounds[j + 1] − 1
    windows: tuple[range, ...]  # the LLM replicas of this rank's blocks
    totals: StepTotals  # the whole global batch's
    taken: np.ndarray | None = None  # cut out of a batch given whole: each sample's position there

    @staticmethod
    def joined(parts: list[tuple[ShapeArrays, np.ndarray]], cells: Cells, windows: list[range],
               totals: StepTotals) -> CellBatch:
        """The cells `cells.cells_of(windows)`, each given as its samples' (shapes, indices)."""
        planned = cells.cells_of(windows)
        if len(parts) != len(planned):
            raise ValueError(f"{len(parts)} parts for the {len(planned)} cells {planned}")
        shapes = parts[0][0] if len(parts) == 1 else ShapeArrays.joined([s for s, _ in parts])
        indices = parts[0][1] if len(parts) == 1 else np.concatenate([i for _, i in parts]).astype(np.int64)
        bounds = np.concatenate([[0], np.cumsum([len(s) for s, _ in parts])]).astype(np.int64)
        return CellBatch(shapes, indices, cells, tuple(planned), bounds, tuple(windows), totals)

    @staticmethod
    def whole(shapes: ShapeArrays, indices: np.ndarray, items: int, item_of: np.ndarray | None, cells: Cells,
              windows: list[range], totals: StepTotals) -> CellBatch:
        """A global batch whose every sample is at hand (held-out sets, RL's rollouts, a dataset without a shape
        table): its planned cells cut out of it. `items`: the batch's items as drawn; `item_of`: each sample's item
        among them (None: every item is here, a DPO pair's two sequences side by side)."""
        if cells.single:
            return CellBatch(shapes, indices, cells, (0,), np.array([0, len(shapes)], np.int64), tuple(windows),
                             totals)
        # item_of ascends (samples keep their drawn order): each cell's samples are one run of positions
        if item_of is None:
            starts = item_starts(indices)
            item_of = np.repeat(np.arange(len(starts), dtype=np.int64),
                                np.diff(np.concatenate([starts, [len(indices)]])))
        taken = []
        for c in cells.cells_of(windows):
            r = cells.items(c, items)
            a, b = np.searchsorted(item_of, [r.start, r.stop])
            taken.append(np.arange(a, b, dtype=np.int64))
        joined = CellBatch.joined([(shapes.take(t), indices[t]) for t in taken], cells, windows, totals)
        return dataclasses.replace(joined, taken=np.concatenate(taken))
