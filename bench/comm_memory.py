"""GPU memory a rank's NCCL communicators hold (issue 50, target 2), measured where the estimate in RESULTS.md
guessed: the device's used memory (`torch.cuda.mem_get_info`, which sees NCCL's own allocations, not only torch's
caching allocator) before and after each group's first collective of each kind.

    torchrun --standalone --nproc-per-node=4 bench/comm_memory.py [--set KEY=VALUE ...]

The groups are loom's own for the config (default: loom/default.toml's layouts on the world): Topology.build, then
for each group this rank holds, one all-reduce, all-gather, reduce-scatter and all-to-all of a few bytes — NCCL
connects each kind's channels at its first call. The world's communicator is measured the same way first.
Prints one JSON line per rank: the groups (sizes) and the MiB each kind of first call added.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from loom.distributed import init_distributed
from loom.job import load_config
from loom.topology import Topology
from loom.topology import groups as group_registry

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _used_mib() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def _first_calls(group: dist.ProcessGroup, device: torch.device) -> dict[str, float]:
    """MiB of device memory each kind's first collective on `group` added."""
    n = group.size()
    added = {}
    for kind in KINDS:
        before = _used_mib()
        x = torch.ones(n * 4, device=device)
        if kind == "all_reduce":
            dist.all_reduce(x, group=group)
        elif kind == "all_gather":
            dist.all_gather_into_tensor(torch.empty(n * n * 4, device=device), x, group=group)
        elif kind == "reduce_scatter":
            dist.reduce_scatter_tensor(torch.empty(4, device=device), x, group=group)
        else:
            dist.all_to_all_single(torch.empty_like(x), x, group=group)
        del x
        added[kind] = round(_used_mib() - before, 1)
    return added


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    device = init_distributed()
    start = _used_mib()  # the CUDA context and the world's communicator, not yet connected
    cfg = load_config(None, [f"--{kv}" for kv in args.set], world_size=dist.get_world_size())
    world = {"size": dist.get_world_size(), "mib": _first_calls(dist.group.WORLD, device)}
    topo = Topology.build(cfg)
    # _MINE's keys: a rank set, or (backend, name, rank set) for a named group
    held = [{"ranks": list(key if all(isinstance(r, int) for r in key) else key[2]),
             "mib": _first_calls(group, device)} for key, group in group_registry._MINE.items()]
    line = {"rank": dist.get_rank(), "device": torch.cuda.get_device_name(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "used_at_start_mib": round(start, 1), "world": world, "groups_held": topo.registry.held(), "groups": held,
            "total_added_mib": round(sum(sum(g["mib"].values()) for g in [world] + held), 1)}
    print(json.dumps(line), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
