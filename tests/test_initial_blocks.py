"""models/init.py: a large tensor's initial value is drawn in blocks of rows, each seeded by (seed, name, block),
and a rank draws only the blocks its part overlaps — the same values for any part as the whole draw has there."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import loom.models.init as init
from loom.models.init import initial_value, name_seed


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 elements, so a test-sized tensor spans several; every seed drawn recorded."""
    monkeypatch.setattr(init, "DRAW_BLOCK", 64)
    drawn = []
    seed_of = init.name_seed
    monkeypatch.setattr(init, "name_seed", lambda seed, name: drawn.append(name) or seed_of(seed, name))
    return drawn


def _value(owner: nn.Module, shape, box=None, std=0.02):
    return initial_value("language.w", owner, "weight", torch.Size(shape), 7, torch.device("cpu"), std, box)


def test_any_part_equals_the_whole_draw_there(small_blocks):
    lin = nn.Linear(16, 40, device="meta")  # [40, 16]: 4 rows per block, 10 blocks
    whole = _value(lin, (40, 16))
    for box in [(slice(0, 40), slice(0, 16)), (slice(10, 20), slice(0, 16)), (slice(0, 40), slice(8, 16)),
                (slice(3, 37), slice(5, 11)), (slice(39, 40), slice(0, 1))]:
        assert torch.equal(_value(lin, (40, 16), box), whole[box]), box
    experts = nn.Embedding(6, 4, device="meta")  # a 3-D stacked weight: rows of 4 × 8 = 32 elements, 2 per block
    whole3 = initial_value("e", experts, "weight", torch.Size((6, 4, 8)), 0, torch.device("cpu"), None)
    box3 = (slice(1, 5), slice(2, 4), slice(0, 8))
    assert torch.equal(initial_value("e", experts, "weight", torch.Size((6, 4, 8)), 0, torch.device("cpu"), None,
                                     box3), whole3[box3])


def test_a_part_draws_only_the_blocks_it_overlaps(small_blocks):
    lin = nn.Linear(16, 40, device="meta")
    _value(lin, (40, 16), (slice(10, 20), slice(0, 16)))  # rows 10-19: blocks 2, 3, 4 (4 rows each)
    assert small_blocks == ["language.w#2", "language.w#3", "language.w#4"]


def test_blocks_are_independent_draws_of_the_rule(small_blocks):
    lin = nn.Linear(16, 4000, device="meta")
    whole = _value(lin, (4000, 16))
    assert not torch.equal(whole[0:4], whole[4:8])  # not one stream repeated per block
    assert abs(whole.std().item() - 0.02) < 0.001 and abs(whole.mean().item()) < 0.001


def test_a_tensor_of_one_block_is_one_draw_as_before():
    """Up to DRAW_BLOCK elements (every tensor of the tiny models) the value is one draw seeded by (seed, name):
    the initial weights those models had before blocks existed."""
    lin = nn.Linear(16, 40, device="meta")
    gen = torch.Generator().manual_seed(name_seed(7, "language.w"))
    expected = torch.empty(40, 16).normal_(0.0, 0.02, generator=gen)
    assert torch.equal(_value(lin, (40, 16)), expected)


def _verify_with_small_blocks(overrides: list[str]) -> list[dict]:
    """run_verify with blocks of 64 elements: every weight of the tiny model spans several blocks."""
    from oracle import run_verify

    block, init.DRAW_BLOCK = init.DRAW_BLOCK, 64
    try:
        return run_verify(overrides, 1)
    finally:
        init.DRAW_BLOCK = block


def test_every_layout_starts_from_the_reference_weights_drawn_in_blocks(worlds):
    """dp2·tp2 (+ SP): FSDP2's row shards and TP's column shards each draw their blocks; loom verify compares the
    start bitwise with the one-process reference, which draws every block, before its step."""
    from oracle import assert_all_passed

    overrides = ["--layout.vision.tp=2", "--layout.audio.tp=2", "--layout.language.tp=2",
                 "--layout.language.sequence_parallel=true", "--data.pad_to_multiple=2"]
    assert_all_passed("dp2xtp2-blocks", worlds.run(4, _verify_with_small_blocks, overrides, timeout=300), 1)


@pytest.mark.parametrize("box", [(slice(0, 40), slice(0, 16)), (slice(8, 20), slice(0, 16)),
                                 (slice(10, 21), slice(0, 16)), (slice(3, 37), slice(5, 11))])
def test_a_part_written_into_a_tensor_is_the_part_drawn_apart(small_blocks, box):
    """`out`: the blocks wholly inside the box are drawn in place, those its edges cut apart then copied; either
    way the values are those of a new tensor (and so of the whole draw), and `out` itself comes back."""
    lin = nn.Linear(16, 40, device="meta")  # 4 rows per block: boxes aligned to blocks, cut by them, and columns
    apart = _value(lin, (40, 16), box)
    into = torch.full(apart.shape, float("nan"))
    got = initial_value("language.w", lin, "weight", torch.Size((40, 16)), 7, torch.device("cpu"), 0.02, box, into)
    assert got is into and torch.equal(into, apart)
    norm = nn.LayerNorm(16, device="meta")  # not drawn: ones and zeros, written in place too
    ones = torch.empty(16)
    assert initial_value("n", norm, "weight", torch.Size((16,)), 7, torch.device("cpu"), None, None, ones) is ones
    assert torch.equal(ones, torch.ones(16))


def test_a_rank_draws_its_shard_alone_in_place():
    """bench/init_memory.py's case in small: rank 0 of 8 ranks, FSDP2 over all 8, materialises its 2 experts of a
    [16, 2048, 7168] tensor (112 MiB of 896). The generators draw the shard's rows only (a whole draw: 8×), and the
    process's peak while it does is the shard plus a little — drawing into a new tensor and copying it into the
    rank's own would peak at 2 shards (the code before the bench), the whole tensor at 9."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "bench/init_memory.py", "--world", "8", "--split", "fsdp", "--experts",
                          "16"], cwd=root, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout.strip().splitlines()[-1])
    assert row["shard_rows"] == [0, 2] and row["shard_mib"] == 112.0
    assert row["drawn_mib"] == row["shard_mib"], row
    assert row["peak_over_shard"] < 1.5, row


def test_a_part_is_written_only_into_fp32_of_its_shape():
    lin = nn.Linear(16, 40, device="meta")
    for wrong in (torch.empty(10, 16, dtype=torch.bfloat16), torch.empty(9, 16)):
        with pytest.raises(RuntimeError, match="fp32 of the part's shape only"):
            initial_value("language.w", lin, "weight", torch.Size((40, 16)), 7, torch.device("cpu"), 0.02,
                          (slice(0, 10), slice(0, 16)), wrong)
