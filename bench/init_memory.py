"""A rank's peak host memory while its shard of one large tensor gets its initial value (issue 50, target 3).

    python bench/init_memory.py --world 64 --split fsdp [--experts 256] [--rank 0] [--tensor embedding]
    python bench/init_memory.py --table [--worlds 8 64 1024 8192]   # each case in a fresh process

One process poses as rank R of a W-rank world on the fake backend (no communication, as bench/scale_sim.py). It
builds on `meta` one stacked expert weight of DeepSeek-V3's shape, [E, 2048, 7168] fp32 (E = 256: 15 GB whole),
applies one of two layouts with loom's own calls, and then `materialize` (parallel/materialize.py) gives it storage
and draws its part (models/init.py), as a job's start-up does:

- "fsdp": FSDP2 over all W ranks (`fully_shard` on a 1-D mesh): dim 0 in W chunks (rank 0 holds ⌈E/W⌉ experts);
- "ep": bench/scale_sim.py's deepseek layout (pp16, so dp = W/16; ep = min(64, dp), efsdp = dp/ep): the experts split
  over ep (parallel/experts.py `ExpertParallel`), then FSDP2 over efsdp, as `apply_expert_parallel` does.

Memory: the resident set before `materialize` (after the meta build and the layout), then the process's high-water
mark reset (/proc/self/clear_refs = 5: VmHWM := VmRSS), and VmHWM after it; `peak_over_shard` is the increase over
the shard's bytes. The target is ≤ 2 (the shard itself plus at most one more). `drawn_mib`: the elements the
generators drew (every block of rows the shard overlaps, models/init.py), against the shard's.

`--tensor embedding`: DeepSeek-V3's input embedding instead, [129280, 7168] fp32 (3.5 GiB) under FSDP2 — rows of
7168 elements, 2340 to a block of models/init.py's DRAW_BLOCK, so a shard's edges cut blocks (an expert's row is a
block of its own): the case where a block is drawn apart and copied.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HIDDEN, WIDTH, VOCAB = 7168, 2048, 129280  # DeepSeek-V3: hidden size, an expert's intermediate size, vocabulary


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux ≥ 4.0), so the next VmHWM is this phase's own peak, not the imports'."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def one_tensor(tensor: str, experts: int):
    """One weight on meta under a root whose name puts it in the LLM (drawn N(0, init_std), as the job's): a
    stacked expert weight [experts, 2048, 7168], or the embedding [129280, 7168]."""
    import torch.nn as nn

    from loom.models.experts import Experts

    if tensor == "embedding":
        return nn.ModuleDict({"language": nn.Embedding(VOCAB, HIDDEN, device="meta")})
    block = Experts(experts, HIDDEN, WIDTH).to("meta")
    del block.up_proj, block.down_proj  # one tensor: the peak is its shard's alone
    return nn.ModuleDict({"language": block})


def shard(root, tensor: str, split: str, world: int, rank: int) -> dict:
    """`split`'s layout on the meta tensor, with the calls a job makes; the mesh degrees."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from loom.parallel.experts import ExpertParallel

    held = root["language"]
    if split == "fsdp":
        fully_shard(held, mesh=init_device_mesh("cpu", (world,)))
        return {"fsdp": world}
    if tensor == "embedding":
        raise SystemExit("--split ep splits experts; the embedding is sharded by --split fsdp")
    dp = world // 16  # the deepseek job's pp16: the expert tensor's ranks are one stage's dp ranks
    ep = min(64, dp)
    # rank R's stage holds dp ranks; the tensor's split depends only on R's place among them
    stage = (rank // dp) * dp
    mesh = DeviceMesh("cpu", torch.arange(stage, stage + dp).reshape(dp // ep, ep), mesh_dim_names=("efsdp", "ep"))
    parallelize_module(held, mesh["ep"], ExpertParallel())
    fully_shard(held, mesh=mesh["efsdp"])
    return {"ep": ep, "efsdp": dp // ep}


def measure(world: int, split: str, experts: int, rank: int, tensor: str = "experts") -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import loom.models.init as init
    from loom.parallel.materialize import InitialWeights, local_part, materialize

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    root = one_tensor(tensor, experts)
    degrees = shard(root, tensor, split, world, rank)
    (name, param), = root.named_parameters()
    drawn = [0]  # elements the generators fill: wraps the rule models/init.py picks
    rule = init._rule

    def counting(*args):
        fill = rule(*args)
        return lambda t, gen: (drawn.__setitem__(0, drawn[0] + t.numel()), fill(t, gen))[1]

    init._rule = counting
    before = status_kib("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    materialize(root, torch.device("cpu"), InitialWeights(seed=0, llm_std=0.02))
    seconds = time.perf_counter() - t0
    peak, after = status_kib("VmHWM"), status_kib("VmRSS")
    local, box = local_part(param)
    shard_bytes = local.numel() * local.element_size()
    out = {"bench": "init_memory", "world": world, "rank": rank, "split": split, **degrees,
           "tensor": tensor, "shape": list(param.shape), "shard_rows": [box[0].start, box[0].stop],
           "shard_mib": round(shard_bytes / 2**20, 1), "drawn_mib": round(drawn[0] * 4 / 2**20, 1),
           "rss_before_mib": round(before / 1024, 1), "peak_increase_mib": round((peak - before) / 1024, 1),
           "rss_increase_mib": round((after - before) / 1024, 1),
           "peak_over_shard": round((peak - before) * 1024 / shard_bytes, 3) if shard_bytes else None,
           "materialize_s": round(seconds, 2), "draw_block": init.DRAW_BLOCK, "torch": torch.__version__}
    dist.destroy_process_group()
    return out


def table(worlds: list[int], experts: int, splits: list[str]) -> None:
    """Each case in a fresh process: nothing an earlier case allocated stays in the allocator."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cases = [("experts", split) for split in splits] + [("embedding", "fsdp")]
    for tensor, split in cases:
        for world in worlds:
            if split == "ep" and world < 16 * 2:
                continue  # pp16 leaves no ep to speak of below 32 ranks
            out = subprocess.run([sys.executable, __file__, "--world", str(world), "--split", split, "--experts",
                                  str(experts), "--tensor", tensor], capture_output=True, text=True, env=env)
            if out.returncode:
                sys.exit(out.stderr[-4000:])
            print(out.stdout.strip().splitlines()[-1], flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=64)
    p.add_argument("--rank", type=int, default=0, help="the rank this process plays")
    p.add_argument("--split", choices=["fsdp", "ep"], default="fsdp")
    p.add_argument("--experts", type=int, default=256, help="E of the [E, 2048, 7168] tensor (DeepSeek-V3: 256)")
    p.add_argument("--tensor", choices=["experts", "embedding"], default="experts")
    p.add_argument("--table", action="store_true", help="every --splits at every --worlds, one process each")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 1024, 8192])
    p.add_argument("--splits", nargs="+", default=["fsdp", "ep"])
    args = p.parse_args()
    if args.table:
        table(args.worlds, args.experts, args.splits)
    else:
        print(json.dumps(measure(args.world, args.split, args.experts, args.rank, args.tensor)), flush=True)


if __name__ == "__main__":
    main()
