"""Per-token statistics of the LLM's next-token distribution: the log-probability of a given token, the
entropy, and the top-k — with the vocabulary whole, or sharded over tp (a DTensor under loss parallel).

Vocab-parallel (Megatron's cross-entropy, here for logprobs): the max, the sum of exponentials, the target's
logit and Σ p·z are each reduced over tp, so no rank gathers the vocabulary. The sums are reduced by
`sum_over_shards`, whose backward is the identity: every tp rank computes the same loss from the reduced
value, so each shard's gradient is its own part — an all-reduce there would multiply gradients by tp (the
pitfall seed 000 names for cp's gather). Chunking over tokens (memory) is the caller's: each token's
statistics depend on its own logits only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

# DCP's planner finds a DTensor's part the same way; torch has no public form of it
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from loom.data.batch import IGNORE_INDEX


@dataclass
class VocabShard:
    """This rank's logits over the vocabulary slice [offset, offset + local.shape[-1]); group: the ranks that
    hold the other slices (None: the vocabulary is whole here)."""

    local: torch.Tensor
    offset: int = 0
    group: dist.ProcessGroup | None = None


def vocab_shard(logits: torch.Tensor) -> VocabShard:
    if not isinstance(logits, DTensor):
        return VocabShard(logits)
    placement = logits.placements[0]
    if logits.device_mesh.ndim != 1 or not (isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1)):
        raise ValueError(f"logits placed {logits.placements} on {logits.device_mesh}: expected the vocabulary dim "
                         f"sharded over a 1-D mesh")
    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
    return VocabShard(logits.to_local(), offset[-1], logits.device_mesh.get_group())


class _SumOverShards(torch.autograd.Function):
    """All-reduce (sum) of a value each rank of `group` holds a part of — over the vocabulary's shards here, over
    cp's parts of sequences in DPO — for a loss every rank then computes whole; backward the identity (see the
    module's docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_shards(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group is None else _SumOverShards.apply(x, group)


def _max_over_shards(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = x.detach()  # a shift for stability only: the results do not depend on it
    if group is not None:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


@dataclass
class TokenStats:
    logprobs: torch.Tensor  # log p(label), 0 where the label is IGNORE_INDEX
    entropy: torch.Tensor  # of the whole next-token distribution, at every position


def token_stats(logits: torch.Tensor | VocabShard, labels: torch.Tensor, temperature: float = 1.0) -> TokenStats:
    """Log-probability of each position's label and the distribution's entropy, in fp32, from logits
    `[..., V]` (whole, a DTensor sharded over the vocabulary, or a VocabShard) at `temperature`; differentiable."""
    shard = logits if isinstance(logits, VocabShard) else vocab_shard(logits)
    z = shard.local.float() / temperature
    z = z - _max_over_shards(z.amax(-1, keepdim=True), shard.group)
    exp = z.exp()
    total = sum_over_shards(exp.sum(-1), shard.group)
    log_total = total.log()
    mean_z = sum_over_shards((exp * z).sum(-1), shard.group) / total  # Σ p·z, p = exp / total
    supervised = labels != IGNORE_INDEX
    local_label = labels - shard.offset
    mine = supervised & (local_label >= 0) & (local_label < z.shape[-1])  # the label's logit is on this shard
    picked = z.gather(-1, local_label.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    label_z = sum_over_shards(picked * mine, shard.group)
    logprobs = (label_z - log_total) * supervised
    return TokenStats(logprobs, log_total - mean_z)


def chunked_token_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                        chunk: int = 1024) -> TokenStats:
    """`token_stats` over chunks of `chunk` tokens, each recomputed in backward (activation checkpointing), so
    fp32 logits are never held for more than one chunk: for a 152K vocabulary 1024 tokens are 0.6 GB, where a
    16K-token microbatch would be 10 GB."""
    shard = logits if isinstance(logits, VocabShard) else vocab_shard(logits)
    local = shard.local.reshape(-1, shard.local.shape[-1])
    flat = labels.reshape(-1)
    parts = []
    for start in range(0, max(flat.numel(), 1), chunk):  # one empty chunk for an empty microbatch
        piece = slice(start, start + chunk)

        def stats(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            s = token_stats(VocabShard(z, shard.offset, shard.group), y, temperature)
            return s.logprobs, s.entropy

        if torch.is_grad_enabled() and local.requires_grad:
            parts.append(checkpoint(stats, local[piece], flat[piece], use_reentrant=False))
        else:
            parts.append(stats(local[piece], flat[piece]))
    logprobs, entropy = (torch.cat(column) for column in zip(*parts))
    return TokenStats(logprobs.view_as(labels), entropy.view_as(labels))


@torch.no_grad()
def top_k(logits: torch.Tensor | VocabShard, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits / temperature at each position and their token ids, largest first, ties broken by
    the lowest id; from vocab-sharded logits, each shard's top k are exchanged (k·tp candidates), not the
    vocabulary."""
    shard = logits if isinstance(logits, VocabShard) else vocab_shard(logits)
    values, ids = _top_k_lowest_id(shard.local.float() / temperature, k)
    ids = ids + shard.offset
    if shard.group is not None:
        size = dist.get_world_size(shard.group)
        every_values = [torch.empty_like(values) for _ in range(size)]
        every_ids = [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(every_values, values, group=shard.group)
        dist.all_gather(every_ids, ids, group=shard.group)
        values, ids = _best(torch.cat(every_values, -1), torch.cat(every_ids, -1), k)
    return values, ids


def _best(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values and their ids, largest first, the lowest id first among equal values."""
    order = ids.argsort(dim=-1, stable=True)  # by id, so the stable sort below keeps the lowest id of a tie first
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    best = values.argsort(dim=-1, descending=True, stable=True)[..., :k]
    return values.gather(-1, best), ids.gather(-1, best)


def _top_k_lowest_id(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk, except that among values tied at the k-th, the lowest indices win (topk leaves it open):
    rows with such a tie are sorted stably instead."""
    k = min(k, x.shape[-1])
    values, ids = x.topk(k, dim=-1)
    last = values[..., -1:]
    tied = (x == last).sum(-1) > (values == last).sum(-1)  # more values equal the k-th than topk kept
    if tied.any():
        exact = x[tied].argsort(dim=-1, descending=True, stable=True)[..., :k]
        ids[tied] = exact
        values[tied] = x[tied].gather(-1, exact)
    return _best(values, ids, k)
