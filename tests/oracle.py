"""Runs `loom verify` inside a test world and returns each step's verdict as plain values."""

from __future__ import annotations

import io

import torch.distributed as dist
from rich.console import Console

from loom.job import load_config

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


def assert_all_passed(name: str, per_rank: list[list[dict]], steps: int,
                      modules: tuple[str, ...] = ("audio", "language", "vision")) -> None:
    """Every rank ran `steps` verify steps with clipping active and every module of `modules` compared, each
    passed, and every rank saw the same numbers."""
    for rank, checks in enumerate(per_rank):
        assert len(checks) == steps
        for i, s in enumerate(checks):
            where = f"{name} rank {rank} step {i + 1}"
            assert s["ref_norm"] > s["clip"], f"{where}: clipping not active"
            assert s["modules"] == list(modules)
            assert s["passed"], f"{where}: {s['failures']}"
        assert checks == per_rank[0], f"{name}: rank {rank} saw other numbers than rank 0"
