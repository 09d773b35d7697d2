"""Many samples' shapes (data/shapes.py) as numpy arrays: what planning a global batch reads, so its cost per
sample is a few array operations, not Python objects (issue 50: 16,384 samples a step at 8,192 ranks).

Position p's tokens and targets are `tokens[p]`, `targets[p]`; its items for encoder e have the rows
`rows[e][offsets[e][p]:offsets[e][p + 1]]` (placeholder order); its token fields are `fields[field_set[p]]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loom.data.shapes import SampleShape


@dataclass(frozen=True)
class ShapeArrays:
    tokens: np.ndarray  # int64 [n]: len(sample)
    targets: np.ndarray  # int64 [n]: supervised tokens
    offsets: dict[str, np.ndarray]  # encoder → int64 [n + 1]: where each sample's items start in rows[encoder]
    rows: dict[str, np.ndarray]  # encoder → int64: every item's rows, sample after sample
    fields: tuple[frozenset[str], ...]  # the distinct token-field sets
    field_set: np.ndarray  # int64 [n]: each sample's index into `fields`
    where: tuple[str, ...] | None = None  # file:line per sample, when measured from samples that say it

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def of(shapes: Sequence[SampleShape], encoders: Sequence[str]) -> ShapeArrays:
        """`shapes` as arrays (a short list: held-out sets, RL's rollouts, a dataset measured when drawn)."""
        fields = tuple(dict.fromkeys(s.fields for s in shapes))
        code = {f: k for k, f in enumerate(fields)}
        offsets, rows = {}, {}
        for e in encoders:
            per = [s.item_rows(e) for s in shapes]
            offsets[e] = np.concatenate([[0], np.cumsum([len(r) for r in per], dtype=np.int64)]).astype(np.int64)
            rows[e] = np.fromiter((r for rs in per for r in rs), dtype=np.int64, count=int(offsets[e][-1]))
        where = tuple(s.where for s in shapes)
        return ShapeArrays(np.fromiter((s.tokens for s in shapes), np.int64, len(shapes)),
                           np.fromiter((s.targets for s in shapes), np.int64, len(shapes)), offsets, rows, fields,
                           np.fromiter((code[s.fields] for s in shapes), np.int64, len(shapes)),
                           where if any(where) else None)

    @staticmethod
    def joined(parts: Sequence[ShapeArrays]) -> ShapeArrays:
        """The parts' samples one after another (their field sets merged)."""
        fields = tuple(dict.fromkeys(f for p in parts for f in p.fields))
        code = {f: k for k, f in enumerate(fields)}
        encoders = parts[0].offsets.keys() if parts else ()
        offsets, rows = {}, {}
        for e in encoders:
            counts = np.concatenate([np.diff(p.offsets[e]) for p in parts])
            offsets[e] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            rows[e] = np.concatenate([p.rows[e] for p in parts]).astype(np.int64)
        sets = [np.array([code[f] for f in p.fields], np.int64)[p.field_set] if len(p) else np.zeros(0, np.int64)
                for p in parts]
        where = None
        if any(p.where for p in parts):
            where = tuple(w for p in parts for w in (p.where or ("",) * len(p)))
        return ShapeArrays(np.concatenate([p.tokens for p in parts]).astype(np.int64),
                           np.concatenate([p.targets for p in parts]).astype(np.int64), offsets, rows, fields,
                           np.concatenate(sets).astype(np.int64), where)

    def take(self, positions: np.ndarray) -> ShapeArrays:
        """The samples at `positions`, in that order."""
        positions = np.asarray(positions, dtype=np.int64)
        offsets, rows = {}, {}
        for e, off in self.offsets.items():
            starts, counts = off[positions], off[positions + 1] - off[positions]
            offsets[e] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            # each item's place in the source: its sample's start, then its rank among that sample's items
            rows[e] = self.rows[e][np.repeat(starts - offsets[e][:-1], counts) + np.arange(offsets[e][-1])]
        where = tuple(self.where[p] for p in positions.tolist()) if self.where else None
        return ShapeArrays(self.tokens[positions], self.targets[positions], offsets, rows, self.fields,
                           self.field_set[positions], where)

    def row_sums(self, encoder: str) -> np.ndarray:
        """Each sample's rows for `encoder`, its items together (int64 [n])."""
        sums = np.concatenate([[0], np.cumsum(self.rows[encoder])])
        return sums[self.offsets[encoder][1:]] - sums[self.offsets[encoder][:-1]]

    def item_rows(self, p: int, encoder: str) -> tuple[int, ...]:
        off = self.offsets[encoder]
        return tuple(self.rows[encoder][off[p]:off[p + 1]].tolist())

    def shape(self, p: int) -> SampleShape:
        """Sample p's shape as one object (the check of a rendered sample, error messages)."""
        rows = {e: r for e in self.offsets if (r := self.item_rows(p, e))}
        return SampleShape(int(self.tokens[p]), int(self.targets[p]), rows, self.fields[self.field_set[p]],
                           self.where[p] if self.where else "")

    def batch_fields(self) -> set[str]:
        """The token fields of a global batch: every sample must carry the same ones (data/batch.py field_names)."""
        names = {self.fields[k] for k in np.unique(self.field_set).tolist()}
        if len(names) > 1:
            raise ValueError(f"samples of one batch carry different token fields: {sorted(map(sorted, names))}")
        return set(next(iter(names), ()))
