"""Which positions of a global batch each LLM replica and encoder replica takes, in numpy over the samples' lengths
(data/shape_arrays.py): the same placement the greedy packer and the equal shares always gave, at a few array
operations a sample, so a rank's step planning does not grow with the global batch's Python loops (issue 50).

The rules (train/inputs.py's docstring): the items of the global batch are placed — a DPO pair's two sequences
together, so they share a replica and a microbatch; with a token budget the balancing packer (data/bins.py) fills
dp × M bins (bin r·M + k: replica r's microbatch k), else each (replica, microbatch) takes an equal contiguous
share of the items. Each encoder replica then takes its part of every microbatch: fan-out, k consecutive LLM
replicas; fan-in, k contiguous runs of one LLM replica's samples, cut where their rows' midpoints fall.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loom.config import JobConfig
from loom.data.bins import BinStats, bin_of_each, stats_of_loads
from loom.data.shape_arrays import ShapeArrays
from loom.data.shapes import SampleShape
from loom.train.length_rules import fitting, limit


@dataclass(frozen=True)
class Parts:
    """Runs of positions: run j is order[bounds[j]:bounds[j + 1]], ascending."""

    order: np.ndarray  # int64: the positions, run after run
    bounds: np.ndarray  # int64 [runs + 1]

    @staticmethod
    def of(runs: list[list[int]]) -> Parts:
        order = np.array([p for run in runs for p in run], dtype=np.int64)
        return Parts(order, np.concatenate([[0], np.cumsum([len(r) for r in runs])]).astype(np.int64))

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def run(self, j: int) -> list[int]:
        return self.order[self.bounds[j]:self.bounds[j + 1]].tolist()

    def sums(self, values: np.ndarray) -> list[int]:
        """Each run's total of `values` (one per position)."""
        return self.totals(values).tolist()

    def totals(self, values: np.ndarray) -> np.ndarray:
        totals = np.concatenate([[0], np.cumsum(values[self.order])])
        return totals[self.bounds[1:]] - totals[self.bounds[:-1]]

    def lists(self) -> list[list[int]]:
        return [self.run(j) for j in range(len(self))]


def ranges(starts: np.ndarray, lengths: np.ndarray) -> Parts:
    """Runs of consecutive positions: run j is starts[j], starts[j] + 1, … (lengths[j] of them)."""
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    order = np.repeat(starts - bounds[:-1], lengths) + np.arange(bounds[-1], dtype=np.int64)
    return Parts(order.astype(np.int64), bounds)


def item_starts(indices: np.ndarray) -> np.ndarray:
    """The first position of each item: a DPO pair's two sequences carry its index side by side."""
    if not len(indices):
        return np.zeros(0, np.int64)
    return np.flatnonzero(np.concatenate([[True], indices[1:] != indices[:-1]])).astype(np.int64)


