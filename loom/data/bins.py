"""Fixed-shape microbatches: the samples of one global batch assigned to dp × M bins of T tokens each.

Every rank computes the same assignment from host data alone (sample lengths and encoder rows), so no
collective is needed and the one-process reference sees the same bins. Bin `replica * M + microbatch` is
microbatch `microbatch` of LLM replica `replica` (replica-major).

Algorithm: longest-processing-time greedy in two levels. Samples are taken by (tokens desc, rows desc,
index asc); each goes to the replica with the fewest tokens (then fewest rows, then lowest index) that has
a bin with room for it, and inside that replica to the bin with the fewest tokens (same ties) that fits.
Why not least-loaded over all dp·M bins, then replicas as consecutive bins: that keeps *bins* within one
sample of each other, but a replica sums M bins, so replicas may drift apart by up to M samples; choosing
the replica first keeps replicas within one sample (max − min ≤ the longest sample) whenever capacity does
not bind, and a placement still fails only when no bin anywhere has room. Why not balance replicas first
(capacity M·T) and split each into M bins afterwards: that split can fail even though the batch fits.

Cost: one Python step per sample, two heap replacements of int keys (`_greedy`); every rank runs it over the whole
global batch each step (8,192 samples: ~6 ms; tests/bins_oracle.py is the scan it replaced, same bins).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Rows = Sequence[int] | Mapping[str, Sequence[int]]  # encoder rows per sample: all encoders, or per encoder


class DoesNotFit(ValueError):
    """A global batch cannot be assigned to its bins."""


class SampleTooLong(DoesNotFit):
    """One sample alone has more tokens than a microbatch holds."""


class BatchDoesNotFit(DoesNotFit):
    """The samples, each short enough, do not fit the dp × M bins together."""


def assign_bins(
    tokens: Sequence[int],
    rows: Rows,
    replicas: int,
    microbatches: int,
    capacity: int,
    indices: Sequence[int] | None = None,
) -> list[list[int]]:
    """Batch positions of the samples in each of `replicas · microbatches` bins, ascending inside a bin.

    tokens[i]: LLM tokens of sample i (already rounded up to the packing multiple); rows: its encoder rows
    (a per-encoder mapping is summed: rows only break ties); capacity: T, the tokens of one microbatch;
    indices[i]: sample i's dataset index, named in errors. A bin may stay empty (a filler-only microbatch).
    """
    where = bin_of_each(tokens, rows, replicas, microbatches, capacity, indices)
    # global order inside a bin (packing stays deterministic): a stable sort by bin keeps positions ascending
    order = np.argsort(where, kind="stable").tolist()
    bounds = np.concatenate([[0], np.cumsum(np.bincount(where, minlength=replicas * microbatches))]).tolist()
    return [order[a:z] for a, z in zip(bounds[:-1], bounds[1:])]


def bin_of_each(
    tokens: Sequence[int],
    rows: Rows,
    replicas: int,
    microbatches: int,
    capacity: int,
    indices: Sequence[int] | None = None,
    batch: str | None = None,
) -> np.ndarray:
    """`assign_bins` as an array: the bin of each sample (int64 [len(tokens)]), for callers that go on in numpy;
    `batch`: what errors call the samples (default: "train.global_batch_size = N")."""
    n_bins = replicas * microbatches
    if replicas < 1 or microbatches < 1 or capacity < 1:
        raise ValueError(f"assign_bins: replicas={replicas}, microbatches={microbatches}, capacity={capacity}")
    tok = np.asarray(tokens, dtype=np.int64).reshape(len(tokens))
    row_total = _total_rows(rows, len(tokens))

    def name(i: int) -> str:
        return f"sample {i} of the batch" if indices is None else f"sample {indices[i]} of the dataset"

    def advice() -> str:
        return _advice(tokens, replicas, microbatches, capacity, batch)

    too_long = np.flatnonzero(tok > capacity).tolist()
    if too_long:
        i, more = too_long[0], len(too_long) - 1
        raise SampleTooLong(
            f"{name(i)} has {tokens[i]} tokens, more than data.tokens_per_microbatch = {capacity}"
            + (f" ({more} more samples of this batch are too long)" if more else "")
            + '; raise data.tokens_per_microbatch, or set data.too_long = "skip" to drop such samples'
        )
    total = int(tok.sum())
    if total > n_bins * capacity:
        needs = "the global batch needs" if batch is None else f"{batch} samples need"
        raise BatchDoesNotFit(f"{needs} {total} tokens, more than {'its' if batch is None else 'their'} bins hold; "
                              + advice())

    # longest first, ties: more rows, then the lower position (lexsort is stable: positions stay ascending)
    order = np.lexsort((-row_total, -tok))
    placed = _greedy(tok[order].tolist(), row_total[order].tolist(), replicas, microbatches, capacity)
    if len(placed) < len(tok):  # every bin holds more than T − t: greedy placement is stuck although the total fits
        i = int(order[len(placed)])
        raise BatchDoesNotFit(f"no bin has room for {name(i)} ({tokens[i]} tokens); " + advice())
    where = np.empty(len(tok), dtype=np.int64)
    where[order] = placed
    return where


def _greedy(tokens: list[int], rows: list[int], replicas: int, microbatches: int, capacity: int) -> list[int]:
    """The bin of each sample, taken in this order, until one finds no room (the list stops short there).

    A replica has a bin with room for t tokens iff its emptiest bin has (`lowest[r] <= T − t`), and the bin the
    rule picks — the fewest (tokens, rows, index) among those with room — is then its least bin by that key over
    all its bins (the least has the fewest tokens, so it has room whenever any bin has). So each replica keeps
    its bins in a heap, and a sample costs two heap replacements (C) instead of a scan of its replica's M bins
    and a keyed min: the same choices, sample for sample. A key (tokens, rows, index) is one int,
    tokens·2^A + rows·2^B + index — rows < 2^(A−B) (no more than the batch's), index < 2^B — which orders as the
    tuple does at a fraction of a tuple comparison's cost, and adding a sample adds t·2^A + rows·2^B to it."""
    shift = max(1, (replicas * microbatches).bit_length())  # B
    high = shift + max(1, sum(rows).bit_length())  # A
    index = (1 << shift) - 1
    replicas_heap = list(range(replicas))  # every key (0, 0, r): sorted, so a heap
    bins_heap = [list(range(r * microbatches, (r + 1) * microbatches)) for r in range(replicas)]
    lowest = [0] * replicas  # the tokens of each replica's emptiest bin
    heapreplace, placed = heapq.heapreplace, []
    for t, rw in zip(tokens, rows):
        limit, top = capacity - t, replicas_heap[0]
        passed = ()
        if lowest[top & index] > limit:  # the least-loaded replicas have no room: set them aside
            passed = []  # later (shorter) samples may still fit them
            while replicas_heap and lowest[replicas_heap[0] & index] > limit:
                passed.append(heapq.heappop(replicas_heap))
            if not replicas_heap:
                return placed
            top = replicas_heap[0]
        add, r = (t << high) + (rw << shift), top & index
        mine = bins_heap[r]
        key = mine[0]
        heapreplace(mine, key + add)
        lowest[r] = mine[0] >> high
        heapreplace(replicas_heap, top + add)
        for entry in passed:
            heapq.heappush(replicas_heap, entry)
        placed.append(key & index)
    return placed


def always_fits(batch_size: int, max_len: int, n_bins: int, capacity: int) -> bool:
    """True when any `batch_size` samples of at most `max_len` tokens surely fit `n_bins` bins of
    `capacity` under assign_bins (or any placement that uses a bin whenever one has room).

    Proof: a sample of p ≤ L tokens finds no room only if every bin holds more than T − p ≥ T − L, i.e. the
    ≤ B − 1 samples already placed hold more than n·(T − L); they hold at most (B − 1)·L, so this cannot
    happen when (B − 1)·L ≤ n·(T − L).
    """
    if batch_size <= 0:
        return True
    return max_len <= capacity and (batch_size - 1) * max_len <= n_bins * (capacity - max_len)


def min_capacity(batch_size: int, max_len: int, n_bins: int) -> int:
    """The smallest T for which always_fits holds: L + ⌈(B − 1)·L / n⌉ (for config validation)."""
    return max_len + -(-max(batch_size - 1, 0) * max_len // n_bins)


@dataclass(frozen=True)
class BinStats:
    """How even one step's assignment is; 1.0 imbalance = every replica got the mean."""

    token_imbalance: float  # max / mean over replicas of LLM tokens
    row_imbalance: dict[str, float]  # the same per encoder ("all" when rows were one list)
    fill: float  # tokens / (T · bins): the share of the fixed-shape microbatches that is not filler
    empty_bins: int  # filler-only microbatches

    def as_dict(self) -> dict[str, float]:
        """Flat names for metrics.jsonl."""
        out = {"token_imbalance": self.token_imbalance, "fill": self.fill, "empty_bins": float(self.empty_bins)}
        out.update({f"row_imbalance_{k}": v for k, v in self.row_imbalance.items()})
        return out


def bin_stats(bins: list[list[int]], tokens: Sequence[int], rows: Rows, microbatches: int, capacity: int) -> BinStats:
    """Metrics of an assignment. Pass the unrounded lengths as `tokens` to count real tokens only in `fill`."""
    per_encoder = dict(rows) if isinstance(rows, Mapping) else {"all": rows}
    replicas = len(bins) // microbatches

    def loads(values: Sequence[int]) -> list[int]:
        return [sum(values[i] for b in bins[r * microbatches : (r + 1) * microbatches] for i in b)
                for r in range(replicas)]

    return stats_of_loads(loads(tokens), {k: loads(v) for k, v in per_encoder.items()}, len(bins),
                          sum(not b for b in bins), capacity)


def stats_of_loads(token_loads: Sequence[int], row_loads: Mapping[str, Sequence[int]], n_bins: int, empty_bins: int,
                   capacity: int) -> BinStats:
    """`bin_stats` from each replica's totals (what a caller holding the bins as arrays sums in numpy)."""

    def imbalance(loads: Sequence[int]) -> float:
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0  # nothing to balance counts as perfect

    return BinStats(
        token_imbalance=imbalance(token_loads),
        row_imbalance={k: imbalance(v) for k, v in row_loads.items()},
        fill=sum(token_loads) / (capacity * n_bins),
        empty_bins=empty_bins,
    )


def _total_rows(rows: Rows, n: int) -> np.ndarray:
    per_encoder = list(rows.values()) if isinstance(rows, Mapping) else [rows]
    if any(len(r) != n for r in per_encoder):
        raise ValueError(f"assign_bins: {n} samples' tokens but rows of another length")
    total = np.zeros(n, dtype=np.int64)
    for r in per_encoder:
        total += np.asarray(r, dtype=np.int64).reshape(n)
    return total


def _advice(tokens: Sequence[int], replicas: int, microbatches: int, capacity: int, batch: str | None = None) -> str:
    """What holds the batch and which keys change it, in numbers that do not depend on the step."""
    n, longest = replicas * microbatches, max(tokens)
    batch = batch or f"train.global_batch_size = {len(tokens)}"
    return (
        f"{batch} samples go to {replicas} LLM replicas × train.microbatches = {microbatches} bins of "
        f"data.tokens_per_microbatch = {capacity} ({n * capacity} tokens); raise "
        f"train.microbatches or data.tokens_per_microbatch, or lower train.global_batch_size. Samples of at "
        f"most {longest} tokens always fit when data.tokens_per_microbatch >= {min_capacity(len(tokens), longest, n)}"
    )
