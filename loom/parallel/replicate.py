"""Replicated data parallelism, for a module whose layout sets `fsdp = false`: its weights whole on each of its
dp·cp ranks, its gradients summed over them once per step — DDP's scheme, with loom's step.

Why not FSDP2 for every module: FSDP2 gathers each unit's weights and runs hooks around it on every forward
and backward. On 4 H200s the 2B step spent its time in that host work (the devices waited for gathers the host
had not issued yet), and CUDA graphs cannot replay blocks whose weights move. A replicated module costs its
whole weights, gradients and AdamW moments on every rank (16 bytes a parameter) and one all-reduce of its
gradients per step, issued in buckets while the backward runs; its blocks run as on one GPU, graphs included.

Why not torch's DistributedDataParallel (or its composable `replicate`): its reducer runs through the wrapped
module's forward, averages over the world, and expects one forward per backward; loom's step calls a module
once per microbatch (an encoder through the bridge), sums gradients (the loss is already divided by the global
token count) and reduces after the step's last microbatch only. What is kept from DDP: buckets in the order the
backward produced the gradients (learned in the first step, rank 0's order on every rank, so every rank issues
the same collectives in the same order), each bucket issued once its gradients are final.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from loom.parallel_config import ParallelConfig

if TYPE_CHECKING:
    from loom.topology import Grid

# a bucket holds at least this many bytes of gradients, except the last: one grouped all-reduce per bucket, in place
# (or through a flat buffer where the sum's dtype differs); the default of parallel.replica_bucket_mb
BUCKET_BYTES = int(ParallelConfig.replica_bucket_mb * 2**20)


class GradientSum:
    """Sums the gradients of `params` over `group` after the step's last backward (`sync` on), bucket by bucket
    as the backward finishes them; `finish()` issues what is left and waits for all of it."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, reduce_dtype: torch.dtype | None = None,
                 bucket_bytes: int = BUCKET_BYTES):
        self.params = [p for p in params if p.requires_grad]
        # 0: one bucket, whole once the backward is over: no sum runs beside the backward's kernels
        self.group, self.bucket_bytes = group, bucket_bytes or float("inf")
        self.reduce_dtype = reduce_dtype  # None: each gradient's own (bf16 halves the bytes sent)
        self.sync = False
        self.buckets: list[list[int]] | None = None  # parameter indices; built after the first synced backward
        self.bucket_of: list[int] = []
        self._reset()
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._finished, i))

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets or [])
        self._next = 0  # the next bucket to issue: buckets go out in order, the same on every rank
        # (the sum's work; the flat buffer it summed, None: the gradients in place; the gradients)
        self._pending: list[tuple[dist.Work, torch.Tensor | None, list[torch.Tensor]]] = []
        self._seen: list[int] = []  # parameters whose gradient this synced backward finished, in order

    def set_sync(self, enabled: bool) -> None:
        """On for the backward after which the step's gradients are complete (its last microbatch's)."""
        if enabled and not self.sync:
            self._reset()
        self.sync = enabled

    def _finished(self, i: int, _param: nn.Parameter) -> None:
        if not self.sync:
            return
        self._seen.append(i)
        if self.buckets is None:
            return  # the first step: the order is being learned, finish() issues everything
        self._ready[self.bucket_of[i]] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._issue(self._next)
            self._next += 1

    def finish(self) -> None:
        """Every bucket not yet issued (the first step's, or one whose gradients the backward did not all reach),
        then the wait: the device's next work on these gradients follows the sums; no host sync."""
        if not self.sync:
            return
        if self.buckets is None:
            self._build_buckets()
        for b in range(self._next, len(self.buckets)):
            self._issue(b)
        self._next = len(self.buckets)
        for work, flat, grads in self._pending:
            work.wait()
            if flat is not None:  # copied into a flat buffer: back into the gradients
                torch._foreach_copy_(grads, _views(flat, grads))
        self._pending = []
        self.sync = False

    def _issue(self, b: int) -> None:
        # a parameter without a gradient has none on every rank (each rank runs every module, the same graph)
        grads = [_local(self.params[i].grad) for i in self.buckets[b] if self.params[i].grad is not None]
        if not grads:
            return
        dtype = self.reduce_dtype or grads[0].dtype
        if all(g.dtype == dtype for g in grads):
            # summed in place, one grouped call (NCCL: an all-reduce per tensor in one group): a flat buffer's copies
            # in and back cost 7 ms a step on the 2B model. The group's own method: dist.all_reduce_coalesced is
            # deprecated, and gloo has no coalescing manager
            opts = dist.AllreduceCoalescedOptions()
            opts.asyncOp = True
            self._pending.append((self.group.allreduce_coalesced(grads, opts), None, grads))
            return
        flat = grads[0].new_empty(sum(g.numel() for g in grads), dtype=dtype)
        torch._foreach_copy_(_views(flat, grads), grads)  # one pass, cast included
        self._pending.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, grads))

    def _build_buckets(self) -> None:
        """Buckets in the order the first synced backward finished the gradients, rank 0's on every rank; the
        parameters it did not reach (no gradient, or none in that backward) last, in the module's order."""
        order = [self._seen]
        dist.broadcast_object_list(order, src=dist.get_global_rank(self.group, 0), group=self.group)
        seen = set(order[0])
        order = order[0] + [i for i in range(len(self.params)) if i not in seen]
        self.buckets, current, size, key = [], [], 0, None
        for i in order:
            p = self.params[i]
            nbytes = _local(p).numel() * p.element_size()
            if current and (size >= self.bucket_bytes or nbytes >= self.bucket_bytes or (p.dtype, p.device) != key):
                self.buckets.append(current)
                current, size = [], 0
            current.append(i)
            size, key = size + nbytes, (p.dtype, p.device)
        if current:
            self.buckets.append(current)
        self.bucket_of = [0] * len(self.params)
        for b, bucket in enumerate(self.buckets):
            for i in bucket:
                self.bucket_of[i] = b
        self._ready = [0] * len(self.buckets)


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in like]), like)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A TP DTensor's local shard: replicas hold equal shards, summed over dp·cp as plain tensors."""
    return t._local_tensor if isinstance(t, DTensor) else t


