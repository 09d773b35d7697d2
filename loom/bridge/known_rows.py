"""Row counts of some of a module's replicas: what a rank knows of a step whose global batch is planned in cells
(train/plan_cells.py). A rank plans only the blocks its own replicas are in, so it knows the counts of those blocks'
replicas and no others; reading any other is a bug, and says so rather than reading a made-up 0.

A `KnownRows` reads as the full list of counts the bridges index (`rows[i]`, `rows[a:b]` inside a known run,
`len(rows)` = the module's dp), and `known_runs` says which replicas it holds; a plain list holds them all.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


class KnownRows(Sequence):
    """Counts of the replicas in `runs` (first replica → counts of it and the ones after), of `size` replicas."""

    def __init__(self, size: int, runs: dict[int, np.ndarray]) -> None:
        self.size, self.firsts, self.values = size, [], []
        for first in sorted(runs):  # adjacent runs as one, so a slice inside a block never straddles two
            if self.values and self.firsts[-1] + len(self.values[-1]) == first:
                self.values[-1] = np.concatenate([self.values[-1], runs[first]])
            else:
                self.firsts.append(first)
                self.values.append(runs[first])

    def __len__(self) -> int:
        return self.size

    def _run(self, i: int) -> int:
        j = bisect.bisect_right(self.firsts, i) - 1
        if j < 0 or i >= self.firsts[j] + len(self.values[j]):
            raise LookupError(f"replica {i}'s rows are not planned on this rank (it plans replicas "
                              f"{', '.join(f'{r.start}–{r.stop - 1}' for r in self.known_runs())} of {self.size})")
        return j

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.size)
            if step != 1:
                raise ValueError("KnownRows: only contiguous slices")
            if stop <= start:
                return []
            j = self._run(start)
            if self._run(stop - 1) != j:
                raise LookupError(f"replicas {start}–{stop - 1} span two runs of known rows")
            return self.values[j][start - self.firsts[j]:stop - self.firsts[j]].tolist()
        if not -self.size <= i < self.size:
            raise IndexError(f"replica {i} of {self.size}")
        i %= self.size
        j = self._run(i)
        return int(self.values[j][i - self.firsts[j]])

    def __iter__(self):
        raise TypeError("KnownRows holds some replicas' counts only: iterate over known_runs()")

    def known_runs(self) -> list[range]:
        return [range(f, f + len(v)) for f, v in zip(self.firsts, self.values)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KnownRows):
            return NotImplemented
        return (self.size == other.size and self.firsts == other.firsts
                and all(np.array_equal(a, b) for a, b in zip(self.values, other.values)))

    def __repr__(self) -> str:
        return f"KnownRows({self.size}, {dict(zip(self.firsts, (v.tolist() for v in self.values)))})"


def known_runs(rows: Sequence[int]) -> list[range]:
    """The replicas whose counts `rows` holds: every one of a plain list."""
    return rows.known_runs() if isinstance(rows, KnownRows) else [range(len(rows))]
