"""bench/scale_sim.py's 64-rank form (fake backend, one process posing as rank 0): both jobs start and plan a step,
and rank 0 holds exactly one group per partition of more than one rank that it is in — counted by hand from the
layouts' degrees — and none of one rank; its DeviceMeshes share one copy of their rank map. Timings are the
bench's business, not this test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# by hand, rank 0 of 64 (ranks are [pp, dp, cp, tp] row-major, tp fastest):
HELD = {
    # vision tp2·dp32: its tp pair (0, 1), its dp set (0, 2, …, 62); all 64 (the vision grid, the audio's dp64 and the
    # LLM's dp64 are that one set); every other dim set is of degree 1 (no group) or one of these
    "mm2b": [2, 32, 64],
    # LLM pp16·dp4 (ep4 = dp·cp: efsdp 1, no group): its pp set (0, 4, …, 60), its dp set (0-3), its EP group
    # (0-3 again, a named group of its own), all 64 (the encoders' dp64 and the LLM grid)
    "deepseek": [4, 4, 16, 64],
    # mm2b under HSDP (shard = 8): the same three, plus the vision grid's run of 8 along its dp (0, 2, …, 14) and that
    # place's replicas (0, 16, 32, 48), and the run (0-7) and replicas (0, 8, …, 56) the audio and the LLM share (one
    # layout, one shard: one pair of groups)
    "mm2b-hsdp8": [2, 4, 8, 8, 8, 32, 64],
}


def test_scale_sim_at_64_ranks():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "bench/scale_sim.py", "--table", "--worlds", "64", "--steps", "1"],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["job"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert set(rows) == set(HELD)
    for job, sizes in HELD.items():
        row = rows[job]
        assert row["world"] == 64 and row["rank"] == 0
        assert row["held_sizes"] == sizes, (job, row["held_sizes"])
        assert row["groups_held"] == len(sizes) and row["single_rank_groups"] == 0
        assert row["world_calls"] == len(sizes)  # rank 0 is in a set of every partition made
        per_replica = {"mm2b": 2 * 64, "deepseek": 16 * 4, "mm2b-hsdp8": 2 * 64}
        assert row["global_batch"] == per_replica[job]  # per replica × the LLM's dp
        assert row["plan_step_s"] > 0 and row["startup_s"] > 0
        # FSDP2 makes DeviceMeshes per parameter (TP's dp+tp concatenation), each of which kept its own tuple of
        # the whole rank map; shared (topology/rank_maps.py), every mesh of these colocated jobs (all grids over
        # ranks 0-63) holds the one copy: what a rank keeps no longer grows with meshes × world
        assert row["meshes"] >= {"mm2b": 300, "deepseek": 5, "mm2b-hsdp8": 300}[job], (job, row["meshes"])
        assert row["rank_map_copies"] == 1, (job, row["rank_map_copies"])
    # HSDP's shard slice: one per (replicate, shard) mesh (parallel/fsdp_shard_mesh.py), not per parameter (1,184)
    hsdp_meshes, fsdp_meshes = rows["mm2b-hsdp8"]["meshes"], rows["mm2b"]["meshes"]
    assert hsdp_meshes < fsdp_meshes + 50, (hsdp_meshes, fsdp_meshes)
