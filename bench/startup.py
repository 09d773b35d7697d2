"""Start-up memory: what each rank allocates to build the job's model and apply its layout.

    torchrun --standalone --nproc-per-node=4 bench/startup.py            # the 2B workload's model, bf16, dp4
    torchrun --standalone --nproc-per-node=2 bench/startup.py --small    # the CPU form CI runs

Times and measures `build_job` (tokenizer, data, the model on meta, this rank's shards, the optimizer), the
part of `loom train` before the first step; the data is kept small (64 samples) so the model dominates. The
old start-up (before the meta-device build: every rank built the whole model in fp32 on the host and moved
it to its GPU before sharding) was measured at the commit that replaced it (bench/RESULTS.md). Prints one
JSON line: per rank, the peak host RSS, the peak and the resident GPU memory after start-up, and the seconds
taken.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

import loom

from bench.mm_bench import SMALL_MODEL
from bench.shapes import AUDIO, LLM, VIT
from loom.distributed import init_distributed, shutdown
from loom.job import load_config
from loom.train.build import build_job


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra loom config override")
    args = p.parse_args()
    device = init_distributed("auto")
    gpu = device.type == "cuda"
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = load_config(None, (SMALL_MODEL if args.small else LLM + VIT + AUDIO) + [
        f"--train.dtype={'bf16' if gpu else 'fp32'}", f"--train.global_batch_size={world}", "--data.train_size=64",
        "--data.heldout_size=1",
    ] + [f"--{kv}" for kv in args.set], world_size=world)
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    n_params = build_job(cfg, device).n_params
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    mine = {
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: KiB
        "gpu_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if gpu else None,
        "gpu_after_gib": torch.cuda.memory_allocated(device) / 2**30 if gpu else None,
        "seconds": seconds,
    }
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    if not dist.is_initialized() or dist.get_rank() == 0:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        worst = {k: max(r[k] for r in ranks) if ranks[0][k] is not None else None for k in mine}
        print(json.dumps({
            "bench": "startup", "start_up": "meta, then shards",
            "gpus": world if gpu else 0, "ranks": world, "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "torch": torch.__version__, "commit": commit or None, "loom": str(Path(loom.__file__).parent),
            "params_b": round(n_params / 1e9, 3),
            "overrides": args.set, **{f"max_{k}": None if v is None else round(v, 3) for k, v in worst.items()},
            "per_rank": [{k: None if v is None else round(v, 3) for k, v in r.items()} for r in ranks],
        }))
    shutdown()


if __name__ == "__main__":
    main()
