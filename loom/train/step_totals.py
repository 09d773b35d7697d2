"""What every rank must know of the whole global batch, whichever cells of it it plans (train/plan_cells.py): the
losses' normalisers (target tokens, sequences with a target), the real tokens and the FLOP count's sums, how many
sequences were left out as too long, and the token fields every microbatch carries. Sums over one number per
sequence (data/shape_columns.py) in numpy: microseconds per thousand samples, where placing them costs a Python
step each — so a rank adds up the whole batch and places only its cells.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loom.data.shape_columns import (FIELD_SET, HAS_TARGETS, TARGETS, TOKEN_SQUARES, TOKENS,
                                     ShapeColumns)


@dataclass(frozen=True)
class StepTotals:
    supervised: int  # target tokens: a token-normalised loss divides by them
    sequences: int  # sequences with a target: a sequence-normalised loss divides by them
    tokens: int  # real LLM tokens
    token_squares: int  # the sum of each sequence's tokens squared (the FLOP count's attention term)
    rows: dict[str, tuple[int, int]]  # encoder → its items' rows, and their squares, summed (FLOPs too)
    skipped: int  # sequences left out as too long (data.too_long = "skip")
    fields: frozenset[str]  # the token fields every sample carries (a microbatch without samples: as zeros)


def step_totals(columns: ShapeColumns, keep: np.ndarray | None = None) -> StepTotals:
    """The totals of the sequences `keep` marks (None: all) of `columns`: one reduction of its matrix."""
    m = columns.matrix
    if keep is None:
        sums, skipped = np.einsum("ij->j", m), 0
    else:
        sums, skipped = np.einsum("i,ij->j", keep.astype(np.int64), m), len(m) - int(np.count_nonzero(keep))
    at = FIELD_SET + 1
    rows = {e: (int(sums[at + 2 * i]), int(sums[at + 2 * i + 1])) for i, e in enumerate(columns.encoders)}
    return StepTotals(int(sums[TARGETS]), int(sums[HAS_TARGETS]), int(sums[TOKENS]), int(sums[TOKEN_SQUARES]), rows,
                      skipped, batch_fields(columns, keep))


def batch_fields(columns: ShapeColumns, keep: np.ndarray | None = None) -> frozenset[str]:
    """The token fields of a global batch: every sample must carry the same ones (data/batch.py field_names)."""
    codes = columns.matrix[:, FIELD_SET] if keep is None else columns.matrix[keep, FIELD_SET]
    if not len(codes):
        return frozenset()
    if len(columns.fields) == 1:  # one field set in all the data (a shape table's usual case): nothing to compare
        return columns.fields[0]
    names = {columns.fields[k] for k in np.flatnonzero(np.bincount(codes)).tolist()}
    if len(names) > 1:
        raise ValueError(f"samples of one batch carry different token fields: {sorted(map(sorted, names))}")
    return next(iter(names))
