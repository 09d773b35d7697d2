"""HSDP (`[layout.<module>] shard = S`, parallel/hsdp.py): FSDP2 over runs of S of a module's dp·cp ranks, replicated
across the runs, equals the one-process reference; its groups are the registry's, and a bad S is refused when the
config loads, naming the key, the module and the numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from oracle import assert_all_passed, run_verify

from loom.config import ConfigError
from loom.job import load_config

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    # the LLM at dp4 as 2 replicas × 2 shards (reduce-scatter within a run, all-reduce across), two microbatches
    # (the gradients accumulate before the step's one reduction); the vision tower at tp2·dp2 as 2 replicas of one
    # shard beside it (TP's DTensors under the HSDP root)
    "llm-hsdp-2x2-mb2-vision-tp2-hsdp-2x1": (4, ["--layout.language.shard=2", "--layout.vision.tp=2",
                                                 "--layout.vision.shard=1", "--train.microbatches=2"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hsdp_layout_matches_reference(worlds, name):
    world, overrides = CASES[name]
    assert_all_passed(name, worlds.run(world, run_verify, overrides, timeout=300), 3)


def _load(overrides: list[str], world: int = 4):
    return load_config(None, ["--train.global_batch_size=16", "--data.train_size=2000", *overrides], world_size=world)


@pytest.mark.parametrize("overrides, says", [
    (["--layout.language.shard=3"], "layout.language.shard = 3 does not divide language's dp·cp = 4·1 = 4 ranks"),
    (["--layout.language.cp=2", "--layout.language.shard=8", "--data.pad_to_multiple=4"],
     "layout.language.shard = 8 does not divide language's dp·cp = 2·2 = 4 ranks"),
    (["--layout.audio.shard=-1"], "layout.audio.shard = -1 must be ≥ 1"),
    (["--layout.audio.shard=2", "--layout.audio.fsdp=false"], "layout.audio.shard = 2 with layout.audio.fsdp = false"),
])
def test_bad_shard_is_refused_at_load(overrides, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        _load(overrides)


def test_shard_groups_are_runs_and_replicas_from_the_registry():
    """A fake 16-rank world (rank 5), the LLM at tp2·cp2·dp4 with shard 4: dp×cp (8 ranks a tp coordinate) in runs
    of 4. Rank 5 (dp1, cp0, tp1) shards with the tp-1 ranks of dp0-1 and is replicated on its place in the other
    run; the mesh holds exactly those groups, and TP's mesh is the same root's."""
    script = textwrap.dedent("""
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from loom.job import load_config
        from loom.parallel.fsdp import fsdp_mesh, tp_mesh
        from loom.topology import Topology
        from loom.parallel.hsdp import add_shard_groups

        dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
        cfg = load_config(None, ["--layout.language.tp=2", "--layout.language.cp=2", "--layout.language.shard=4",
                                 "--data.pad_to_multiple=4", "--train.global_batch_size=16"], world_size=16)
        topo = Topology.build(cfg)
        before = topo.registry.created
        add_shard_groups(topo)
        grid = topo.grids["language"]
        mesh = fsdp_mesh(grid, "cpu")
        assert mesh.mesh_dim_names == ("replicate", "shard"), mesh
        assert mesh.mesh.tolist() == [[1, 3, 5, 7], [9, 11, 13, 15]], mesh.mesh
        assert mesh["shard"].get_group().size() == 4 and mesh["replicate"].get_group().size() == 2
        assert tp_mesh(grid, "cpu").mesh.tolist() == [4, 5]
        assert tp_mesh(grid, "cpu")._get_root_mesh() is mesh._get_root_mesh()
        # the LLM's runs and replicas: two partitions; audio at dp16 has no shard (none of its own)
        assert topo.registry.created - before == 2, topo.registry.created - before
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]
