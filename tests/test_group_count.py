"""bench/group_count.py's CPU form (fake backend, 64 ranks in one process), and its group counts against
counts worked out by hand from the two plans' degrees: a set of ranks is one group however many dim sets
(or modules) give it."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _lean_colocated() -> int:
    # vision tp2·dp32, audio dp64, LLM tp4·cp2·pp2·dp4 on ranks 0-63 (LLM rank = 32·pp + 8·dp + 4·cp + tp)
    singles = 64  # the vision's pp and cp dims, the audio's pp, cp and tp: each rank alone
    vision = 2 + 32  # dp (tp fixed): 2 sets of 32; tp: 32 pairs; dp·cp is dp's sets, cp·tp is tp's
    world = 1  # the audio's dp, every grid's pp·dp·cp·tp
    # LLM: tp 64/4, cp 64/2, dp 64/4, pp 64/2, dp·cp 64/8, cp·tp 64/8
    llm = 16 + 32 + 16 + 32 + 8 + 8
    return singles + vision + world + llm


def _every_subset_colocated() -> int:
    # vision: the subsets of its non-trivial dims {dp, tp}: singles, dp's 2, tp's 32, world; audio adds nothing
    vision = 64 + 2 + 32 + 1
    # LLM: 64 / (product of the subset's degrees) sets for each of the 14 proper subsets (the whole: world)
    one = 32 + 16 + 32 + 16  # pp, dp, cp, tp
    two = 8 + 16 + 8 + 8 + 4 + 8  # pp·dp, pp·cp, pp·tp, dp·cp, dp·tp, cp·tp
    three = 4 + 2 + 4 + 2  # pp·dp·cp, pp·dp·tp, pp·cp·tp, dp·cp·tp
    return vision + one + two + three


def _lean_noncolocated() -> int:
    # vision tp2·dp8 and audio dp16 on 0-15; LLM tp4·cp2·pp3·dp2 on the 48 ranks 16-63
    encoders = 16 + 2 + 8 + 1  # singles (pp, cp), vision dp's 2 sets of 8, tp's 8 pairs, ranks 0-15 (audio dp)
    # LLM: tp 48/4, cp 48/2, dp 48/2, pp 48/3, dp·cp 48/4, cp·tp 48/8, all 48 ranks
    llm = 12 + 24 + 24 + 16 + 12 + 6 + 1
    return encoders + llm


def _every_subset_noncolocated() -> int:
    encoders = 16 + 2 + 8 + 1
    # LLM (pp3, dp2, cp2, tp4): 48 / (product of the subset's degrees) sets per proper subset, then all 48
    one = 48 // 3 + 48 // 2 + 48 // 2 + 48 // 4  # pp, dp, cp, tp
    two = 48 // 6 + 48 // 6 + 48 // 12 + 48 // 4 + 48 // 8 + 48 // 8  # pp·dp, pp·cp, pp·tp, dp·cp, dp·tp, cp·tp
    three = 48 // 12 + 48 // 24 + 48 // 24 + 48 // 16  # pp·dp·cp, pp·dp·tp, pp·cp·tp, dp·cp·tp
    return encoders + one + two + three + 1


def test_group_count_by_hand():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "bench/group_count.py", "--repeats", "1"], capture_output=True, text=True,
                         timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["plan"], r["registry"]): r for r in map(json.loads, out.stdout.splitlines())}
    assert rows[("colocated", "lean")]["groups"] == _lean_colocated()
    assert rows[("colocated", "every-subset")]["groups"] == _every_subset_colocated()
    assert rows[("noncolocated", "lean")]["groups"] == _lean_noncolocated()
    assert rows[("noncolocated", "every-subset")]["groups"] == _every_subset_noncolocated()
    assert rows[("colocated", "lean")]["single_rank_groups"] == 64  # every rank alone, as counted above
    assert all(r["startup_s"] > 0 for r in rows.values())
