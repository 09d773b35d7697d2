"""The array planner (train/step_parts.py, data/shape_arrays.py, data/shape_table.py) places every sample exactly
where the list planner it replaced did (tests/plan_oracle.py): random global batches with media items, DPO pairs,
token budgets that force several bins and drops, the padding multiple, fan-in, fan-out and equal replica counts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loom.job import load_config
from loom.data.conversations import BadSample
from loom.data.shape_arrays import ShapeArrays
from loom.data.shape_table import ShapeTable
from loom.data.shapes import SampleShape
from loom.train.length_rules import fitting
from loom.train.step_parts import Parts, fitting_arrays, split_encoder_parts, split_llm_parts
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
    for llm, old in zip(parts, expected):
        for e in ENCODERS:
            for enc_dp in enc_dps:
                enc = split_encoder_parts(llm, np.array(rows[e]), enc_dp)
                old_enc = split_encoder(old, rows[e], enc_dp)
                assert enc.lists() == old_enc, (e, enc_dp)
                assert enc.sums(np.array(rows[e])) == [sum(rows[e][p] for p in ps) for ps in old_enc]
            assert llm.sums(np.array(rows[e])) == [sum(rows[e][p] for p in ps) for ps in old]


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
