"""Where the samples of a rank's planning cells go (train/plan_cells.py): each cell placed over its LLM replicas as
a global batch of its own (train/step_parts.py `split_llm_parts`: the balancing packer, or equal shares), then, for
this rank's blocks alone (`CellBatch.windows`), each microbatch's LLM and encoder runs and the row counts the
bridges read. With one cell that is the whole batch's placement and every replica's counts, as lists, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loom.bridge.known_rows import KnownRows
from loom.bridge.replica_rows import ReplicaRows
from loom.data.bins import DoesNotFit
from loom.train.cell_batch import CellBatch
from loom.train.step_parts import Parts, split_encoder_parts, split_llm_parts


@dataclass(frozen=True)
class MicrobatchPlan:
    llm: list[int]  # this rank's LLM replica's positions ([] where it hosts no LLM)
    encoders: dict[str, list[int]]  # encoder → this rank's replica's positions (only the encoders it hosts)
    counts: dict[str, ReplicaRows]  # encoder → the rows per replica on both sides of its bridge


def place(batch: CellBatch, tokens: np.ndarray, work: dict[str, np.ndarray], rows: dict[str, np.ndarray],
          shares: dict[str, tuple], microbatches: int, budget: int) -> tuple[list[MicrobatchPlan], list[Parts]]:
    """Per microbatch, this rank's runs and its bridges' counts (`tokens`: rounded to the sample multiple; `work`:
    the rows balancing weighs, `rows`: the rows the bridges carry); and the placement of its LLM replica's cell
    (every replica of it, per microbatch: the step's bin statistics read it)."""
    cells = batch.cells
    per_cell = [_cell_parts(batch, j, tokens, work, microbatches, budget) for j in range(len(batch.planned))]
    mine = shares["language"][0]
    stats = per_cell[batch.planned.index(cells.cell_of(mine)) if mine is not None else 0]
    plans = []
    for k in range(microbatches):
        windows = [(w.start, _window(per_cell, batch, w, k)) for w in batch.windows]
        llm = next((parts.run(mine - a) for a, parts in windows if a <= mine < a + len(parts)), None) \
            if mine is not None else []
        encoders, counts = {}, {}
        for name in rows:
            replica, dp = shares[name][0], shares[name][1]
            held = [(*_encoder_window(parts, a, work[name], cells.dp, dp), a, parts) for a, parts in windows]
            if replica is not None:
                run = next((enc.run(replica - e) for e, enc, _, _ in held if e <= replica < e + len(enc)), None)
                if run is None:
                    raise AssertionError(f"{name} replica {replica} is in none of this rank's windows {batch.windows}")
                encoders[name] = run
            if cells.single:  # every replica's counts, as lists (the bridges of old read them so)
                (_, enc, _, parts), = held
                counts[name] = ReplicaRows(enc.sums(rows[name]), parts.sums(rows[name]))
            else:
                encoder_side = {e: enc.totals(rows[name]) for e, enc, _, _ in held if len(enc)}
                counts[name] = ReplicaRows(KnownRows(dp, encoder_side),
                                           KnownRows(cells.dp, {a: p.totals(rows[name]) for _, _, a, p in held}))
        if llm is None:
            raise AssertionError(f"LLM replica {mine} lies in none of this rank's windows {batch.windows}")
        plans.append(MicrobatchPlan(llm, encoders, counts))
    return plans, stats


def _cell_parts(batch: CellBatch, j: int, tokens: np.ndarray, work: dict[str, np.ndarray], microbatches: int,
                budget: int) -> list[Parts]:
    """Planned cell j placed over its LLM replicas: per microbatch, their runs (positions of `batch`)."""
    cells, c = batch.cells, batch.planned[j]
    a, b = int(batch.bounds[j]), int(batch.bounds[j + 1])
    if cells.single:
        return split_llm_parts(tokens, work, cells.dp, microbatches, budget, batch.indices)
    replicas = cells.replicas(c)
    try:
        parts = split_llm_parts(tokens[a:b], {n: w[a:b] for n, w in work.items()}, len(replicas), microbatches,
                                budget, batch.indices[a:b], f"planning cell {c}'s {b - a}")
    except DoesNotFit as e:
        raise type(e)(f"planning cell {c} of {len(cells)} (LLM replicas {replicas.start}–{replicas.stop - 1}; "
                      f"data.balance_replicas = {cells.size} replicas pack their samples together, or 0 for the "
                      f"whole batch): {e}") from e
    return [Parts(p.order + a, p.bounds) for p in parts]


def _window(per_cell: list[list[Parts]], batch: CellBatch, w: range, k: int) -> Parts:
    """Microbatch k's runs of the LLM replicas in `w`, taken from their cells' placements."""
    cells = batch.cells
    orders, bounds, at = [], [np.zeros(1, np.int64)], 0
    for c in range(cells.cell_of(w.start), cells.cell_of(w.stop - 1) + 1):
        parts, r = per_cell[batch.planned.index(c)][k], cells.replicas(c)
        lo, hi = max(w.start, r.start) - r.start, min(w.stop, r.stop) - r.start
        if lo == 0 and hi == len(r) and len(w) == len(r):  # the window is the cell
            return parts
        first, last = int(parts.bounds[lo]), int(parts.bounds[hi])
        if len(w) == hi - lo:  # inside one cell: a slice of its runs
            return Parts(parts.order[first:last], parts.bounds[lo:hi + 1] - first)
        orders.append(parts.order[first:last])
        bounds.append(parts.bounds[lo + 1:hi + 1] - first + at)
        at += last - first
    return Parts(np.concatenate(orders).astype(np.int64), np.concatenate(bounds).astype(np.int64))


def _encoder_window(llm: Parts, first: int, work: np.ndarray, llm_dp: int, enc_dp: int) -> tuple[int, Parts]:
    """The encoder replicas whose samples lie wholly in LLM replicas `first` … `first + len(llm) − 1` (their runs
    `llm`): the first one's index and their runs."""
    if enc_dp >= llm_dp:  # fan-in / equal: k of them per LLM replica
        k = enc_dp // llm_dp
        return first * k, split_encoder_parts(llm, work, len(llm) * k)
    k = llm_dp // enc_dp  # fan-out: the whole blocks of k LLM replicas in the window
    e0, e1 = -(-first // k), (first + len(llm)) // k
    if e1 <= e0:
        return e0, Parts(llm.order, llm.bounds[:1])
    return e0, Parts(llm.order, llm.bounds[e0 * k - first:e1 * k - first + 1:k])
