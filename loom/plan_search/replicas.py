"""Each replica's share of one step, placed as `loom train` places it (train/step_parts.py): the LLM's samples over
its dp replicas and M microbatches (the balancing packer under a token budget T, else equal contiguous shares), then
each encoder's part of every microbatch over its own replicas (fan-in by the rows' midpoints, fan-out by whole LLM
replicas).

The cost model prices the slowest replica of each run, not the mean: a module's replicas wait for each other at
every FSDP collective (and at the step's end), so a dp4 step of one 12K- and one 22K-token sample takes the 22K
sample's time — its linear work 1.8×, its attention 3.2× the short one's. A share is a replica's rows (tokens,
patches, frames: what its matmuls see, filler included under T) and squares (Σ rows² over its samples or items:
what its attention sees, up to a constant). Each sequence is placed as its own item (a DPO pair's two, which loom
keeps together, may land apart here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loom.data.bins import DoesNotFit
from loom.train.step_parts import Parts, split_encoder_parts, split_llm_parts


@dataclass(frozen=True)
class Shares:
    """A module's step, run by run (a microbatch; the whole step for an encoder run once): rows[k][r] and
    squares[k][r] of replica r in run k."""

    rows: tuple[tuple[float, ...], ...]
    squares: tuple[tuple[float, ...], ...]

    @staticmethod
    def even(rows: float, squares: float, replicas: int, runs: int) -> Shares:
        """The step spread evenly over replicas and runs (no samples to place: every replica the mean)."""
        n = max(1, replicas) * max(1, runs)
        one = (max(1, replicas), max(1, runs))
        return Shares(((rows / n,) * one[0],) * one[1], ((squares / n,) * one[0],) * one[1])

    @property
    def runs(self) -> int:
        return len(self.rows)

    def slowest(self, per_row: float, per_square: float) -> tuple[float, float]:
        """Σ over runs of the slowest replica's rows and squares, the slowest by per_row·rows + per_square·squares
        (each run waits for its slowest replica)."""
        rows = squares = 0.0
        for r_run, s_run in zip(self.rows, self.squares):
            r = max(range(len(r_run)), key=lambda i: per_row * r_run[i] + per_square * s_run[i])
            rows, squares = rows + r_run[r], squares + s_run[r]
        return rows, squares

    @property
    def largest(self) -> float:
        """The most rows any replica holds in one run: its activations are the fullest GPU's."""
        return max((x for run in self.rows for x in run), default=0.0)


def llm_parts(lengths: list[int], item_rows: dict[str, np.ndarray], dp: int, microbatches: int, budget: int,
              multiple: int) -> list[Parts] | None:
    """train/step_parts.py's placement of the step's samples (each rounded up to `multiple`); None when they do not
    fit the bins (loom refuses that candidate; its price is then the even split's)."""
    tokens = -(-np.asarray(lengths, dtype=np.int64) // multiple) * multiple
    try:
        return split_llm_parts(tokens, item_rows, dp, microbatches, budget, np.arange(len(tokens), dtype=np.int64))
    except DoesNotFit:
        return None


def llm_shares(parts: list[Parts], lengths: list[int], budget: int, multiple: int) -> Shares:
    """The LLM replicas' shares: their samples' tokens, or T each under a budget (the filler computes as tokens;
    attention sees the samples alone)."""
    tokens = -(-np.asarray(lengths, dtype=np.float64) // multiple) * multiple
    rows = tuple(tuple(float(budget) for _ in range(len(p))) if budget else tuple(p.totals(tokens).tolist())
                 for p in parts)
    return Shares(rows, tuple(tuple(p.totals(tokens * tokens).tolist()) for p in parts))


def encoder_shares(parts: list[Parts], rows: np.ndarray, squares: np.ndarray, dp: int, once: bool) -> Shares:
    """An encoder's replicas' shares of every microbatch (`rows`, `squares`: each sample's, over its items), or of
    the whole step when the encoder runs once a step (`once`: the three-phase step of a pipelined LLM)."""
    per_run = [split_encoder_parts(p, rows, dp) for p in parts]
    r = [p.totals(rows.astype(np.float64)) for p in per_run]
    s = [p.totals(squares.astype(np.float64)) for p in per_run]
    if once:
        r, s = [np.sum(r, axis=0)], [np.sum(s, axis=0)]
    return Shares(tuple(tuple(x.tolist()) for x in r), tuple(tuple(x.tolist()) for x in s))


def per_sample(items: tuple[int, ...], counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's rows and Σ rows² from every item's rows, sample after sample (`counts`: items per sample)."""
    x = np.asarray(items, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    if bounds[-1] != len(x):
        raise ValueError(f"{len(x)} encoder items, but the samples' counts add up to {int(bounds[-1])}")
    cum, cum2 = np.concatenate([[0], np.cumsum(x)]), np.concatenate([[0], np.cumsum(x * x)])
    return cum[bounds[1:]] - cum[bounds[:-1]], cum2[bounds[1:]] - cum2[bounds[:-1]]
