"""Step time with sharded checkpoint saves: synchronous vs `run.async_save`, one process, both rows in one run.

    PYTHONPATH=. python bench/ckpt_bench.py --out /tmp/ckpt            # one GPU: 0.5B LLM (Qwen2.5-0.5B shape)
    PYTHONPATH=. python bench/ckpt_bench.py --small --out /tmp/ckpt    # the CPU form CI runs

The built-in tasks (small images, short text) keep each step short, so the save's cost shows: a 0.5B LLM in
fp32 with its AdamW moments is ~6 GB per checkpoint. Every `--save-every` steps the step includes
`Trainer.checkpoint()`; with async_save the host copy is taken inside the step and the files are written
while the next steps run. Prints one JSON line per mode: every step's time, min / median / max, the steps
that saved, the checkpoint's size, and recompiles (frames compiled after the first step).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from bench.shapes import LLM_SMALL
from loom.job import load_config
from loom.parallel.compile import compiled_frames
from loom.train.trainer import Trainer

SMALL = ["--model.language.hidden_size=64", "--model.language.num_layers=2", "--model.language.num_heads=4",
         "--model.language.num_kv_heads=2", "--model.language.intermediate_size=128"]


def run(mode_async: bool, args) -> dict:
    out = Path(args.out) / ("async" if mode_async else "sync")
    shutil.rmtree(out, ignore_errors=True)
    gpu = torch.cuda.is_available()
    cfg = load_config(None, (SMALL if args.small else LLM_SMALL) + [
        f"--run.out_dir={out}", f"--run.async_save={str(mode_async).lower()}", "--run.tensorboard=false",
        "--run.progress=false", f"--train.steps={args.steps}", f"--train.dtype={'bf16' if gpu else 'fp32'}",
        f"--train.global_batch_size={args.batch}"])
    trainer = Trainer(cfg)
    times, saved = [], []
    for step in range(args.steps):
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train_step()
        if trainer.step % args.save_every == 0:
            trainer.checkpoint()
            saved.append(trainer.step)
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if step == 0:
            first_frames = compiled_frames()
    t0 = time.perf_counter()
    trainer.finish_save()
    drain = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in (out / f"step-{saved[0]}").iterdir()) if saved else 0
    measured = sorted(times[1:])  # the first step warms up
    return {"bench": "ckpt", "async_save": mode_async, "device": torch.cuda.get_device_name() if gpu else "cpu",
            "torch": torch.__version__, "params_b": round(trainer.n_params / 1e9, 3),
            "checkpoint_gib": round(size / 2**30, 3), "save_every": args.save_every, "saved_steps": saved,
            "step_s_min": round(measured[0], 4), "step_s": round(measured[len(measured) // 2], 4),
            "step_s_max": round(measured[-1], 4), "final_drain_s": round(drain, 3),
            "recompiles": compiled_frames() - first_frames, "step_times": [round(t, 4) for t in times]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoints go under OUT/sync and OUT/async")
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--small", action="store_true")
    args = p.parse_args()
    for mode_async in (False, True):
        print(json.dumps(run(mode_async, args)), flush=True)


if __name__ == "__main__":
    main()
