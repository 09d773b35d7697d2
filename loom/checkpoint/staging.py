"""Host copies of a rank's shards for `run.async_save`: each tensor copied once, into host buffers kept from one
save to the next (page-locked when the shards are on a GPU), so the call blocks only for that one copy.

Why not torch's staging: dcp.async_save stages through the writer (FileSystemWriter is a BlockingAsyncStager),
which allocates fresh pageable tensors at every save — on the 2B job (22 GiB, one H100) 16 s of page faults and
pageable device-to-host copies, longer than a whole sync save, before the first byte is written — and copies a
DTensor twice (`.to("cpu")`, then again into a new local tensor). Here the shards are packed into a few host
slabs once, each save copies every shard into its place, and the writer reads the bytes from there
(HostCopyPlanner) while DCP plans from the shards themselves (names, shapes, DTensor placements).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

SLAB = 1 << 30  # bytes per host slab at most (a larger shard gets its own): torch's page-locked allocator rounds
ALIGN = 64  # every shard's copy starts on a 64-byte boundary, so a view of any dtype is aligned


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (a DTensor's local tensor; a plain tensor itself). parallel/local.py's
    local_tensor, detached; not called from here since checkpoint/ sits below parallel/ (models export through it)."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def slab_plan(sizes: dict[str, int]) -> tuple[list[int], dict[str, tuple[int, int]]]:
    """Slab sizes and each name's (slab, byte offset): largest first into the first slab with room. Slabs are
    powers of two (torch's page-locked allocator would round them up to one anyway), at most SLAB unless one
    shard is larger, and no larger than what is left to place (a small model gets a small slab)."""
    slabs: list[int] = []
    used: list[int] = []
    place: dict[str, tuple[int, int]] = {}
    left = sum(-(-n // ALIGN) * ALIGN for n in sizes.values())
    for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]):
        padded = -(-n // ALIGN) * ALIGN
        k = next((i for i, u in enumerate(used) if u + padded <= slabs[i]), None)
        if k is None:
            slabs.append(max(pow2_at_least(padded), min(SLAB, pow2_at_least(left))))
            used.append(0)
            k = len(slabs) - 1
        place[name] = (k, used[k])
        used[k] += padded
        left -= padded
    return slabs, place


class HostStaging:
    """Host buffers for one rank's shards, reused by every async save of the same shards (names, shapes, dtypes,
    devices); another set (e.g. the optimizer's moments once it has stepped) is laid out anew. A trainer keeps
    one: on the 2B job that is 22 GiB of page-locked host memory per rank, held between saves."""

    def __init__(self) -> None:
        self.key: tuple | None = None  # the shards the buffers are laid out for
        self.slabs: list[torch.Tensor] = []
        self.host: dict[str, torch.Tensor] = {}  # name → the host tensor its shard is copied into
        self.in_flight: concurrent.futures.Future | None = None  # the last save's write, reading these buffers
        self.layouts = 0  # times the buffers were (re)allocated: one per set of shards when they are reused
        self.copies = 0  # shard copies made, over all saves: one per shard per save

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every shard's values as of this call, in host memory: returns once each copy is complete, so the
        training may change the shards from then on. Waits first for the previous save's write from them."""
        if self.in_flight is not None:  # its files are still being written from these buffers (its error: finish's)
            concurrent.futures.wait([self.in_flight])
            self.in_flight = None
        shards = {name: local_shard(t) for name, t in tensors.items()}
        key = tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in shards.items())
        if key != self.key:
            self._lay_out(shards)
            self.key = key
        devices = {t.device for t in shards.values() if t.device.type == "cuda"}
        for device in devices:  # whatever stream last wrote a shard (the step's own, FSDP2's), it is final now
            torch.cuda.synchronize(device)
        for name, t in shards.items():
            if t.numel():
                self.host[name].copy_(t, non_blocking=t.device.type == "cuda")
            self.copies += 1
        for device in devices:  # the copies are complete before the training may change a shard
            torch.cuda.synchronize(device)
        return dict(self.host)

    def _lay_out(self, shards: dict[str, torch.Tensor]) -> None:
        self.slabs, self.host = [], {}
        pinned = any(t.device.type == "cuda" for t in shards.values())
        nbytes = {name: t.numel() * t.element_size() for name, t in shards.items() if t.numel()}
        sizes, place = slab_plan(nbytes)
        self.slabs = [torch.empty(n, dtype=torch.uint8, pin_memory=pinned) for n in sizes]
        for name, t in shards.items():
            if not t.numel():
                self.host[name] = torch.empty(t.shape, dtype=t.dtype)
                continue
            k, at = place[name]
            self.host[name] = self.slabs[k][at:at + nbytes[name]].view(t.dtype).view(t.shape)
        self.layouts += 1


class HostCopyPlanner(DefaultSavePlanner):
    """DCP's default save planner, but every item's bytes are read from its host copy (HostStaging.stage): the
    plan comes from the shards themselves, whose names, shapes and placements the training does not change."""

    def __init__(self, host: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.host = host

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.host[index.fqn]  # one chunk per name on a rank (the writer's header refuses two)


class AlreadyStaged(AsyncStager):
    """dcp.async_save's stager when HostStaging has copied the shards already: the state dict as it is."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict
