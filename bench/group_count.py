"""Process groups created at start-up and the time it takes, for 64-rank plans, on CPU with the fake backend.

    python bench/group_count.py [--rank R]

For each plan, two registries: "every-subset" (the groups of all 15 non-empty subsets of the grid dims, what
loom did before GROUP_DIMS) and "lean" (GROUP_DIMS only). This one process plays rank R of a 64-rank world on
the fake backend (`dist.init_process_group("fake")`: no communication, so the time is the host's cost of the
registry's calls and the grid arithmetic). Each partition of a grid's ranks along a dim set is one world-wide
call (`split_group` on NCCL, the enumeration here: topology/partitions.py); a dim set of degree 1 makes none.
Prints one JSON line per (plan, registry): world-wide calls made, groups this rank holds (its communicators
under NCCL), how many of those have a single rank (none: a rank alone gets a stand-in without one), and the
start-up time (Topology.plan + the registry's build: what Topology.build does), the median of --repeats
start-ups, each on a fresh world.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

# 64 ranks, every module with its own layout
PLANS = {
    # vision tp2·dp32, audio dp64, LLM tp4·cp2·pp2·dp4, all on ranks 0-63
    "colocated": ["--layout.vision.tp=2", "--layout.audio.tp=1", "--layout.language.tp=4",
                  "--layout.language.cp=2", "--layout.language.pp=2"],
    # vision tp2·dp8 and audio dp16 on ranks 0-15, LLM tp4·cp2·pp3·dp2 on 16-63 (its dp divides theirs)
    "noncolocated": ['--layout.vision.ranks="0-15"', "--layout.vision.tp=2", '--layout.audio.ranks="0-15"',
                     '--layout.language.ranks="16-63"', "--layout.language.tp=4", "--layout.language.cp=2",
                     "--layout.language.pp=3"],
}
COMMON = ["--model.language.num_heads=8", "--model.language.num_kv_heads=4", "--model.language.tie_embeddings=false",
          "--data.tokens_per_microbatch=1024", "--train.microbatches=4", "--train.global_batch_size=192"]
WORLD = 64
REGISTRIES = ("every-subset", "lean")


def every_subset() -> tuple[tuple[str, ...], ...]:
    from loom.topology import DIMS

    return tuple(c for n in range(1, len(DIMS) + 1) for c in itertools.combinations(DIMS, n))


def measure(plan: str, registry: str, rank: int, repeats: int) -> dict:
    """In this process: `repeats` start-ups of `plan` as `rank` of a fake 64-rank world."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loom.job import load_config
    from loom.topology import GroupRegistry, Topology

    cfg = load_config(None, COMMON + PLANS[plan], world_size=WORLD)
    dim_sets = every_subset() if registry == "every-subset" else None
    times = []
    for _ in range(repeats):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
        t0 = time.perf_counter()
        topo = Topology.plan(cfg, WORLD)  # what Topology.build does, with the registry chosen here
        reg = GroupRegistry(dim_sets)
        reg.build(list(topo.grids.values()))
        times.append(time.perf_counter() - t0)
        single = sum(g.size() == 1 for g in held_groups())
        GroupRegistry.destroy_all()
        dist.destroy_process_group()
    return {"bench": "group_count", "plan": plan, "registry": registry, "world": WORLD, "rank": rank,
            "dim_sets": len(reg.dim_sets), "world_calls": reg.created, "held": reg.held(),
            "single_rank_groups": single, "startup_s": round(statistics.median(times), 4), "repeats": repeats}


def held_groups() -> list:
    """Every group this process holds now (the registry's, none of them a stand-in)."""
    from loom.topology import groups

    return list(groups._ALL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=0, help="the rank this process plays")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    for plan in PLANS:
        for registry in REGISTRIES:
            print(json.dumps(measure(plan, registry, args.rank, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
