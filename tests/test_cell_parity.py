"""Layouts whose LLM dp exceeds data.balance_replicas, so each rank plans only its planning cells
(train/plan_cells.py) and its bridges read only its blocks' row counts (bridge/known_rows.py), still equal the
one-process reference, which trains on the whole batch: the same samples, whichever replica packs them. On 4 gloo
ranks, cells of 1 or 2 LLM replicas: the colocated bridge's fan-out (a block spanning cells) and fan-in, the
first-stage bridge of a pipelined LLM (a rank whose encoder replica and LLM replica lie in different cells), the
point-to-point bridge, and too-long samples skipped cell by cell.
"""

from __future__ import annotations

import pytest
from oracle import assert_all_passed, run_verify


def cells(size: int, m: int = 2, tokens: int = 512) -> list[str]:
    return [f"--data.balance_replicas={size}", f"--train.microbatches={m}", f"--data.tokens_per_microbatch={tokens}"]


def placed(encoders: str, llm: str, **degrees: int) -> list[str]:
    out = [f"--layout.vision.ranks={encoders}", f"--layout.audio.ranks={encoders}", f"--layout.language.ranks={llm}"]
    return out + [f"--layout.{key.replace('_', '.')}={value}" for key, value in degrees.items()]


LAYOUTS = {
    # vision dp1 feeds all 4 LLM replicas: its block spans the 4 cells, so every rank plans them all
    "vision-fan-out-over-4-cells": (cells(1) + ["--layout.vision.tp=4"], 3),
    # vision dp2 fans out to LLM replicas {0, 1} and {2, 3}: one cell each; audio dp4 equal; samples skipped
    "cells-of-2-fan-out-and-equal-skip-too-long": (cells(2, 4, 256) + ["--layout.vision.tp=2",
                                                                       "--layout.audio.tp=1",
                                                                       "--train.global_batch_size=16",
                                                                       "--data.too_long=skip"], 3),
    "fan-in-llm-dp2-cells-of-1": (cells(1) + ["--layout.vision.tp=1", "--layout.language.tp=2"], 3),
    # encoders dp4 on every rank, LLM pp2 · dp2: rank 2 is LLM replica 0 (stage 1) and encodes replica 1's samples
    "first-stage-encoders-dp4-llm-pp2xdp2-cells-of-1": (cells(1, 4, 256) + [
        "--layout.language.pp=2", "--parallel.pp_schedule=1f1b", "--layout.vision.tp=1", "--layout.audio.tp=1"], 2),
    # encoders on ranks 0-1 (vision dp1 fans out over both cells, audio dp2 equal), the LLM dp2 on ranks 2-3
    "noncolocated-cells-of-1": (cells(1) + placed("0-1", "2-3", vision_tp=2), 2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planning_cells_match_the_reference(worlds, name):
    overrides, steps = LAYOUTS[name]
    assert_all_passed(name, worlds.run(4, run_verify, overrides, steps, timeout=300), steps)