def replica_group(grid: Grid) -> dist.ProcessGroup | None:
    """The ranks that hold copies of a module's weights and sum their gradients: its dp·cp ranks (None: one)."""
    return grid.group("dp", "cp") if grid.size("dp", "cp") > 1 else None


def replicate(module: nn.Module, group: dist.ProcessGroup | None, device_type: str, dtype: str) -> None:
    """`module` marked replicated over `group` (`attach_gradient_sums` sums its gradients once its parameters
    have storage; None: nothing to sum), and under bf16 its forward in autocast, as on one process (FSDP2's
    policy casts a sharded module's weights instead)."""
    if group is not None:
        module._loom_replicas = group
    if dtype == "bf16":
        module.forward = torch.autocast(device_type, dtype=torch.bfloat16)(module.forward)


def attach_gradient_sums(model: nn.Module, reduce_dtype: torch.dtype | None = None,
                         bucket_bytes: int = BUCKET_BYTES) -> None:
    """One GradientSum per group over the trained parameters of every module `replicate` marked with it, in the
    model's module order: modules on the same ranks share a group, and one ordered bucket list per group keeps
    the collectives on it in one order on every rank; `reduce_dtype`: what the sums are taken in (None: the
    gradients' own). After materialize: giving storage makes new parameters."""
    by_group: dict[dist.ProcessGroup, list[nn.Parameter]] = {}
    for m in model.modules():
        if (group := getattr(m, "_loom_replicas", None)) is not None:
            by_group.setdefault(group, []).extend(p for p in m.parameters() if p.requires_grad)
    model._loom_gradient_sums = [GradientSum(params, group, reduce_dtype, bucket_bytes)
                                 for group, params in by_group.items() if params]


def gradient_sums(model: nn.Module) -> list[GradientSum]:
    return getattr(model, "_loom_gradient_sums", [])
