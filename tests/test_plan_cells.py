"""Planning cells (train/plan_cells.py): a rank plans only the cells its blocks are in, and what it plans from them
alone is the matching slice of the whole world's plan under the same cell rule (a global oracle built from
tests/plan_oracle.py, cell by cell); every sample is planned exactly once over the ranks and the bins fit. At dp ≤
data.balance_replicas there is one cell and the plan is the old one, sample for sample (plan_oracle on the whole
batch). The draw from a shape table (cells looked up, totals from its columns) equals the draw measured whole."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import MIXED_SPECS, TINY_MODEL_OVERRIDES, make_sample

from loom.bridge.known_rows import KnownRows
from loom.data.batch import IGNORE_INDEX
from loom.data.bins import BatchDoesNotFit
from loom.bridge.replica_rows import ReplicaRows
from loom.bridge.routes import step_chunks
from loom.config import ConfigError
from loom.data.loader import GlobalBatches
from loom.data.shape_arrays import ShapeArrays
from loom.data.shape_columns import ShapeColumns
from loom.data.shape_table import ShapeTable
from loom.data.shapes import SampleShape
from loom.job import load_config
from loom.train.cell_batch import CellBatch
from loom.train.cell_placement import place
from loom.train.inputs import collate, plan_inputs
from loom.train.plan_cells import Cells
from loom.train.step_draw import draw
from loom.train.step_parts import item_starts, rounded
from loom.train.step_totals import step_totals
from plan_oracle import split_encoder, split_llm
from test_step_parts import ENCODERS, _batch
from test_step_parts import _shape as _any_shape

MULTIPLE = 8


def _cfg(*overrides: str):
    return load_config("configs/tiny.toml", list(overrides))


def _shape(rng: random.Random, longest: int):
    """A random sample's shape (test_step_parts.py's), its token fields those of every sample of a batch."""
    return dataclasses.replace(_any_shape(rng, longest), fields=frozenset())


def _world(rng: random.Random, dp: int, m: int, budget: int, pairs: bool):
    """A global batch's shapes and indices: dp·M·q items without a budget (it divides), else any number."""
    items = dp * m * rng.randint(1, 3) if not budget else rng.randint(dp, 5 * dp * m)
    shapes, indices = _batch(rng, items, pairs, budget // 6 if budget else 300)
    shapes = [dataclasses.replace(sh, fields=frozenset()) for sh in shapes]
    return ShapeArrays.of(shapes, ENCODERS), np.array(indices, dtype=np.int64)


def _global_oracle(arrays: ShapeArrays, indices: np.ndarray, cells: Cells, cfg, enc_dps: dict[str, int]):
    """The whole world's plan under the cell rule, from the list planner: each cell planned alone over its
    replicas, the cells side by side; each encoder's parts from the whole world's LLM parts (fan-out blocks may span
    cells). [k][replica] → positions of the whole batch."""
    tokens = rounded(arrays.tokens, MULTIPLE).tolist()
    rows = {e: arrays.row_sums(e).tolist() for e in ENCODERS}
    starts = np.concatenate([item_starts(indices), [len(indices)]]).tolist()
    llm = [[] for _ in range(cfg.train.microbatches)]
    for c in range(len(cells)):
        r = cells.items(c, len(starts) - 1)
        a, b = starts[r.start], starts[r.stop]
        parts = split_llm(tokens[a:b], {e: v[a:b] for e, v in rows.items()}, len(cells.replicas(c)), cfg,
                          indices[a:b].tolist())
        for k, per_replica in enumerate(parts):
            llm[k] += [[a + p for p in run] for run in per_replica]
    encoders = {e: [split_encoder(llm[k], rows[e], dp) for k in range(len(llm))] for e, dp in enc_dps.items()}
    return llm, encoders, rows


def _ranks(rng: random.Random, dp: int, enc_dps: dict[str, int]) -> list[dict[str, tuple]]:
    """Shares of ranks to plan: every LLM replica beside its colocated encoder replicas, beside encoder replicas in
    other cells (a pipelined LLM's later stages), and ranks hosting only encoders or only the LLM (non-colocated)."""
    out = []
    for d in range(dp):
        out.append({"language": (d, dp), **{e: (d * n // dp, n) for e, n in enc_dps.items()}})
        out.append({"language": (d, dp), **{e: (rng.randrange(n), n) for e, n in enc_dps.items()}})
        out.append({"language": (d, dp), **{e: (None, n) for e, n in enc_dps.items()}})
    for e, n in enc_dps.items():
        out += [{"language": (None, dp), **{f: ((r if f == e else None), m) for f, m in enc_dps.items()}}
                for r in range(n)]
    return out


def _block_replicas(shares: dict[str, tuple], dp: int, enc_dps: dict[str, int]) -> set[int]:
    """The LLM replicas whose samples this rank's bridges touch, by the bridges' definition: its LLM replica and
    those sharing an encoder replica with it, and the LLM replicas each of its encoder replicas encodes."""
    def served(e: int, n: int) -> set[int]:  # encoder replica e of n: the LLM replicas whose samples it holds
        return {e * (dp // n) + j for j in range(dp // n)} if n < dp else {e // (n // dp)}

    d, out = shares["language"][0], set()
    if d is not None:
        out.add(d)
        for n in enc_dps.values():
            out |= next(served(e, n) for e in range(n) if d in served(e, n))
    for e, n in enc_dps.items():
        if shares[e][0] is not None:
            out |= served(shares[e][0], n)
    return out


def _local(arrays, indices, cells, shares, cfg):
    """One rank's plan from its cells alone: per microbatch its runs and counts, positions of the whole batch."""
    windows = cells.windows(shares)
    batch = CellBatch.whole(arrays, indices, len(item_starts(indices)), None, cells, windows,
                            step_totals(ShapeColumns.of(arrays)))
    local = batch.shapes
    work = {e: local.tower_sums(e) for e in ENCODERS}
    rows = {e: local.row_sums(e) for e in ENCODERS}
    plans, _ = place(batch, rounded(local.tokens, MULTIPLE), work, rows, {"language": shares["language"],
                     **{e: shares[e] for e in ENCODERS}}, cfg.train.microbatches, cfg.data.tokens_per_microbatch)
    whole = (lambda run: batch.taken[run].tolist()) if batch.taken is not None else (lambda run: list(run))
    return batch, plans, whole


CASES = [  # LLM dp, cell size, microbatches, budget, encoder dps (fan-in, equal, fan-out; blocks spanning cells)
    (4, 1, 2, 256, {"vision": 1, "audio": 8}), (6, 4, 1, 384, {"vision": 2, "audio": 6}),
    (8, 2, 3, 256, {"vision": 2, "audio": 16}), (8, 3, 2, 0, {"vision": 4, "audio": 8}),
    (12, 5, 2, 512, {"vision": 3, "audio": 24}), (4, 2, 4, 0, {"vision": 1, "audio": 4}),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dp,size,m,budget,enc_dps", CASES)
def test_a_ranks_plan_from_its_cells_is_its_slice_of_the_whole_worlds(dp, size, m, budget, enc_dps, seed):
    rng = random.Random(seed * 100 + dp * 10 + size)
    cfg = _cfg(f"--train.microbatches={m}", f"--data.tokens_per_microbatch={budget}", "--train.global_batch_size=8",
               f"--data.balance_replicas={size}")
    arrays, indices = _world(rng, dp, m, budget, pairs=seed % 2 == 1)
    cells = Cells.of(cfg.data.balance_replicas, dp)
    assert len(cells) > 1
    llm, encoders, rows = _global_oracle(arrays, indices, cells, cfg, enc_dps)
    if not budget:  # equal contiguous shares: the cells cut the batch where the whole batch's shares do
        assert llm == split_llm(rounded(arrays.tokens, MULTIPLE).tolist(), rows, dp, cfg, indices.tolist())
    placed = {name: [set() for _ in range(m)] for name in ["language", *ENCODERS]}
    planned_cells = set()
    for shares in _ranks(rng, dp, enc_dps):
        batch, plans, whole = _local(arrays, indices, cells, shares, cfg)
        planned_cells.update(batch.planned)
        # its blocks' cells, not the world's
        assert list(batch.planned) == sorted({cells.cell_of(r) for r in _block_replicas(shares, dp, enc_dps)})
        d = shares["language"][0]
        for k, plan in enumerate(plans):
            if d is not None:
                assert whole(plan.llm) == llm[k][d]
                placed["language"][k].add(d)
            for e, n in enc_dps.items():
                replica = shares[e][0]
                if replica is not None:
                    assert whole(plan.encoders[e]) == encoders[e][k][replica], (shares, e, k)
                    placed[e][k].add(replica)
                counts, total = plan.counts[e], lambda runs, i: sum(rows[e][p] for p in runs[i])
                for side, runs, dps in (("encoder", encoders[e][k], n), ("llm", llm[k], dp)):
                    held = getattr(counts, side)
                    assert len(held) == dps
                    known = [i for r in held.known_runs() for i in r]
                    assert all(held[i] == total(runs, i) for i in known), (side, e, k)
                # the rank's own replicas and their blocks are known; the chunks its bridges move are the world's
                mine = {i for r in counts.encoder.known_runs() for i in r}
                assert replica is None or replica in mine
                assert d is None or d in {i for r in counts.llm.known_runs() for i in r}
        for e, n in enc_dps.items():
            full = [ReplicaRows([sum(rows[e][p] for p in run) for run in encoders[e][k]],
                                [sum(rows[e][p] for p in run) for run in llm[k]]) for k in range(m)]
            mine = {i for r in plans[0].counts[e].encoder.known_runs() for i in r}
            assert step_chunks([p.counts[e] for p in plans]) == [c for c in step_chunks(full) if c.encoder in mine]
    # every replica was planned by some rank: every sample once per module, and the bins fit
    assert planned_cells == set(range(len(cells)))
    everything = sorted(range(len(arrays)))
    assert sorted(p for k in range(m) for run in llm[k] for p in run) == everything
    for e in ENCODERS:
        assert sorted(p for k in range(m) for run in encoders[e][k] for p in run) == everything
        assert all(placed[e][k] == set(range(enc_dps[e])) for k in range(m))
    assert all(placed["language"][k] == set(range(dp)) for k in range(m))
    if budget:
        tokens = rounded(arrays.tokens, MULTIPLE)
        assert max(int(tokens[run].sum()) for k in range(m) for run in llm[k]) <= budget


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("size", [0, 4, 5, 64])
def test_at_dp_up_to_the_cell_size_the_plan_is_the_old_one(size, seed):
    """One cell: the plan of the whole batch, as tests/plan_oracle.py places it, and every replica's counts."""
    rng = random.Random(seed)
    dp, m, budget = 4, 2, 256 if seed % 2 else 0
    cfg = _cfg(f"--train.microbatches={m}", f"--data.tokens_per_microbatch={budget}", "--train.global_batch_size=8",
               f"--data.balance_replicas={size}")
    arrays, indices = _world(rng, dp, m, budget, pairs=seed > 1)
    enc_dps = {"vision": 2, "audio": 8}
    cells = Cells.of(cfg.data.balance_replicas, dp)
    assert cells.single and cells.windows({"language": (0, dp)}) == [range(dp)]
    tokens = rounded(arrays.tokens, MULTIPLE).tolist()
    rows = {e: arrays.row_sums(e).tolist() for e in ENCODERS}
    llm = split_llm(tokens, rows, dp, cfg, indices.tolist())
    for shares in _ranks(rng, dp, enc_dps):
        batch, plans, whole = _local(arrays, indices, cells, shares, cfg)
        assert batch.taken is None and batch.shapes is arrays  # the whole batch, as drawn
        for k, plan in enumerate(plans):
            assert shares["language"][0] is None or plan.llm == llm[k][shares["language"][0]]
            for e, n in enc_dps.items():
                enc = split_encoder(llm[k], rows[e], n)
                assert shares[e][0] is None or plan.encoders[e] == enc[shares[e][0]]
                counts = plan.counts[e]
                assert type(counts.encoder) is list and type(counts.llm) is list  # as the bridges always read
                assert counts == ReplicaRows([sum(rows[e][p] for p in r) for r in enc],
                                             [sum(rows[e][p] for p in r) for r in llm[k]])


def test_cells_and_windows():
    cells = Cells.of(64, 200)
    assert len(cells) == 4 and cells.replicas(3) == range(192, 200) and cells.items(3, 400) == range(384, 400)
    assert Cells.of(0, 200).single and Cells.of(200, 200).single and not Cells.of(199, 200).single
    # LLM replica 70 beside vision fan-out 4 (block 68-71) and an audio replica fanning in to LLM replica 130
    shares = {"language": (70, 200), "vision": (17, 50), "audio": (260, 400)}
    assert cells.windows(shares) == [range(68, 72), range(130, 131)] and cells.cells_of(cells.windows(shares)) == [1, 2]
    # a fan-out block of all 200 LLM replicas spans every cell
    assert cells.cells_of(cells.windows({"language": (None, 200), "vision": (0, 1)})) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match=r"data.balance_replicas.*-1"):
        _cfg("--data.balance_replicas=-1")


def test_known_rows_read_as_the_list_within_their_runs_and_refuse_others():
    rows = KnownRows(10, {2: np.array([5, 6]), 4: np.array([7]), 8: np.array([1, 2])})
    assert len(rows) == 10 and rows[3] == 6 and rows[2:5] == [5, 6, 7] and rows[-1] == 2
    assert rows.known_runs() == [range(2, 5), range(8, 10)]
    with pytest.raises(LookupError, match=r"replica 6's rows are not planned on this rank .*2–4, 8–9 of 10"):
        rows[6]
    with pytest.raises(LookupError):
        rows[3:9]
    with pytest.raises(TypeError):
        sum(rows)  # a sum over every replica would read some it does not hold


class _Items:
    """A dataset of items' shapes (a pair's two when `pairs`): with a shape table, or measured per item."""

    def __init__(self, shapes: dict, sequences: int, table: bool) -> None:
        self.items, self.sequences = shapes, sequences
        if table:
            self.table = ShapeTable(len(shapes), sequences, ENCODERS, self.shape)
            self.table.put(np.arange(len(shapes)), ShapeArrays.of([s for i in range(len(shapes)) for s in shapes[i]],
                                                                  ENCODERS))

    def __len__(self) -> int:
        return len(self.items)

    def shape(self, i: int):
        return self.items[i]


@pytest.mark.parametrize("seed", range(4))
def test_the_table_draw_of_a_ranks_cells_equals_the_draw_measured_whole(seed):
    rng = random.Random(seed)
    pairs = seed % 2 == 1
    k = 2 if pairs else 1
    items = {i: tuple(_shape(rng, 100) for _ in range(k)) for i in range(300)}
    cfg = _cfg("--train.microbatches=2", "--data.tokens_per_microbatch=96", "--data.too_long=skip",
               "--data.balance_replicas=3", "--train.global_batch_size=8")
    dp, counters = 8, {e: None for e in ENCODERS}
    looked_up, measured = (GlobalBatches(_Items(items, k, table), 40, seed) for table in (True, False))
    for batches in (looked_up, measured):
        batches.drop(int(batches.indices(1)[5]))  # a sample found bad before: gone from its cell
    whole = draw(looked_up, 1, cfg, counters, MULTIPLE)  # the reference's: one cell, every sample
    assert len(whole.batch.planned) == 1 and whole.batch.totals.skipped > 0
    assert whole.batch.totals == draw(measured, 1, cfg, counters, MULTIPLE).batch.totals
    seen = []
    for d in range(dp):
        shares = {"language": (d, dp), "vision": (d, dp), "audio": (2 * d + 1, 2 * dp)}
        a, b = (draw(x, 1, cfg, counters, MULTIPLE, shares).batch for x in (looked_up, measured))
        assert a.planned == b.planned == (Cells.of(3, dp).cell_of(d),) and a.totals == whole.batch.totals
        assert a.indices.tolist() == b.indices.tolist() and a.bounds.tolist() == b.bounds.tolist()
        assert [a.shapes.shape(p) for p in range(len(a.shapes))] == [b.shapes.shape(p) for p in range(len(b.shapes))]
        if d % 3 == 0:
            seen += a.indices.tolist()  # once per cell
    assert seen == whole.indices.tolist()  # the cells, side by side, are the whole batch's samples


def test_a_too_long_sample_is_named_alike_from_a_ranks_cells_and_from_the_whole_batch():
    rng = random.Random(7)
    items = {i: (_shape(rng, 100),) for i in range(200)}
    cfg = _cfg("--data.tokens_per_microbatch=64", "--data.balance_replicas=2", "--train.global_batch_size=8")
    batches = GlobalBatches(_Items(items, 1, True), 32, 0)
    with pytest.raises(Exception) as whole:
        draw(batches, 0, cfg, {e: None for e in ENCODERS}, MULTIPLE)
    with pytest.raises(type(whole.value)) as cell:
        draw(batches, 0, cfg, {e: None for e in ENCODERS}, MULTIPLE, {"language": (7, 8), "vision": (7, 8),
                                                                      "audio": (7, 8)})
    assert "data.tokens_per_microbatch = 64" in str(whole.value) and str(cell.value) == str(whole.value)


def test_a_rank_of_a_large_simulated_world_plans_its_two_cells():
    """bench/scale_sim.py's DeepSeek-sized job at 2,048 ranks (fake backend, one process as rank 1,000): LLM dp 128 in
    two cells of 64; rank 1,000 is LLM replica 104 (cell 1) and encodes samples of LLM replica 62 (cell 0), so it
    plans both cells — through the real job's data, shape table, shares and bridges' counts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "bench/scale_sim.py", "--job", "deepseek", "--world", "2048", "--rank",
                          "1000", "--steps", "1"], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.splitlines()[-1])
    assert row["world"] == 2048 and row["global_batch"] == 16 * 128 and row["cells"] == "2 of 2"
    assert row["plan_step_s"] > 0 and row["planning_s"] > 0


def test_a_cell_that_does_not_fit_names_itself_the_key_and_its_numbers():
    """Eight samples of 60 tokens in cell 0 of two (replicas 0-1, 2 bins of 64 tokens): the error says which cell, its
    samples and their tokens, and which keys change it."""
    shapes = [SampleShape(60, 5) for _ in range(8)] + [SampleShape(10, 5) for _ in range(8)]
    arrays, indices = ShapeArrays.of(shapes, []), np.arange(16)
    cells, shares = Cells.of(2, 4), {"language": (0, 4)}
    batch = CellBatch.whole(arrays, indices, 16, None, cells, cells.windows(shares),
                            step_totals(ShapeColumns.of(arrays)))
    with pytest.raises(BatchDoesNotFit) as e:
        place(batch, arrays.tokens, {}, {}, shares, 1, 64)
    assert str(e.value).startswith(
        "planning cell 0 of 2 (LLM replicas 0–1: data.balance_replicas = 2 pack their samples alone; raise it, or 0 "
        "to pack the whole batch at once): cell 0's 8 samples need 480 tokens, more than their bins hold; cell 0's 8 "
        "samples go to 2 LLM replicas × train.microbatches = 1 bins of data.tokens_per_microbatch = 64 (128 tokens)")


def _samples_cfg(*extra: str):
    return load_config(None, [*TINY_MODEL_OVERRIDES, "--data.train_size=64", "--train.global_batch_size=16", *extra])


@pytest.mark.parametrize("budget", [0, 256])
def test_rendered_samples_planned_in_cells(tiny_model, tok, budget):
    """plan_inputs (held-out sets, RL's rollouts: every sample rendered) in cells of one LLM replica at dp 4, vision
    fanning out 2 → 4: each rank's microbatches hold the samples its cells' plan gives it, rendered from the whole
    batch's positions. Without a token budget the cells cut where the whole batch's shares do: the same tensors and
    counts as one cell; with one, every sample once, every bin T tokens, the whole batch's supervised count."""
    g = torch.Generator().manual_seed(3)
    samples = [make_sample(MIXED_SPECS[i % len(MIXED_SPECS)], tiny_model, tok, g) for i in range(16)]
    counters = {n: tiny_model.encoder(n).num_tokens for n in tiny_model.encoder_names}
    ids = list(range(100, 116))
    dp, overrides = 4, ["--train.microbatches=2", f"--data.tokens_per_microbatch={budget}"]
    shares = [{"language": (r, dp), "vision": (r // 2, 2), "audio": (r, dp)} for r in range(dp)]
    plans = {size: [plan_inputs(samples, ids, _samples_cfg(*overrides, f"--data.balance_replicas={size}"), tok,
                                counters, s, 1, torch.device("cpu")) for s in s_list]
             for size, s_list in ((1, shares), (0, shares))}
    reference = collate(samples, _samples_cfg(*overrides), tok)
    images, known = [], {}
    for r, (cells, whole) in enumerate(zip(plans[1], plans[0])):
        assert cells.supervised == whole.supervised == reference.num_supervised and cells.totals == whole.totals
        for k, (a, b) in enumerate(zip(cells.microbatches, whole.microbatches)):
            images += [x.flatten()[:8].tolist() for x in a.encoder_items["vision"]] if r % 2 == 0 else []
            assert a.llm.input_ids.numel() == budget or not budget
            for name in ("vision", "audio"):
                held = sum(tiny_model.encoder(name).num_tokens(x) for x in a.encoder_items[name])
                assert held == a.rows[name].encoder[shares[r][name][0]]  # its own replica's count: what it holds
                for side in ("encoder", "llm"):
                    rows = getattr(a.rows[name], side)
                    for i in (i for run in rows.known_runs() for i in run):  # ranks agree where they meet
                        assert known.setdefault((name, side, k, i), rows[i]) == rows[i]
                        assert budget or rows[i] == getattr(b.rows[name], side)[i]
            if not budget:
                assert torch.equal(a.llm.input_ids, b.llm.input_ids) and torch.equal(a.llm.labels, b.llm.labels)
                assert all(torch.equal(x, y) for x, y in zip(a.encoder_items["vision"], b.encoder_items["vision"]))
                assert a.item_rows == b.item_rows
    assert sum(int((mb.llm.labels != IGNORE_INDEX).sum()) for p in plans[1] for mb in p.microbatches) == \
        reference.num_supervised  # every target once over the ranks
    assert sorted(images) == sorted(x.flatten()[:8].tolist() for s in samples for x in s.images)