def rounded(tokens: np.ndarray, multiple: int) -> np.ndarray:
    return -(-tokens // multiple) * multiple


def fitting_arrays(shapes: ShapeArrays, indices: np.ndarray, cfg: JobConfig, multiple: int,
                   named: Callable[[int], str] | None = None) -> tuple[ShapeArrays, np.ndarray, int]:
    """train/inputs.py `fitting` over arrays: the sequences that fit (all, under data.too_long = "error", or its
    BadSample for the first item that does not), their indices, and how many were dropped."""
    keep = fitting_mask(shapes.tokens, indices, cfg, multiple, lambda a, b: [shapes.shape(p) for p in range(a, b)],
                        named)
    if keep is None:
        return shapes, indices, 0
    kept = np.flatnonzero(keep)
    return shapes.take(kept), indices[kept], len(shapes) - len(kept)


def fitting_mask(tokens: np.ndarray, indices: np.ndarray, cfg: JobConfig, multiple: int,
                 group: Callable[[int, int], list[SampleShape]], named: Callable[[int], str] | None = None
                 ) -> np.ndarray | None:
    """`fitting_arrays` over the sequences' lengths alone: which sequences stay (None: all), or the BadSample for
    the first item that does not fit under data.too_long = "error" (`group(a, b)`: the shapes of positions a … b − 1,
    which its message reads)."""
    _, budget = limit(cfg)
    if not budget or not len(tokens):
        return None
    starts = item_starts(indices)
    padded = rounded(tokens, multiple)
    together = cfg.data.format == "thd"  # packed: a pair's two sequences share T; padded: each its own row
    need = (np.add if together else np.maximum).reduceat(padded, starts)
    over = np.flatnonzero(need > budget)
    if cfg.data.too_long != "skip":
        if len(over):  # the list version words the error
            g = int(over[0])
            end = int(starts[g + 1]) if g + 1 < len(starts) else len(tokens)
            shapes = group(int(starts[g]), end)
            fitting(shapes, [int(indices[starts[g]])] * len(shapes), cfg, multiple, named)
        return None
    if not len(over):
        return None
    return np.repeat(need <= budget, np.diff(np.concatenate([starts, [len(tokens)]])))


def split_llm_parts(tokens: np.ndarray, rows: dict[str, np.ndarray], dp: int, microbatches: int, budget: int,
                    indices: np.ndarray, batch: str | None = None) -> list[Parts]:
    """Per microbatch, the LLM replicas' positions (`tokens` rounded to the sample multiple); `batch`: what the
    packer's errors call the samples (a planning cell's, train/plan_cells.py)."""
    m, n = microbatches, len(tokens)
    starts = item_starts(indices)
    sizes = np.diff(np.concatenate([starts, [n]])).astype(np.int64)
    if budget:
        item_tokens = np.add.reduceat(tokens, starts) if n else np.zeros(0, np.int64)
        item_rows = {e: (np.add.reduceat(r, starts) if n else np.zeros(0, np.int64)) for e, r in rows.items()}
        where = bin_of_each(item_tokens, item_rows, dp, m, budget, _Named(indices, starts), batch)
        # microbatch k holds replica r's bin r·M + k: the items ordered by (k, r), ascending inside a bin (a stable
        # sort keeps them so), then cut per microbatch, each cut per replica
        slot = (where % m) * dp + where // m
        items = np.argsort(slot, kind="stable")
        placed = ranges(starts[items], sizes[items])  # a run per item
        per_slot = np.concatenate([[0], np.cumsum(np.bincount(slot, minlength=m * dp))]).astype(np.int64)
        out = []
        for k in range(m):
            bounds = placed.bounds[per_slot[k * dp:(k + 1) * dp + 1]]
            out.append(Parts(placed.order[bounds[0]:bounds[-1]], bounds - bounds[0]))
        return out
    # equal contiguous shares of the items (validated: the global batch divides into dp · M); after skips, nearly
    n_shares, g = dp * m, len(starts)
    cut = np.arange(n_shares + 1, dtype=np.int64) * g // n_shares  # share j: items cut[j] … cut[j + 1] - 1
    first = np.concatenate([starts, [n]])[cut]  # share j's positions: first[j] … first[j + 1] - 1
    out = []
    for k in range(m):
        j = np.arange(dp, dtype=np.int64) * m + k  # replica r's share of microbatch k
        out.append(ranges(first[j], first[j + 1] - first[j]))
    return out


class _Named:
    """Item i's dataset index, looked up only when an error names it (the packer's `indices`): a list of the global
    batch's indices per step would cost what the packer saves."""

    def __init__(self, indices: np.ndarray, starts: np.ndarray) -> None:
        self.indices, self.starts = indices, starts

    def __getitem__(self, i: int) -> int:
        return int(self.indices[self.starts[i]])


def step_bin_stats(parts: list[Parts], tokens: np.ndarray, rows: dict[str, np.ndarray], capacity: int) -> BinStats:
    """data/bins.py `bin_stats` of the packed bins (`parts[k].run(r)`: replica r's microbatch k), each replica's
    totals summed in numpy rather than a list per bin for the whole global batch."""

    def loads(values: np.ndarray) -> list[int]:
        return np.sum([p.totals(values) for p in parts], axis=0, dtype=np.int64).tolist()

    empty = sum(int((np.diff(p.bounds) == 0).sum()) for p in parts)
    return stats_of_loads(loads(tokens), {n: loads(r) for n, r in rows.items()}, sum(len(p) for p in parts), empty,
                          capacity)


def split_encoder_parts(llm: Parts, rows: np.ndarray, dp: int) -> Parts:
    """One microbatch's positions per encoder replica, from the LLM replicas' (`rows`: each position's rows)."""
    llm_dp = len(llm)
    if dp == llm_dp:
        return llm
    if dp < llm_dp:  # fan-out: an encoder replica serves k consecutive LLM replicas
        k = llm_dp // dp
        return Parts(llm.order, llm.bounds[0:dp * k + 1:k])
    k = dp // llm_dp  # fan-in: k encoder replicas share one LLM replica's samples, contiguously
    counts = np.diff(llm.bounds)
    replica = np.repeat(np.arange(llm_dp, dtype=np.int64), counts)
    r = rows[llm.order]
    upto = np.concatenate([[0], np.cumsum(r)])
    acc = upto[:-1] - upto[llm.bounds[:-1]][replica]  # rows before each sample in its replica
    total = (upto[llm.bounds[1:]] - upto[llm.bounds[:-1]])[replica]
    local = np.arange(len(r), dtype=np.int64) - llm.bounds[:-1][replica]
    # its rows' midpoint's run (the same float operations as the list version); without rows, by count
    with np.errstate(divide="ignore", invalid="ignore"):
        by_rows = (k * (acc + r / 2) / total)
    by_count = local * k // np.maximum(counts[replica], 1)
    run = np.minimum(np.where(total > 0, by_rows, by_count).astype(np.int64), k - 1)
    runs = np.bincount(replica * k + run, minlength=llm_dp * k)
    return Parts(llm.order, np.concatenate([[0], np.cumsum(runs)]).astype(np.int64))
