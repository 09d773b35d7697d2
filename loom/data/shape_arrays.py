"""Many samples' shapes (data/shapes.py) as numpy arrays: what planning a global batch reads, so its cost per
sample is a few array operations, not Python objects (issue 50: 16,384 samples a step at 8,192 ranks).

Position p's tokens and targets are `tokens[p]`, `targets[p]`; its items for encoder e have the rows
`rows[e][offsets[e][p]:offsets[e][p + 1]]` (placeholder order) and the tower rows `tower[e][...]` at the same
places where those differ (anyres tiles; SampleShape.tower); its token fields are `fields[field_set[p]]`.
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
    tower: dict[str, np.ndarray] | None = None  # encoder → every item's tower rows, as `rows` (None: the same)

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def of(shapes: Sequence[SampleShape], encoders: Sequence[str]) -> ShapeArrays:
        """`shapes` as arrays (a short list: held-out sets, RL's rollouts, a dataset measured when drawn)."""
        fields = tuple(dict.fromkeys(s.fields for s in shapes))
        code = {f: k for k, f in enumerate(fields)}
        offsets, rows, tower = {}, {}, {}
        for e in encoders:
            per = [s.item_rows(e) for s in shapes]
            offsets[e] = np.concatenate([[0], np.cumsum([len(r) for r in per], dtype=np.int64)]).astype(np.int64)
            rows[e] = np.fromiter((r for rs in per for r in rs), dtype=np.int64, count=int(offsets[e][-1]))
            if any(s.tower for s in shapes):
                tower[e] = np.fromiter((r for s in shapes for r in s.tower_rows(e)), np.int64, int(offsets[e][-1]))
        where = tuple(s.where for s in shapes)
        return ShapeArrays(np.fromiter((s.tokens for s in shapes), np.int64, len(shapes)),
                           np.fromiter((s.targets for s in shapes), np.int64, len(shapes)), offsets, rows, fields,
                           np.fromiter((code[s.fields] for s in shapes), np.int64, len(shapes)),
                           where if any(where) else None, tower or None)

    @staticmethod
    def joined(parts: Sequence[ShapeArrays]) -> ShapeArrays:
        """The parts' samples one after another (their field sets merged)."""
        fields = tuple(dict.fromkeys(f for p in parts for f in p.fields))
        code = {f: k for k, f in enumerate(fields)}
        encoders = parts[0].offsets.keys() if parts else ()
        offsets, rows, tower = {}, {}, {}
        for e in encoders:
            counts = np.concatenate([np.diff(p.offsets[e]) for p in parts])
            offsets[e] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            rows[e] = np.concatenate([p.rows[e] for p in parts]).astype(np.int64)
            if any(p.tower for p in parts):
                tower[e] = np.concatenate([p.tower_of(e) for p in parts]).astype(np.int64)
        sets = [np.array([code[f] for f in p.fields], np.int64)[p.field_set] if len(p) else np.zeros(0, np.int64)
                for p in parts]
        where = None
        if any(p.where for p in parts):
            where = tuple(w for p in parts for w in (p.where or ("",) * len(p)))
        return ShapeArrays(np.concatenate([p.tokens for p in parts]).astype(np.int64),
                           np.concatenate([p.targets for p in parts]).astype(np.int64), offsets, rows, fields,
                           np.concatenate(sets).astype(np.int64), where, tower or None)

    def take(self, positions: np.ndarray) -> ShapeArrays:
        """The samples at `positions`, in that order."""
        positions = np.asarray(positions, dtype=np.int64)
        offsets, rows, tower = {}, {}, {}
        for e, off in self.offsets.items():
            starts, counts = off[positions], off[positions + 1] - off[positions]
            offsets[e] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            # each item's place in the source: its sample's start, then its rank among that sample's items
            source = np.repeat(starts - offsets[e][:-1], counts) + np.arange(offsets[e][-1])
            rows[e] = self.rows[e][source]
            if self.tower:
                tower[e] = self.tower_of(e)[source]
        where = tuple(self.where[p] for p in positions.tolist()) if self.where else None
        return ShapeArrays(self.tokens[positions], self.targets[positions], offsets, rows, self.fields,
                           self.field_set[positions], where, tower or None)

    def row_sums(self, encoder: str) -> np.ndarray:
        """Each sample's rows for `encoder`, its items together (int64 [n]): what the bridges carry."""
        return self._sums(self.rows[encoder], encoder)

    def tower_sums(self, encoder: str) -> np.ndarray:
        """Each sample's rows through `encoder`'s tower (int64 [n]): what balancing its replicas weighs."""
        return self._sums(self.tower_of(encoder), encoder)

    def tower_of(self, encoder: str) -> np.ndarray:
        return self.tower[encoder] if self.tower else self.rows[encoder]

    def _sums(self, item_rows: np.ndarray, encoder: str) -> np.ndarray:
        sums = np.concatenate([[0], np.cumsum(item_rows)])
        return sums[self.offsets[encoder][1:]] - sums[self.offsets[encoder][:-1]]

    def item_rows(self, p: int, encoder: str) -> tuple[int, ...]:
        off = self.offsets[encoder]
        return tuple(self.rows[encoder][off[p]:off[p + 1]].tolist())

    def shape(self, p: int) -> SampleShape:
        """Sample p's shape as one object (the check of a rendered sample, error messages)."""
        rows = {e: r for e in self.offsets if (r := self.item_rows(p, e))}
        off = self.offsets
        tower = {e: t for e in rows if (t := tuple(self.tower_of(e)[off[e][p]:off[e][p + 1]].tolist())) != rows[e]}
        return SampleShape(int(self.tokens[p]), int(self.targets[p]), rows, self.fields[self.field_set[p]],
                           self.where[p] if self.where else "", tower)

    def batch_fields(self) -> set[str]:
        """The token fields of a global batch: every sample must carry the same ones (data/batch.py field_names)."""
        names = {self.fields[k] for k in np.unique(self.field_set).tolist()}
        if len(names) > 1:
            raise ValueError(f"samples of one batch carry different token fields: {sorted(map(sorted, names))}")
        return set(next(iter(names), ()))
