"""bench/group_count.py's CPU form (fake backend, 64 ranks in one process), and its counts against counts worked
out by hand from the two plans' degrees: one world-wide call per partition of a grid's ranks along a dim set,
none for a dim set of degree 1, none for a partition equal to an earlier one (however many dim sets or modules
give it); a rank holds a group for each partition it is in, and none of one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# a partition is named by its sets' (stride, degree) runs over the grid's ranks, as Grid.partition_key merges them


def _lean_colocated() -> int:
    # vision tp2·dp32, audio dp64, LLM tp4·cp2·pp2·dp4 on ranks 0-63 (LLM rank = 32·pp + 8·dp + 4·cp + tp)
    vision = 3  # dp (32 ranks, stride 2), tp (pairs), all 64; its pp, cp are degree 1; dp·cp is dp, cp·tp is tp
    audio = 0  # its dp is all 64 ranks (the vision's last); the rest degree 1 or the same
    llm = 6  # tp, cp, dp, pp, dp·cp, cp·tp (runs of 8); all 64 is the vision's
    return vision + audio + llm


def _every_subset_colocated() -> int:
    vision = 3  # the subsets of its non-trivial dims {dp, tp}: dp, tp, both (all 64)
    llm = 14  # its 15 subsets, all of degree > 1, none equal to the vision's but the whole grid
    return vision + llm


def _lean_noncolocated() -> int:
    # vision tp2·dp8 and audio dp16 on 0-15; LLM tp4·cp2·pp3·dp2 on the 48 ranks 16-63
    encoders = 3  # vision dp (8 ranks, stride 2), tp (pairs), ranks 0-15 (the audio's dp too)
    llm = 7  # tp, cp, dp, pp, dp·cp, cp·tp, all 48: every one of degree > 1
    return encoders + llm


def _every_subset_noncolocated() -> int:
    return 3 + 15  # the encoders' as above; the LLM's 15 subsets, each its own partition


def test_group_count_by_hand():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "bench/group_count.py", "--repeats", "1"], capture_output=True, text=True,
                         timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["plan"], r["registry"]): r for r in map(json.loads, out.stdout.splitlines())}
    assert rows[("colocated", "lean")]["world_calls"] == _lean_colocated()
    assert rows[("colocated", "every-subset")]["world_calls"] == _every_subset_colocated()
    assert rows[("noncolocated", "lean")]["world_calls"] == _lean_noncolocated()
    assert rows[("noncolocated", "every-subset")]["world_calls"] == _every_subset_noncolocated()
    # rank 0 is in every colocated partition, and in the encoders' 3 of the non-colocated plan
    assert rows[("colocated", "lean")]["held"] == _lean_colocated()
    assert rows[("noncolocated", "lean")]["held"] == 3
    assert all(r["single_rank_groups"] == 0 for r in rows.values())
    assert all(r["startup_s"] > 0 for r in rows.values())
