"""data/bins.py's heap-per-replica packer against the one it replaced (tests/bins_oracle.py): the same bin for every
sample and the same error, type and message, on random batches — loose capacity, capacity that binds (a replica
without room set aside), batches that do not fit, too-long samples — and on a batch of the deepseek job's size."""

from __future__ import annotations

import random

import numpy as np
import pytest
from bins_oracle import assign_bins as oracle

from loom.data.bins import DoesNotFit, assign_bins, bin_of_each, min_capacity


def outcome(fn, *args, **kwargs):
    """Bins, or the error's type and message."""
    try:
        return fn(*args, **kwargs)
    except DoesNotFit as e:
        return type(e), str(e)


def random_batch(rng: random.Random):
    replicas, microbatches = rng.randint(1, 12), rng.randint(1, 6)
    n_bins, size = replicas * microbatches, rng.randint(0, 90)
    kind = rng.choice(["few values", "wide", "one value"])  # few values: ties in tokens, broken by rows, then index
    if kind == "few values":
        tokens = [rng.choice([8, 16, 24, 32, 64, 128]) for _ in range(size)]
    elif kind == "wide":
        tokens = [rng.randint(1, 600) for _ in range(size)]
    else:
        tokens = [40] * size
    rows = [rng.choice([0, 0, 4, 9, 9, 30]) for _ in range(size)]
    if rng.random() < 0.4:  # per encoder: summed
        rows = {"vision": rows, "audio": [rng.choice([0, 5]) for _ in range(size)]}
    longest = max(tokens, default=1)
    # loose (never binds), near the mean load (binds, may not fit), below it (does not fit), below the longest
    capacity = rng.choice([
        min_capacity(size, longest, n_bins) + rng.randint(0, 50),
        max(longest, -(-sum(tokens) // n_bins) + rng.randint(0, longest)),
        max(1, sum(tokens) // n_bins - rng.randint(0, 20)),
        max(1, longest - rng.randint(0, 10)),
    ])
    indices = [rng.randrange(10**6) for _ in range(size)] if rng.random() < 0.5 else None
    return tokens, rows, replicas, microbatches, capacity, indices


def test_every_sample_lands_where_the_old_packer_put_it():
    rng = random.Random(50)
    seen = {"placed": 0, "too long": 0, "does not fit": 0, "stuck": 0}
    for _ in range(4000):
        tokens, rows, replicas, microbatches, capacity, indices = random_batch(rng)
        want = outcome(oracle, tokens, rows, replicas, microbatches, capacity, indices)
        got = outcome(assign_bins, tokens, rows, replicas, microbatches, capacity, indices)
        assert got == want, (tokens, rows, replicas, microbatches, capacity, indices)
        key = ("placed" if isinstance(want, list) else "too long" if "more than data.tokens_per_microbatch" in want[1]
               else "stuck" if "no bin has room" in want[1] else "does not fit")
        seen[key] += 1
    assert min(seen.values()) >= 100, seen  # every path is exercised, not just the easy one


def test_where_capacity_binds(monkeypatch):
    """Small bins nearly full: the least-loaded replica at times has no room and is set aside (the only path that
    pops the replicas' heap), and samples land elsewhere than they would with room everywhere. Rare in any one
    batch (~1%), so many batches."""
    import heapq
    import types

    import loom.data.bins as bins

    set_aside = [0]

    def heappop(heap):
        set_aside[0] += 1
        return heapq.heappop(heap)

    monkeypatch.setattr(bins, "heapq", types.SimpleNamespace(heappop=heappop, heappush=heapq.heappush,
                                                             heapreplace=heapq.heapreplace))
    rng = random.Random(4)
    bound = moved = 0
    for _ in range(20000):
        replicas, microbatches = rng.randint(2, 5), rng.randint(2, 4)
        capacity = rng.randint(10, 40)
        size = rng.randint(1, 4) * replicas * microbatches
        low = rng.choice([1, capacity // 3])
        tokens = [rng.randint(low, capacity * 2 // 3 if low > 1 else capacity) for _ in range(size)]
        rows = [rng.randint(0, 3) for _ in range(size)]
        before = set_aside[0]
        want = outcome(oracle, tokens, rows, replicas, microbatches, capacity)
        assert outcome(bins.assign_bins, tokens, rows, replicas, microbatches, capacity) == want
        if isinstance(want, list) and set_aside[0] > before:
            bound += 1
            moved += want != oracle(tokens, rows, replicas, microbatches, 10**9)
    assert bound >= 100 and moved >= 50, (bound, moved)


@pytest.mark.parametrize("as_arrays", [False, True])
def test_deepseek_sized_batch(as_arrays):
    """8,192 items into 512 replicas × 16 microbatches of 1,024 tokens (bench/scale_sim.py's deepseek job at 8,192
    ranks), and the same capacity halved, where it binds; lists and numpy arrays alike."""
    gen = np.random.default_rng(0)
    tokens, vision, audio = gen.integers(16, 700, 8192), gen.integers(0, 300, 8192), gen.integers(0, 50, 8192)
    tokens = (tokens + 15) // 16 * 16  # rounded to the sample multiple, as a step rounds them: many ties
    for capacity in (1024, 768):
        args = ((tokens, {"vision": vision, "audio": audio}) if as_arrays else
                (tokens.tolist(), {"vision": vision.tolist(), "audio": audio.tolist()}))
        want = oracle(*args, 512, 16, capacity)
        assert assign_bins(*args, 512, 16, capacity) == want
        where = bin_of_each(*args, 512, 16, capacity)
        assert all(where[i] == b for b, items in enumerate(want) for i in items)
