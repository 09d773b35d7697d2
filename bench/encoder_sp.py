"""Activation memory of a tensor-parallel vision encoder with and without sequence parallel.

    torchrun --nproc-per-node=2 bench/encoder_sp.py [--images 16] [--side 448] [--steps 5]

A SigLIP-so400m-shaped ViT (hidden 1152, 27 layers, 16 heads, MLP 4304, patch 14) and its projector to a
1536-wide LLM, tp over every rank (no FSDP: the weights are the same in both rows), bf16 weights. Each step
runs forward and backward over `--images` images of `--side`² pixels packed into one stream (1,024 patches
each at 448 px). Per row: the peak GPU memory of a step above what the weights and their gradients hold
(max_memory_allocated − allocated before the step), the step time (min / median / max), per rank (max over
ranks). Each row also with activation checkpointing of every layer ("full": a layer keeps only its input, the
shard under SP). `--small` runs a tiny encoder on CPU ranks (gloo), as CI does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loom.models.multimodal import ModalityEncoder  # noqa: E402
from loom.models.vision import VisionConfig, VisionEncoder  # noqa: E402
from loom.parallel.checkpointing import checkpointed  # noqa: E402
from loom.parallel.tensor import apply_encoder_tp  # noqa: E402

SO400M = VisionConfig(hidden_size=1152, num_layers=27, num_heads=16, intermediate_size=4304, patch_size=14,
                      position_grid=27)
SMALL = VisionConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, patch_size=4, position_grid=4)


def measure(sequence_parallel: bool, checkpointing: str, args, device: torch.device) -> dict:
    cfg = SMALL if args.small else SO400M
    torch.manual_seed(0)
    encoder = ModalityEncoder(VisionEncoder(cfg), 64 if args.small else 1536).to(device, torch.bfloat16 if
                                                                                  device.type == "cuda" else None)
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    apply_encoder_tp(encoder, mesh, sequence_parallel)
    for layer in encoder.encoder.layers if checkpointing != "none" else ():
        layer.forward = checkpointed(layer.forward, checkpointing)  # inside TP's hooks, as loom applies it
    g = torch.Generator(device="cpu").manual_seed(1)
    images = [torch.randn(3, args.side, args.side, generator=g).to(device) for _ in range(args.images)]
    peaks, times = [], []
    for _ in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        t0 = time.perf_counter()
        out = encoder(images)
        (out.float().square().mean()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2**30)
        times.append(time.perf_counter() - t0)
    times, peaks = times[1:], peaks[1:] or [0.0]  # the first: allocator and kernels warming up
    rows = sum(encoder.num_tokens(x) for x in images)
    local = [max(peaks), statistics.median(times)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return {"sequence_parallel": sequence_parallel, "activation_checkpointing": checkpointing,
            "tp": dist.get_world_size(), "images": args.images,
            "side": args.side, "rows": rows, "activation_peak_gib": max(e[0] for e in everyone),
            "step_s": [min(times), statistics.median(times), max(times)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--side", type=int, default=448)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--small", action="store_true")
    args = p.parse_args()
    gpu = torch.cuda.is_available() and not args.small
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    rows = [measure(sp, ac, args, device) for ac in ("none", "full") for sp in (False, True)]
    if dist.get_rank() == 0:
        for r in rows:
            print(json.dumps(r))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # DTensor's sharding caches keep the gloo group alive past destroy_process_group, and its destructor at
    # interpreter teardown aborted ~1 run in 10 ("terminate called without an active exception"): skip teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
