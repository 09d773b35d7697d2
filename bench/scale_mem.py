"""What a rank's host memory holds at the end of bench/scale_sim.py's run, by owner (issue 50, target 4).

    python bench/scale_mem.py --job mm2b-hsdp8 --world 8192 [--unshared] [--trace]

One process poses as rank 0 of a `--world`-rank world exactly as scale_sim does (its `simulate`: start-up, then
the steps); before the groups are destroyed, the live objects are counted by who holds them:
- `mesh_*`: torch's DeviceMesh objects (FSDP2 makes them per parameter) and the rank-map tuples they hold
  (`_flatten_rank_map`: the root's rank map as Python ints), counted once per distinct tuple with its ints;
- `registry_mib`: loom's process-group registry (topology/groups.py: the partitions' keys, this rank's sets);
- `tensors_mib`: live CPU tensors' storages (meta tensors hold none), `numpy_mib`: numpy arrays that own data
  (held by an object gc tracks);
- with `--trace`: tracemalloc from before start-up, the top lines by size (slow: every allocation is traced).
`--unshared` restores torch's own `DeviceMesh.__init__` first (topology/rank_maps.py undone): the before figures.
Sizes of Python objects are `sys.getsizeof`, ints above 256 counted once by identity (smaller ones are cached).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import scale_sim  # noqa: E402


def deep_size(obj, seen: set[int]) -> int:
    """Bytes of `obj` and what it holds, through tuples, lists, sets, dicts and ints (each object once)."""
    if id(obj) in seen or (type(obj) is int and -5 <= obj <= 256):
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, (tuple, list, set, frozenset)):
        size += sum(deep_size(x, seen) for x in obj)
    elif isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    return size


def owners() -> dict:
    """The live objects, by owner (see the module's docstring)."""
    import numpy as np
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from loom.topology import groups

    gc.collect()
    meshes, storages, arrays = [], {}, {}
    for o in gc.get_objects():
        if isinstance(o, DeviceMesh):
            meshes.append(o)
        elif type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type == "cpu":
            storage = o.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        for r in gc.get_referents(o):  # numpy arrays are not tracked by gc: found from what holds them
            if type(r) is np.ndarray and r.base is None:
                arrays[id(r)] = r.nbytes
    seen: set[int] = set()
    tuples = {id(m._flatten_rank_map): m._flatten_rank_map for m in meshes}
    mesh_bytes = sum(deep_size(t, seen) for t in tuples.values())
    registry = deep_size(groups._PARTITIONS, set()) + deep_size(list(groups._MINE), set())
    return {"meshes": len(meshes), "rank_map_tuples": len(tuples), "mesh_rank_maps_mib": round(mesh_bytes / 2**20, 2),
            "registry_mib": round(registry / 2**20, 3), "tensors_mib": round(sum(storages.values()) / 2**20, 2),
            "numpy_mib": round(sum(arrays.values()) / 2**20, 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", choices=list(scale_sim.JOBS), default="mm2b")
    p.add_argument("--world", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--unshared", action="store_true", help="torch's own DeviceMesh.__init__ (before rank_maps.py)")
    p.add_argument("--trace", action="store_true", help="tracemalloc's top lines as well (slow)")
    args = p.parse_args()
    from torch.distributed.device_mesh import DeviceMesh

    from loom.topology import groups

    if args.unshared:
        DeviceMesh.__init__ = getattr(DeviceMesh.__init__, "__wrapped__", DeviceMesh.__init__)
    found: dict = {}
    destroy = groups.GroupRegistry.destroy_all

    def counted_then_destroyed() -> None:
        found.update(owners())
        if args.trace:
            top = tracemalloc.take_snapshot().statistics("lineno")[:12]
            found["top_lines"] = {f"{s.traceback[0].filename.split('site-packages/')[-1]}:{s.traceback[0].lineno}":
                                  round(s.size / 2**20, 2) for s in top}
        destroy()

    groups.GroupRegistry.destroy_all = staticmethod(counted_then_destroyed)
    if args.trace:
        tracemalloc.start(1)
    out = scale_sim.simulate(args.job, args.world, 0, args.steps)
    keep = ("job", "world", "rss_startup_mib", "rss_after_steps_mib", "startup_s", "layouts_s")
    print(json.dumps({"bench": "scale_mem", "shared": not args.unshared, **{k: out[k] for k in keep}, **found}),
          flush=True)


if __name__ == "__main__":
    main()
