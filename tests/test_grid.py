"""Grids, roles and `loom plan`: coordinates by hand-computed expectations, and process groups on 8 gloo
ranks where a collective on each group must touch exactly the expected ranks; a dim set outside
GROUP_DIMS has no group."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from loom.job import load_config
from loom.topology import DIMS, GROUP_DIMS, Topology
from loom.topology.groups import MissingGroupError


# what any pipelined LLM needs to validate: fixed-shape microbatches, M ≥ pp, no tie across stages
PIPELINE_READY = ["--data.tokens_per_microbatch=1024", "--train.microbatches=8"]


def plan(world: int, *overrides: str) -> Topology:
    return Topology.plan(load_config(None, PIPELINE_READY + list(overrides)), world)


def expected_coord(rank: int, start: int, tp: int, cp: int, pp: int, dp: int) -> dict[str, int]:
    """tp fastest, then cp, dp, pp — written out by hand as mixed-radix digits."""
    r = rank - start
    return {"tp": r % tp, "cp": (r // tp) % cp, "dp": (r // (tp * cp)) % dp, "pp": r // (tp * cp * dp)}


@pytest.mark.parametrize("tp,cp,pp", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)])
def test_coordinates_and_inverse(tp, cp, pp):
    topo = plan(8, f"--layout.language.tp={tp}", f"--layout.language.cp={cp}", f"--layout.language.pp={pp}",
                "--data.pad_to_multiple=8", "--train.global_batch_size=8")
    grid, dp = topo.grids["language"], 8 // (tp * cp * pp)
    for rank in range(8):
        c = grid.coord(rank)
        assert c == expected_coord(rank, 0, tp, cp, pp, dp)
        assert grid.rank_at(**c) == rank


def test_rank_sets_partition_the_grid_and_vary_only_along_their_dims():
    grid = plan(8, "--layout.language.tp=2", "--layout.language.pp=2").grids["language"]
    for dims in (c for n in range(1, len(DIMS) + 1) for c in itertools.combinations(DIMS, n)):
        sets = grid.rank_sets(*dims)
        assert sorted(itertools.chain(*sets)) == list(range(8))
        for ranks in sets:
            coords = [grid.coord(r) for r in ranks]
            for d in DIMS:
                if d not in dims:
                    assert len({c[d] for c in coords}) == 1, (dims, ranks)
            assert len(ranks) == _prod(grid.layout.degree(d) for d in dims)


def test_partition_key_is_equal_exactly_when_the_rank_sets_are():
    """Every dim subset of every layout of 16 ranks (and of two range starts): two partitions share a key iff their
    rank sets are equal, and members() is each rank's set of rank_sets()."""
    grids = [plan(16, *(f"--layout.language.{d}={n}" for d, n in zip(("tp", "cp", "pp"), degrees)),
                  "--data.pad_to_multiple=16", "--train.global_batch_size=16").grids["language"]
             for degrees in itertools.product((1, 2, 4), repeat=3) if 16 % _prod(degrees) == 0]
    seen: dict[tuple, frozenset] = {}
    for grid in grids:
        for dims in (c for n in range(1, len(DIMS) + 1) for c in itertools.combinations(DIMS, n)):
            sets = frozenset(grid.rank_sets(*dims))
            assert seen.setdefault(grid.partition_key(*dims), sets) == sets, (grid.layout.describe(), dims)
            assert all(grid.members(r, *dims) in sets for r in range(16))
    assert len(set(seen.values())) == len(seen)  # unequal keys: unequal partitions
    other = plan(8, '--layout.vision.ranks="0-3"', '--layout.audio.ranks="0-3"', '--layout.language.ranks="4-7"',
                 "--train.global_batch_size=8").grids
    assert other["vision"].partition_key("dp") != other["language"].partition_key("dp")


def test_contains_and_outside_rank():
    topo = plan(8, '--layout.vision.ranks="0-1"', '--layout.audio.ranks="0-1"', '--layout.language.ranks="2-7"',
                "--train.global_batch_size=12")
    grid = topo.grids["language"]
    assert grid.contains(2) and not grid.contains(1)
    assert isinstance(grid.contains(2), bool)
    with pytest.raises(ValueError, match="rank 1 is not in the language grid"):
        grid.coord(1)
    assert grid.coord(2) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}


def test_roles_colocated():
    topo = plan(4, "--layout.language.pp=2")
    for rank in range(4):
        role = topo.role(rank)
        assert role.modules == ("vision", "audio", "language")
        stage = role.stage("language")
        assert stage.index == rank // 2 and stage.count == 2
        assert stage.is_first == (rank < 2) and stage.is_last == (rank >= 2)
        assert role.stage("vision").is_first and role.stage("vision").is_last


def test_roles_noncolocated():
    topo = plan(8, '--layout.vision.ranks="0-1"', '--layout.audio.ranks="0-1"', '--layout.language.ranks="2-7"',
                "--layout.language.tp=2", "--layout.language.pp=3")
    for rank in (0, 1):
        role = topo.role(rank)
        assert role.modules == ("vision", "audio") and not role.hosts("language")
        with pytest.raises(KeyError, match="does not host 'language'"):
            role.stage("language")
    for rank in range(2, 8):
        role = topo.role(rank)
        assert role.modules == ("language",)
        assert role.stage("language").index == (rank - 2) // 2


def test_plan_on_example_configs(tmp_path, capsys):
    from loom.cli import main

    for name in ("colocated", "noncolocated"):
        png = tmp_path / f"{name}.png"
        assert main(["plan", f"configs/{name}.toml", "--png", str(png)]) == 0
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000
    out = capsys.readouterr().out
    assert "non-colocated" in out and "stage 2/3" in out


