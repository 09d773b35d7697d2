"""Process-group start-up for `torchrun`: backend and device chosen from what the machine has."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(backend: str = "auto") -> torch.device:
    """Initialises the default process group when launched by torchrun (WORLD_SIZE > 1) and returns this
    rank's device: NCCL + its own GPU when CUDA is present, gloo + CPU otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend 'nccl' needs CUDA devices; use 'gloo' on CPU")
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    # DTensor warns that a norm over (dp, tp) takes two all-reduces; true, and cheap at the sizes that do it
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if launched_world_size() > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return device


def shutdown() -> None:
    if dist.is_initialized():
        from loom.topology.groups import GroupRegistry

        GroupRegistry.destroy_all()
        dist.destroy_process_group()
