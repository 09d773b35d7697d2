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
    cells, windows = batch.cells, batch.windows
    per_cell = [_cell_parts(batch, j, tokens, work, microbatches, budget) for j in range(len(batch.planned))]
    mine = shares["language"][0]
    stats = per_cell[batch.planned.index(cells.cell_of(mine)) if mine is not None else 0]
    # every microbatch's windows side by side, piece k·W + j: microbatch k's window j, one virtual LLM replica per
    # replica of it — so each encoder's split and each count is one array program for the whole step
    llm = _stacked([_window(per_cell, batch, w, k) for k in range(microbatches) for w in windows])
    first = np.cumsum([0] + [len(w) for w in windows] * microbatches)  # each piece's first virtual replica
    at = next((j for j, w in enumerate(windows) if mine in w), None) if mine is not None else -1
    if at is None:
        raise AssertionError(f"LLM replica {mine} lies in none of this rank's windows {windows}")
    sides = {name: _encoder_side(llm, first, windows, work[name], cells.dp, shares[name][1]) for name in rows}
    # each encoder's rows summed along the stacked order: any run's rows are a difference of two of these
    cums = {name: np.concatenate([[0], np.cumsum(rows[name][llm.order])]).astype(np.int64) for name in rows}
    plans = []
    for k in range(microbatches):
        encoders, counts = {}, {}
        for name, (enc, enc_first) in sides.items():
            cum = cums[name]
            pieces = range(k * len(windows), (k + 1) * len(windows))
            enc_sums = [_sums(cum, enc[p]) for p in pieces]
            llm_sums = [_sums(cum, llm.bounds[first[p]:first[p + 1] + 1]) for p in pieces]
            replica, dp = shares[name][0], shares[name][1]
            if replica is not None:
                j = next((j for j, e in enumerate(enc_first) if e <= replica < e + len(enc_sums[j])), None)
                if j is None:
                    raise AssertionError(f"{name} replica {replica} is in none of this rank's windows {windows}")
                b = enc[k * len(windows) + j][replica - enc_first[j]:]
                encoders[name] = llm.order[b[0]:b[1]].tolist()
            if cells.single:  # every replica's counts, as lists (the bridges of old read them so)
                counts[name] = ReplicaRows(enc_sums[0].tolist(), llm_sums[0].tolist())
            else:
                counts[name] = ReplicaRows(KnownRows(dp, {e: v for e, v in zip(enc_first, enc_sums) if len(v)}),
                                           KnownRows(cells.dp, {w.start: v for w, v in zip(windows, llm_sums)}))
        own = [] if mine is None else llm.run(int(first[k * len(windows) + at]) + mine - windows[at].start)
        plans.append(MicrobatchPlan(own, encoders, counts))
    return plans, stats


def _stacked(pieces: list[Parts]) -> Parts:
    """The pieces' runs one after another, as one Parts."""
    if len(pieces) == 1:
        return pieces[0]
    orders = [p.order[p.bounds[0]:p.bounds[-1]] for p in pieces]
    sizes = np.cumsum([0] + [len(o) for o in orders])
    bounds = [np.zeros(1, np.int64)] + [p.bounds[1:] - p.bounds[0] + s for p, s in zip(pieces, sizes)]
    return Parts(np.concatenate(orders).astype(np.int64), np.concatenate(bounds).astype(np.int64))


def _encoder_side(llm: Parts, first: np.ndarray, windows: tuple[range, ...], work: np.ndarray, llm_dp: int,
                  enc_dp: int) -> tuple[list[np.ndarray], list[int]]:
    """An encoder's runs over the stacked windows: per piece, the bounds (into `llm.order`) of the runs of the
    encoder replicas whose samples lie wholly in its window, and per window the first such replica's index."""
    if enc_dp >= llm_dp:  # fan-in / equal: k per LLM replica, each replica's samples cut alone (so all at once)
        k = enc_dp // llm_dp
        bounds = split_encoder_parts(llm, work, len(llm) * k).bounds
        pieces = [bounds[first[p] * k:first[p + 1] * k + 1] for p in range(len(first) - 1)]
        return pieces, [w.start * k for w in windows]
    k = llm_dp // enc_dp  # fan-out: the whole blocks of k LLM replicas in each window
    whole = [(-(-w.start // k), w.stop // k) for w in windows]
    out = []
    for p in range(len(first) - 1):
        (e0, e1), a = whole[p % len(windows)], windows[p % len(windows)].start
        b = llm.bounds[first[p]:first[p + 1] + 1]
        out.append(b[e0 * k - a:e1 * k - a + 1:k] if e1 > e0 else b[:0])
    return out, [e0 for e0, _ in whole]


def _sums(cum: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Each run's total, from the running total `cum` of the values along the order (runs: between `bounds`)."""
    return cum[bounds[1:]] - cum[bounds[:-1]]


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
                                budget, batch.indices[a:b], f"cell {c}'s {b - a}")
    except DoesNotFit as e:
        raise type(e)(f"planning cell {c} of {len(cells)} (LLM replicas {replicas.start}–{replicas.stop - 1}: "
                      f"data.balance_replicas = {cells.size} pack their samples alone; raise it, or 0 to pack the "
                      f"whole batch at once): {e}") from e
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
