"""Storage for a model built and parallelised on `meta`: each rank allocates only its shards and fills them.

A job never builds its model whole: `build_job_model` makes it on the meta device, `parallelize` applies the
layout there (TP and FSDP2 turn the parameters into DTensors of meta shards), and `materialize` then gives
this rank storage for what it holds and writes each tensor's local part — read from the module's Hugging
Face folder (only that part of the file), or drawn from generators seeded by the tensor's name, only the
blocks of rows its part overlaps (models/init.py), into the rank's own tensor. So a rank's memory at start-up
is its shards plus at most one block of rows, not a second copy of a shard (bench/init_memory.py), and every
layout starts from the weights the one-process reference starts from (loom verify compares them after every
step).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

# DCP's planner finds a DTensor's part the same way; torch has no public form of it
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from loom.models.hf.load import HFWeights
from loom.models.init import give_storage, initial_value


class WeightSource(Protocol):
    """Where `materialize` reads each tensor's first value: a training run's InitialWeights, or a checkpoint
    (loom/checkpoint/read.py)."""

    def check_holds(self, names: set[str]) -> None: ...

    def part(self, name: str, owner: nn.Module, attr: str, shape: torch.Size, box: tuple[slice, ...],
             device: torch.device, is_buffer: bool, into: torch.Tensor | None = None) -> torch.Tensor | None: ...

    def close(self) -> None: ...


class InitialWeights:
    """Each tensor's initial value by its one-process name: from the Hugging Face folder of the module that
    holds it (`folders`: name prefix → its HFWeights, e.g. "vision.encoder." → SigLIP's), else drawn from a
    generator seeded by (seed, name). Buffers not in a folder keep their computed values."""

    def __init__(self, seed: int, llm_std: float, folders: dict[str, HFWeights] | None = None) -> None:
        self.seed, self.llm_std = seed, llm_std
        self.folders = folders or {}

    def check_holds(self, names: set[str]) -> None:
        pass  # every weight has a start: a folder checked its names and shapes when opened, a draw covers the rest

    def part(self, name: str, owner: nn.Module, attr: str, shape: torch.Size, box: tuple[slice, ...],
             device: torch.device, is_buffer: bool, into: torch.Tensor | None = None) -> torch.Tensor | None:
        """The part `box` of tensor `name` (whole shape `shape`), or None to keep what it holds. A drawn part is
        written into `into` (the rank's tensor, when given) and `into` returned: no second copy of the shard."""
        for prefix, weights in self.folders.items():
            local = name[len(prefix):]
            if name.startswith(prefix) and local in weights:
                have = weights.rows(local)
                if box[0].stop <= have:
                    return weights.read(local, box)
                # a grown vocabulary: rows past the folder's are drawn, the rest read
                value = self._drawn(name, owner, attr, shape, box, device, into)
                if box[0].start < have:
                    value[: have - box[0].start] = weights.read(local, (slice(box[0].start, have), *box[1:]))
                return value
        return None if is_buffer else self._drawn(name, owner, attr, shape, box, device, into)

    def _drawn(self, name: str, owner: nn.Module, attr: str, shape: torch.Size, box: tuple[slice, ...],
               device: torch.device, into: torch.Tensor | None) -> torch.Tensor:
        llm_std = self.llm_std if name.startswith("language.") else None
        return initial_value(name, owner, attr, shape, self.seed, device, llm_std, box, into)

    def close(self) -> None:
        for weights in self.folders.values():
            weights.close()


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's tensor of `t` and where it sits in the whole (one slice per dim)."""
    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):  # e.g. a padded local tensor: the box would not describe it
        raise RuntimeError(f"local tensor {tuple(local.shape)} is not the DTensor's part {tuple(shape)} of "
                           f"{tuple(t.shape)} under {t.placements}")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def materialize(model: nn.Module, device: torch.device, weights: WeightSource,
                renames: dict[str, str] | None = None) -> None:
    """Gives `model` storage on `device` and fills every parameter's local part (and every buffer a folder
    holds). `renames`: a name here → the one-process name whose value it starts from (a pipelined LLM's head
    copy of the tied embedding). No-op for a model that already has storage."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    give_storage(model, device)
    renames = renames or {}
    persistent = set(model.state_dict(keep_vars=True))
    tensors = [(n, t, False) for n, t in model.named_parameters()]
    tensors += [(n, t, True) for n, t in model.named_buffers() if n in persistent]
    with torch.no_grad():
        for name, t, is_buffer in tensors:
            local, box = local_part(t)
            if local.numel() == 0:  # an uneven split left this rank nothing of it
                continue
            owner_name, _, attr = name.rpartition(".")
            # drawn in place only into fp32 (the draws' dtype); another dtype gets a value to copy, cast
            into = local if local.dtype == torch.float32 else None
            value = weights.part(renames.get(name, name), model.get_submodule(owner_name), attr, t.shape, box,
                                 local.device, is_buffer, into=into)
            if value is None or value is local:  # kept, or written in place (a drawn part)
                continue
            if value.shape != local.shape:  # copy_ would broadcast a wrong part silently
                raise RuntimeError(f"{name}: initial part {tuple(value.shape)} for a local shard {tuple(local.shape)}")
            local.copy_(value)
