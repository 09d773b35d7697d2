"""Runs `loom verify` inside a test world and returns each step's verdict as plain values."""

from __future__ import annotations

import io

import torch.distributed as dist
from rich.console import Console

from loom.config import load_config

# the default vision + audio + text model and task mix: images of different sizes, clips of different
# lengths in every batch
BASE = ["--train.global_batch_size=16", "--data.train_size=2000"]


def run_verify(overrides: list[str], steps: int = 3) -> list[dict]:
    import loom.train.verify as v

    world = dist.get_world_size() if dist.is_initialized() else None
    cfg = load_config(None, BASE + overrides, world_size=world)
    checks = v.verify(cfg, steps=steps, console=Console(file=io.StringIO()))
    return [
        {"passed": c.passed, "failures": c.failures, "quantities": c.quantities(), "modules": sorted(c.modules),
         "ref_norm": c.ref_grad_norm, "clip": cfg.train.grad_clip}
        for c in checks
    ]
