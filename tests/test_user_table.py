"""A user's prescanned lines plan a step from a shape table, as the built-in tasks do (data/shape_table.py
`known_table`, filled at load from the prescan's shapes, no collective): past data.balance_replicas a rank's
planning cells and the step's totals looked up in it equal those cut from the whole batch measured line by line
(the path of a dataset without a table: the oracle), a too-long line skipped alike, a weighted mixture's repeated
positions and DPO pairs included; the whole-batch path is not taken; at one cell the draw is the one of old."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
from conftest import tiny_job_overrides, user_data_overrides, write_user_data

from loom.data.loader import GlobalBatches
from loom.data.shape_arrays import ShapeArrays
from loom.data import shape_table
from loom.data.shapes import SampleShape
from loom.data.source import ConversationSamples
from loom.job import load_config
from loom.train.job_data import build_job_data, job_tokenizer, with_vocabulary
from loom.train.job_model import build_batches, build_job_model, token_counters
from loom.train.plan_cells import Cells
from loom.train.step_draw import draw
from test_dpo import _pair_lines

MULTIPLE = 8
DPO = ["--train.objective=dpo", "--train.reference=initial"]


def _text_lines(path, n: int = 7) -> None:
    """Text-only conversations of growing length (the longest over a small token budget)."""
    lines = [{"messages": [{"role": "user", "content": "What is this? " * (1 + 4 * i)},
                           {"role": "assistant", "content": "A cat. " * (1 + 3 * i)}]} for i in range(n)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _job(tmp_path, pairs: bool, *extra: str):
    """The tiny model's counters and its user data: the images-and-clips JSONL beside a text-only one weighted up
    (its positions repeat in the mixture), as DPO pairs when `pairs`."""
    images = write_user_data(tmp_path / "data", n=24, seed=1)
    text = tmp_path / "data" / "text.jsonl"
    _text_lines(text)
    if pairs:
        _pair_lines(images)
        _pair_lines(text)
    overrides = [o for o in user_data_overrides(tmp_path, *(DPO if pairs else []), *extra)
                 if not o.startswith("--data.sources")]
    sources = f'--data.sources=[{{path = "{images}", weight = 1.0}}, {{path = "{text}", weight = 2.0}}]'
    cfg = load_config(None, tiny_job_overrides(tmp_path / "run", *overrides, sources))
    tok = job_tokenizer(cfg)
    cfg = with_vocabulary(cfg, tok)
    counters = token_counters(build_job_model(cfg, tok))
    return cfg, counters, build_job_data(cfg, tok, counters, MULTIPLE)


def _without_table(batches: GlobalBatches) -> GlobalBatches:
    """The same global batches of the same dataset with no table: the whole batch measured line by line."""
    dataset = copy.copy(batches.dataset)
    dataset.table = None
    return GlobalBatches(dataset, batches.global_batch_size, batches.seed)


def _same(a, b) -> None:
    assert a.planned == b.planned and a.totals == b.totals
    assert a.indices.tolist() == b.indices.tolist() and a.bounds.tolist() == b.bounds.tolist()
    assert [a.shapes.shape(p) for p in range(len(a.shapes))] == [b.shapes.shape(p) for p in range(len(b.shapes))]


@pytest.mark.parametrize("pairs", [False, True])
def test_a_ranks_cells_of_user_data_from_the_table_equal_the_whole_batch_cut(tmp_path, pairs):
    cfg, counters, data = _job(tmp_path, pairs, "--train.microbatches=2", "--data.tokens_per_microbatch=96",
                               "--data.too_long=skip", "--data.balance_replicas=2", "--train.global_batch_size=16")
    assert isinstance(data.train, ConversationSamples) and data.train.table.complete
    assert data.train.table.sequences == (2 if pairs else 1)
    assert len(set(data.train.positions)) < len(data.train)  # the weighted mixture repeats positions
    looked_up = build_batches(cfg, data)
    measured = _without_table(looked_up)
    for batches in (looked_up, measured):
        batches.drop(int(batches.indices(1)[3]))  # an item found bad at a step before: gone from its cell
    dp, skipped = 8, 0
    for step in range(4):
        whole = draw(looked_up, step, cfg, counters, MULTIPLE)  # the reference's: one cell, every sample
        _same(whole.batch, draw(measured, step, cfg, counters, MULTIPLE).batch)
        skipped += whole.batch.totals.skipped
        seen = []
        for d in range(dp):
            shares = {"language": (d, dp), "vision": (d // 2, dp // 2), "audio": (d, dp)}
            a, b = (draw(x, step, cfg, counters, MULTIPLE, shares) for x in (looked_up, measured))
            assert a.bad == b.bad == {} and a.batch.planned == (Cells.of(2, dp).cell_of(d),)
            _same(a.batch, b.batch)
            assert a.batch.totals == whole.batch.totals
            if d % 2 == 0:
                seen += a.batch.indices.tolist()  # once per cell
        assert seen == whole.batch.indices.tolist()  # the cells, side by side, are the whole batch's samples
    assert skipped > 0  # a too-long line was left out, alike from the table and from the whole batch


def test_a_ranks_cells_of_user_data_are_looked_up_not_measured_whole(tmp_path, monkeypatch):
    """Past data.balance_replicas the draw reads the table alone: neither the whole batch's shapes nor a line's."""
    cfg, counters, data = _job(tmp_path, False, "--data.balance_replicas=1", "--train.global_batch_size=16")
    batches = build_batches(cfg, data)
    expected = draw(_without_table(batches), 0, cfg, counters, MULTIPLE, {"language": (1, 4)})

    def refused(*args, **kwargs):
        raise AssertionError("a rank planning cells measured the whole batch")

    monkeypatch.setattr(GlobalBatches, "sequence_shapes", refused)
    monkeypatch.setattr(ConversationSamples, "shape", refused)
    _same(draw(batches, 0, cfg, counters, MULTIPLE, {"language": (1, 4)}).batch, expected.batch)


def test_a_known_table_keeps_the_tower_rows_that_differ_filled_in_chunks(monkeypatch):
    """Anyres tiles: an item's rows through the tower are not its LLM rows; the table, filled a few items at a time
    (the first with no tower rows that differ, later ones with more items than any before), gives them back as
    measured."""
    rng = random.Random(0)
    shapes = []
    for i in range(40):
        rows = tuple(rng.choice([4, 9]) for _ in range(rng.randint(0, 1 if i < 14 else 3)))
        tower = {"vision": tuple(5 * r for r in rows)} if rows and i > 7 and i % 3 else {}
        shapes.append(SampleShape(rng.randint(10, 90), 5, {"vision": rows} if rows else {}, tower=tower))
    monkeypatch.setattr(shape_table, "KNOWN_CHUNK", 7)
    table = shape_table.known_table(40, 1, ["vision", "audio"], lambda i: (shapes[i],))
    items = np.array([35, 3, 7, 7, 29, 12, 0])
    got, indices = table.shapes(items)
    want = ShapeArrays.of([shapes[i] for i in items], ["vision", "audio"])
    assert table.complete and indices.tolist() == items.tolist()
    assert [got.shape(p) for p in range(len(got))] == [want.shape(p) for p in range(len(want))]
    assert got.tower_sums("vision").tolist() == want.tower_sums("vision").tolist()
