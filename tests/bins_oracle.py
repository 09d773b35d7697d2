"""data/bins.py's `assign_bins` as it was at b5d5e2d (a heap of replicas, a scan of each one's bins per sample in
Python), kept as the oracle the faster one must equal — every bin, every error type and message — on any batch."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from loom.data.bins import BatchDoesNotFit, Rows, SampleTooLong


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
    n_bins = replicas * microbatches
    if replicas < 1 or microbatches < 1 or capacity < 1:
        raise ValueError(f"assign_bins: replicas={replicas}, microbatches={microbatches}, capacity={capacity}")
    row_total = _total_rows(rows, len(tokens))

    def name(i: int) -> str:
        return f"sample {i} of the batch" if indices is None else f"sample {indices[i]} of the dataset"

    def advice() -> str:
        return _advice(tokens, replicas, microbatches, capacity)

    too_long = [i for i, t in enumerate(tokens) if t > capacity]
    if too_long:
        i, more = too_long[0], len(too_long) - 1
        raise SampleTooLong(
            f"{name(i)} has {tokens[i]} tokens, more than data.tokens_per_microbatch = {capacity}"
            + (f" ({more} more samples of this batch are too long)" if more else "")
            + '; raise data.tokens_per_microbatch, or set data.too_long = "skip" to drop such samples'
        )
    total = sum(tokens)
    if total > n_bins * capacity:
        raise BatchDoesNotFit(f"the global batch needs {total} tokens, more than its bins hold; " + advice())

    bin_tok, bin_rows = [0] * n_bins, [0] * n_bins
    contents: list[list[int]] = [[] for _ in range(n_bins)]
    # a heap of replicas by (tokens, rows, index): O(log dp) per sample, hundreds of replicas stay cheap
    heap = [(0, 0, r) for r in range(replicas)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], -row_total[i], i)):
        passed = []  # replicas with no room for sample i; later (shorter) samples may still fit them
        while heap:
            r_tok, r_rows, r = heapq.heappop(heap)
            room = [b for b in range(r * microbatches, (r + 1) * microbatches) if bin_tok[b] + tokens[i] <= capacity]
            if room:
                break
            passed.append((r_tok, r_rows, r))
        else:  # every bin holds more than T − tokens[i]: greedy placement is stuck although the total fits
            raise BatchDoesNotFit(f"no bin has room for {name(i)} ({tokens[i]} tokens); " + advice())
        b = min(room, key=lambda b: (bin_tok[b], bin_rows[b], b))
        bin_tok[b] += tokens[i]
        bin_rows[b] += row_total[i]
        contents[b].append(i)
        heapq.heappush(heap, (r_tok + tokens[i], r_rows + row_total[i], r))
        for entry in passed:
            heapq.heappush(heap, entry)
    return [sorted(c) for c in contents]  # global order inside a bin: packing stays deterministic


def min_capacity(batch_size: int, max_len: int, n_bins: int) -> int:
    """The smallest T for which always_fits holds: L + ⌈(B − 1)·L / n⌉ (for config validation)."""
    return max_len + -(-max(batch_size - 1, 0) * max_len // n_bins)


def _total_rows(rows: Rows, n: int) -> list[int]:
    per_encoder = list(rows.values()) if isinstance(rows, Mapping) else [rows]
    if any(len(r) != n for r in per_encoder):
        raise ValueError(f"assign_bins: {n} samples' tokens but rows of another length")
    return [sum(r[i] for r in per_encoder) for i in range(n)]


def _advice(tokens: Sequence[int], replicas: int, microbatches: int, capacity: int) -> str:
    """What holds the batch and which keys change it, in numbers that do not depend on the step."""
    n, longest = replicas * microbatches, max(tokens)
    return (
        f"train.global_batch_size = {len(tokens)} samples go to {replicas} LLM replicas × train.microbatches = "
        f"{microbatches} bins of data.tokens_per_microbatch = {capacity} ({n * capacity} tokens); raise "
        f"train.microbatches or data.tokens_per_microbatch, or lower train.global_batch_size. Samples of at "
        f"most {longest} tokens always fit when data.tokens_per_microbatch >= {min_capacity(len(tokens), longest, n)}"
    )
