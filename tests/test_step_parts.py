"""The array planner (train/step_parts.py, data/shape_arrays.py, data/shape_table.py) places every sample exactly
where the list planner it replaced did (tests/plan_oracle.py): random global batches with media items, DPO pairs,
token budgets that force several bins and drops, the padding multiple, fan-in, fan-out and equal replica counts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loom.job import load_config
from loom.data.bins import DoesNotFit, SampleTooLong, bin_stats
from loom.data.conversations import BadSample
from loom.data.shape_arrays import ShapeArrays
from loom.data.shape_table import ShapeTable
from loom.data.shapes import SampleShape
from loom.train.length_rules import fitting
from loom.train.step_parts import Parts, fitting_arrays, split_encoder_parts, split_llm_parts, step_bin_stats
from plan_oracle import split_encoder, split_llm

ENCODERS = ["vision", "audio"]


def _shape(rng: random.Random, longest: int) -> SampleShape:
    rows = {"vision": tuple(rng.choice([0, 1, 4, 9, 16]) for _ in range(rng.choice([0, 0, 1, 2]))),
            "audio": tuple(rng.randint(0, 30) for _ in range(rng.choice([0, 1])))}
    return SampleShape(rng.randint(1, longest), rng.randint(0, 40), {e: r for e, r in rows.items() if r},
                       frozenset({"advantage"}) if rng.random() < 0.5 else frozenset())


def _batch(rng: random.Random, items: int, pairs: bool, longest: int) -> tuple[list[SampleShape], list[int]]:
    shapes, indices = [], []
    for i in rng.sample(range(10_000), items):
        for _ in range(2 if pairs and rng.random() < 0.7 else 1):
            shapes.append(_shape(rng, longest))
            indices.append(i)
    return shapes, indices


def _cfg(*overrides: str):
    return load_config("configs/tiny.toml", list(overrides))


CASES = [  # (LLM dp, microbatches, token budget, multiple, encoder dps)
    (4, 1, 0, 1, (1, 2, 4, 8)), (2, 3, 0, 8, (1, 2, 6)), (8, 2, 0, 16, (4, 8, 16)),
    (4, 2, 512, 8, (2, 4, 8, 16)), (2, 4, 256, 16, (1, 2, 4)), (16, 1, 1024, 64, (8, 16, 32)),
    (3, 2, 384, 1, (1, 3, 6)),
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dp,m,budget,multiple,enc_dps", CASES)
def test_the_array_planner_places_every_sample_as_the_list_planner(dp, m, budget, multiple, enc_dps, seed):
    rng = random.Random(seed * 1000 + dp * 10 + m)
    pairs = seed % 2 == 1
    items = dp * m * rng.randint(1, 3 if budget else 6)
    shapes, indices = _batch(rng, items, pairs, budget // 8 if budget else 300)  # a budget's bins hold them all
    # the oracle reads only the microbatches and the budget; the batch size only has to pass validation
    overrides = [f"--train.microbatches={m}", f"--data.tokens_per_microbatch={budget}",
                 f"--train.global_batch_size={4 * m}"]
    cfg = _cfg(*overrides)
    arrays = ShapeArrays.of(shapes, ENCODERS)
    tokens = [-(-s.tokens // multiple) * multiple for s in shapes]
    rows = {e: [sum(s.item_rows(e)) for s in shapes] for e in ENCODERS}
    assert arrays.row_sums("vision").tolist() == rows["vision"] and arrays.row_sums("audio").tolist() == rows["audio"]
    assert [arrays.shape(p) for p in range(len(shapes))] == shapes

    parts = split_llm_parts(np.array(tokens), {e: np.array(r) for e, r in rows.items()}, dp, m, budget,
                            np.array(indices))
    expected = split_llm(tokens, rows, dp, cfg, indices)
    assert [p.lists() for p in parts] == expected
    if budget:  # the step's metrics summed over the arrays, as bin_stats gives them from the bins as lists
        bins = [expected[k][r] for r in range(dp) for k in range(m)]
        real = [sh.tokens for sh in shapes]
        assert step_bin_stats(parts, np.array(real), {e: np.array(r) for e, r in rows.items()}, budget) == \
            bin_stats(bins, real, rows, m, budget)
    for llm, old in zip(parts, expected):
        for e in ENCODERS:
            for enc_dp in enc_dps:
                enc = split_encoder_parts(llm, np.array(rows[e]), enc_dp)
                old_enc = split_encoder(old, rows[e], enc_dp)
                assert enc.lists() == old_enc, (e, enc_dp)
                assert enc.sums(np.array(rows[e])) == [sum(rows[e][p] for p in ps) for ps in old_enc]
            assert llm.sums(np.array(rows[e])) == [sum(rows[e][p] for p in ps) for ps in old]


def test_the_steps_bin_metrics_are_bin_stats_of_the_bins():
    """Fewer items than bins (empty bins) to many; the metrics summed over arrays equal data/bins.py's bin_stats over
    the list planner's bins, float for float."""
    empties = 0
    for seed in range(40):
        rng = random.Random(seed)
        dp, m = rng.randint(1, 5), rng.randint(1, 4)
        shapes, indices = _batch(rng, rng.randint(0, 2 * dp * m), seed % 2 == 1, 100)
        tokens = [-(-sh.tokens // 8) * 8 for sh in shapes]
        rows = {e: [sum(sh.item_rows(e)) for sh in shapes] for e in ENCODERS}
        cfg = _cfg(f"--train.microbatches={m}", "--data.tokens_per_microbatch=1024", "--train.global_batch_size=8")
        expected = split_llm(tokens, rows, dp, cfg, indices)
        parts = split_llm_parts(np.array(tokens, dtype=np.int64), {e: np.array(r, dtype=np.int64) for e, r in
                                                                   rows.items()}, dp, m, 1024, np.array(indices))
        bins = [expected[k][r] for r in range(dp) for k in range(m)]
        real = [sh.tokens for sh in shapes]
        got = step_bin_stats(parts, np.array(real, dtype=np.int64), {e: np.array(r, dtype=np.int64) for e, r in
                                                                     rows.items()}, 1024)
        assert got == bin_stats(bins, real, rows, m, 1024), seed
        empties += got.empty_bins
    assert empties > 20


def test_a_batch_that_does_not_fit_is_named_as_the_list_planner_names_it():
    """Budgets from loose to too small: the same placement, or the same error naming the same dataset index."""
    seen = {"placed": 0, "too long": 0, "does not fit": 0}
    for seed in range(60):
        rng = random.Random(seed)
        shapes, indices = _batch(rng, 24, seed % 2 == 1, 120)
        tokens = [-(-sh.tokens // 8) * 8 for sh in shapes]
        rows = {e: [sum(sh.item_rows(e)) for sh in shapes] for e in ENCODERS}
        arrays = {e: np.array(r) for e, r in rows.items()}
        budget = rng.choice([max(tokens) + rng.randint(0, 240), max(tokens) // 2, max(tokens)])
        cfg = _cfg("--train.microbatches=2", f"--data.tokens_per_microbatch={budget}", "--train.global_batch_size=8")
        try:
            expected = split_llm(tokens, rows, 3, cfg, indices)
        except DoesNotFit as e:
            with pytest.raises(type(e)) as got:
                split_llm_parts(np.array(tokens), arrays, 3, 2, budget, np.array(indices))
            assert str(got.value) == str(e)
            seen["too long" if isinstance(e, SampleTooLong) else "does not fit"] += 1
            continue
        assert [p.lists() for p in split_llm_parts(np.array(tokens), arrays, 3, 2, budget, np.array(indices))] == \
            expected
        seen["placed"] += 1
    assert min(seen.values()) >= 5, seen


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("fmt", ["thd", "bshd"])
def test_too_long_samples_are_dropped_or_named_as_the_list_version_does(seed, fmt):
    rng = random.Random(seed)
    shapes, indices = _batch(rng, 40, seed % 2 == 0, 200)
    limit = "--data.tokens_per_microbatch=160" if fmt == "thd" else "--data.padded_length=160"
    for too_long in ("skip", "error"):
        cfg = _cfg(f"--data.format={fmt}", limit, f"--data.too_long={too_long}", "--model.attention=sdpa")
        try:
            kept, kept_indices, dropped = fitting(shapes, indices, cfg, 16)
        except BadSample as e:
            with pytest.raises(BadSample) as got:
                fitting_arrays(ShapeArrays.of(shapes, ENCODERS), np.array(indices), cfg, 16)
            assert str(got.value) == str(e)
            continue
        arrays, new_indices, new_dropped = fitting_arrays(ShapeArrays.of(shapes, ENCODERS), np.array(indices), cfg, 16)
        assert new_dropped == dropped and new_indices.tolist() == kept_indices
        assert [arrays.shape(p) for p in range(len(arrays))] == kept
        assert too_long == "error" or seed > 3 or dropped  # the random lengths do force drops


def test_a_shape_table_gives_each_items_shapes_measured_once_or_put_in_parts():
    rng = random.Random(0)
    items = {i: (_shape(rng, 100), _shape(rng, 100)) for i in range(50)}
    measured: list[int] = []

    def measure(i):
        measured.append(i)
        return items[i]

    table = ShapeTable(50, 2, ENCODERS, measure)
    got, index = table.shapes(np.array([7, 3, 7, 49]))
    assert [got.shape(p) for p in range(len(got))] == [s for i in (7, 3, 7, 49) for s in items[i]]
    assert index.tolist() == [7, 7, 3, 3, 7, 7, 49, 49] and sorted(measured) == [3, 7, 49]
    table.shapes(np.array([3, 49]))
    assert sorted(measured) == [3, 7, 49]  # each item measured once
    # the start-up's way: each rank's share as arrays, combined
    whole = ShapeTable(50, 2, ENCODERS, measure)
    shares = [whole.share(r, 4) for r in range(4)]
    whole.put(np.concatenate([i for i, _ in shares]), ShapeArrays.joined([s for _, s in shares]))
    measured.clear()
    got, _ = whole.shapes(np.arange(50)[::-1])
    assert not measured and [got.shape(p) for p in range(len(got))] == [s for i in range(49, -1, -1) for s in items[i]]


def test_parts_of_runs_round_trip():
    runs = [[0, 3], [], [5], [1, 2, 4]]
    assert Parts.of(runs).lists() == runs and len(Parts.of(runs)) == 4
