"""Checkpoint throughput per rank (issue 50, target 6): the 2B job's sharded checkpoint written and read, sync
and async, against the disk's own rate (`dd` of as many bytes, written with fsync and read back with the page
cache dropped where the machine lets us).

Threads: loom's StreamingHFWriter splits a rank's shards over `threads` files written at once (torch's own HF
writer put them in one file, so its `thread_count` had nothing to share: 0.30 and 0.33 GiB/s with 1 and 8 threads
on the H200 machine, 2026-11-27). `--threads 1,4` measures each count; without it, loom's default.

    PYTHONPATH=. python bench/ckpt_throughput.py --out /tmp/ckpt          # one GPU, the 2B job
    PYTHONPATH=. python bench/ckpt_throughput.py --out /tmp/ckpt --small  # the CPU form (a few MiB)
    PYTHONPATH=. python bench/ckpt_throughput.py --out /tmp/ckpt --gib 1  # the CPU form at about 1 GiB

One JSON line per mode: GiB, seconds until the call returns, seconds until the bytes are on
disk (`os.sync`), seconds to load, GiB/s of each, and the process's CPU seconds for each (all threads: the copies
a writer makes); `host_layouts`: how many times the async rows' host buffers were allocated so far (one: a
repeated async row reused them, as a trainer's saves do); then one line for dd.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from bench.shapes import AUDIO, LLM, VIT
from loom.checkpoint.sharded import begin_save, load_sharded
from loom.checkpoint.staging import HostStaging
from loom.job import load_config
from loom.train.trainer import Trainer

SMALL = ["--model.language.hidden_size=64", "--model.language.num_layers=2", "--model.language.num_heads=4",
         "--model.language.num_kv_heads=2", "--model.language.intermediate_size=128"]
LAYER_GIB = 0.17  # one layer of width 1024 (MLP 4096), fp32 weights and AdamW's two moments: 15.2M × 12 bytes


def sized(gib: float) -> list[str]:
    """The small form's LLM made about `gib` GiB of checkpoint: layers of width 1024, as many as it takes."""
    return ["--model.language.hidden_size=1024", "--model.language.num_heads=8", "--model.language.num_kv_heads=2",
            "--model.language.intermediate_size=4096", f"--model.language.num_layers={max(1, round(gib / LAYER_GIB))}"]


def _drop_caches() -> bool:
    """The page cache emptied (root on Linux), so a read comes from the disk; False where not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


def save_and_load(trainer: Trainer, out: Path, run_async: bool, threads: int | None, staging: HostStaging) -> dict:
    path = out / ("async" if run_async else "sync")
    shutil.rmtree(path, ignore_errors=True)
    _drop_caches()  # the last row's dirty pages are not this row's to write
    t0, c0 = time.perf_counter(), time.process_time()
    pending = begin_save(path, trainer.model, trainer.optimizer, trainer.weight_aliases, trainer.step, {},
                         trainer.save_group, run_async, staging=staging,
                         **({} if threads is None else {"threads": threads}))
    returned = time.perf_counter() - t0
    pending.finish()
    written = time.perf_counter() - t0
    os.sync()
    durable, cpu = time.perf_counter() - t0, time.process_time() - c0
    gib, files = _gib(path), len(list(path.glob("*model-*.safetensors")))
    dropped = _drop_caches()
    t0, c0 = time.perf_counter(), time.process_time()
    load_sharded(path, trainer.model, trainer.optimizer, trainer.weight_aliases)
    loaded, load_cpu = time.perf_counter() - t0, time.process_time() - c0
    shutil.rmtree(path, ignore_errors=True)
    return {"bench": "ckpt_throughput", "async_save": run_async, "threads": threads, "gib": round(gib, 3),
            "files": files,
            "returned_s": round(returned, 3), "written_s": round(written, 3), "durable_s": round(durable, 3),
            "write_gib_per_s": round(gib / durable, 3), "write_cpu_s": round(cpu, 3),
            "load_s": round(loaded, 3), "read_gib_per_s": round(gib / loaded, 3), "load_cpu_s": round(load_cpu, 3),
            "page_cache_dropped": dropped, "host_layouts": staging.layouts}


def dd_rate(out: Path, gib: float) -> dict:
    """The disk's own rate for as many bytes: one writer with fsync, one reader after the cache is dropped."""
    f, count = out / "dd.bin", max(1, round(gib * 16))  # blocks of 64 MiB
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={count}", "conv=fsync"], check=True,
                   capture_output=True)
    write = time.perf_counter() - t0
    dropped = _drop_caches()
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M"], check=True, capture_output=True)
    read = time.perf_counter() - t0
    f.unlink()
    return {"bench": "ckpt_throughput", "dd_gib": count / 16, "dd_write_gib_per_s": round(count / 16 / write, 3),
            "dd_read_gib_per_s": round(count / 16 / read, 3), "page_cache_dropped": dropped}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--small", action="store_true")
    p.add_argument("--gib", type=float, help="the CPU form at about this many GiB of checkpoint")
    p.add_argument("--threads", help="comma-separated writer threads per rank to measure (default: loom's)")
    p.add_argument("--repeat", type=int, default=1, help="rows of each kind, one after another (a noisy machine)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    shape = sized(args.gib) if args.gib else SMALL if args.small else LLM + VIT + AUDIO
    cfg = load_config(None, shape + [
        f"--run.out_dir={out / 'run'}", "--run.tensorboard=false", "--run.progress=false", "--train.steps=1",
        f"--train.dtype={'bf16' if gpu else 'fp32'}", "--train.global_batch_size=4"])
    trainer = Trainer(cfg)
    trainer.train_step()  # the optimizer's moments exist: a checkpoint of its full size
    staging = HostStaging()  # as a trainer keeps one: the first async row allocates its buffers, a repeat reuses them
    for threads in [int(t) for t in args.threads.split(",")] if args.threads else [None]:
        for run_async in [False] * args.repeat + [True] * args.repeat:
            row = save_and_load(trainer, out, run_async, threads, staging)
            print(json.dumps({**row, "device": torch.cuda.get_device_name() if gpu else "cpu"}), flush=True)
    print(json.dumps(dd_rate(out, row["gib"])), flush=True)


if __name__ == "__main__":
    main()