# ---------------------------------------------------------------- 8 gloo ranks


def _groups_touch_expected_ranks(overrides: list[str]) -> dict:
    """Every rank: for every grid and listed dim set, all-gather the rank ids over the group; and ask for one
    dim set that is not listed."""
    cfg = load_config(None, overrides)
    topo = Topology.build(cfg)
    me = dist.get_rank()
    seen, stand_ins = {}, []
    for name, grid in topo.grids.items():
        if not grid.contains(me):
            continue
        for dims in GROUP_DIMS:
            group = grid.group(*dims)
            if grid.size(*dims) == 1:  # the stand-in: no communicator, and a collective on it raises
                try:
                    dist.all_reduce(torch.zeros(1), group=group)
                    raised = False
                except RuntimeError:
                    raised = True
                stand_ins.append((group.size(), raised, id(group)))
                seen[(name, dims)] = (me,)
                continue
            out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
            dist.all_gather(out, torch.tensor([me]), group=group)
            seen[(name, dims)] = tuple(int(t) for t in out)
    lang = topo.grids["language"]
    mesh = lang.mesh("dp", "tp") if lang.contains(me) else None
    mesh_shape = tuple(mesh.shape) if mesh is not None else None
    missing = ""
    if lang.contains(me):
        try:
            lang.group("pp", "tp")
        except MissingGroupError as e:
            missing = str(e)
    return {"seen": seen, "mesh_shape": mesh_shape, "role": topo.role(me).modules, "missing": missing,
            "stand_ins": stand_ins, "held": topo.registry.held()}


LAYOUTS_8 = {
    "colocated": PIPELINE_READY + ["--layout.vision.tp=1", "--layout.audio.tp=2", "--layout.language.tp=2",
                                   "--layout.language.pp=2"],
    "noncolocated": PIPELINE_READY + ['--layout.vision.ranks="0-1"', "--layout.vision.tp=2",
                                      '--layout.audio.ranks="0-1"', '--layout.language.ranks="2-7"',
                                      "--layout.language.tp=2", "--layout.language.pp=3"],
}
# by hand from LAYOUTS_8: module → (its ranks, tp, cp, pp, dp); dp = ranks / (tp · cp · pp)
GRIDS_8 = {
    "colocated": {"vision": (range(8), 1, 1, 1, 8), "audio": (range(8), 2, 1, 1, 4),
                  "language": (range(8), 2, 1, 2, 2)},
    "noncolocated": {"vision": (range(2), 2, 1, 1, 1), "audio": (range(2), 1, 1, 1, 2),
                     "language": (range(2, 8), 2, 1, 3, 1)},
}


@pytest.mark.parametrize("name", list(LAYOUTS_8))
def test_groups_on_8_ranks(worlds, name):
    results = worlds.run(8, _groups_touch_expected_ranks, LAYOUTS_8[name])
    grids = GRIDS_8[name]
    for rank, res in enumerate(results):
        hosted = {m for m, (ranks, *_) in grids.items() if rank in ranks}
        assert set(res["role"]) == hosted  # Role.modules follows grid order, which is no contract
        assert {m for m, _ in res["seen"]} == hosted
        for (module, dims), members in res["seen"].items():
            ranks, *degrees = grids[module]
            # the ranks equal to me in every dim outside `dims`, by hand-computed coordinates
            mine = expected_coord(rank, ranks[0], *degrees)
            expected = [r for r in ranks
                        if all(expected_coord(r, ranks[0], *degrees)[d] == mine[d] for d in DIMS if d not in dims)]
            assert sorted(members) == expected, (rank, module, dims)
        # a degree-1 dim set: one stand-in per rank, of one rank, whose collectives raise
        assert {(size, raised) for size, raised, _ in res["stand_ins"]} <= {(1, True)}
        assert len({i for *_, i in res["stand_ins"]}) <= 1
        # the groups held: one per distinct set of more than one rank that this rank is in
        assert res["held"] == len({m for m in res["seen"].values() if len(m) > 1}), (rank, res["held"])
        if "language" in hosted:
            _, tp, _, _, dp = grids["language"]
            assert res["mesh_shape"] == (dp, tp)
            # not listed in GROUP_DIMS (its rank sets may well exist for other dims): an error saying where to add it
            assert "language grid has no process group over dims ('pp', 'tp')" in res["missing"]
            assert "GROUP_DIMS in loom/topology/groups.py" in res["missing"]


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def test_plan_says_which_ranks_each_encoder_replica_feeds():
    """LLM pp2·dp2 on 4 ranks: pp outermost, so its stage-0 ranks are 0 (replica 0) and 1 (replica 1)."""
    from loom.topology.plan import bridge_lines

    fan_in = bridge_lines(plan(4, "--layout.language.pp=2", "--layout.vision.tp=1", "--layout.audio.tp=1"))
    assert [line for line in fan_in if line.startswith("vision")] == [
        "vision replica 0 (ranks [0]) → LLM replica 0 stage 0 on ranks [0]",
        "vision replica 1 (ranks [1]) → LLM replica 0 stage 0 on ranks [0]",
        "vision replica 2 (ranks [2]) → LLM replica 1 stage 0 on ranks [1]",
        "vision replica 3 (ranks [3]) → LLM replica 1 stage 0 on ranks [1]",
    ]
    fan_out = bridge_lines(plan(4, "--layout.language.pp=2", "--layout.vision.tp=4", "--layout.audio.tp=1"))
    assert fan_out[0] == ("vision replica 0 (ranks [0, 1, 2, 3]) → LLM replica 0 stage 0 on ranks [0]; "
                          "LLM replica 1 stage 0 on ranks [1]")
