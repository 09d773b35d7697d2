"""Context parallelism for the LLM: each sample's tokens split over the cp group, attention exact across it.

Sharding (load-balanced for causal attention): every sample — padded to a multiple of 2·cp — is cut into
2·cp equal chunks and cp rank i keeps chunks i and 2·cp−1−i, so every rank holds an equal share of early
and late (cheap and expensive) queries. Positions keep their global values; labels were shifted before
sharding, so no chunk boundary pairs a logit with the wrong target. Padded (BSHD) batches are flattened
to one sample per row first: pads trail each row, so causal attention never reads them.

Attention: K/V of the local chunks are all-gathered within the cp group (GQA heads, before expansion; under
multi-head latent attention the per-token latent and rotary key, each rank expanding the keys and values it
reads) and put back in global order; the first and second local chunk of every sample then attend, causally, to the
prefix of their sample that ends at their own last position. PyTorch's experimental `context_parallel`
has no CPU rule for SDPA, so this is loom's own: the same code runs on gloo and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from loom.data.batch import Batch, target_rows, token_rows
from loom.data.spans import TokenSpans
from loom.models.attention import attend_prefix


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch ≥ 2.13 names it all_gather_single; 2.11 has all_gather_into_tensor
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


class _GatherTokens(torch.autograd.Function):
    """Concatenate every cp rank's equal-length local tokens (rank order); backward reduce-scatters, since
    every rank's queries contributed to the gradient of every rank's keys and values."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter_single(out, grad.contiguous(), ctx.group)
        return out, None


def zigzag_order(lengths: list[int], size: int) -> torch.Tensor:
    """Every cp rank's kept global token indices, rank after rank (rank r's are its share, in local order): per
    sample, chunks r and 2·size−1−r."""
    n = torch.tensor(lengths, dtype=torch.long)
    c, starts = n // (2 * size), n.cumsum(0) - n
    r = torch.arange(size)
    chunks = torch.stack([r, 2 * size - 1 - r], 1)  # [rank, half]
    run_starts = starts[None, :, None] + chunks[:, None, :] * c[None, :, None]  # [rank, sample, half]
    return _ranges(run_starts.reshape(-1), c[None, :, None].expand(size, -1, 2).reshape(-1))


def zigzag_indices(lengths: list[int], rank: int, size: int) -> list[int]:
    """Global token indices kept by cp rank `rank`: per sample, chunks rank and 2·size−1−rank."""
    return zigzag_order(lengths, size).view(size, -1)[rank].tolist()


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """arange(starts[i], starts[i] + counts[i]) for every i, concatenated: tensor ops, not a Python loop over
    tokens (microbatches of tens of thousands of tokens, on every rank, every microbatch)."""
    offsets = counts.cumsum(0) - counts  # where each range starts in the output
    return torch.repeat_interleave(starts - offsets, counts) + torch.arange(int(counts.sum()))


@dataclass(frozen=True)
class ContextShard:
    """What the attention of one cp rank needs for one batch; carried by TokenSpans.context."""

    group: dist.ProcessGroup
    q_rows: tuple[torch.Tensor, torch.Tensor]  # local rows of each sample's first / second kept chunk
    k_rows: tuple[torch.Tensor, torch.Tensor]  # gathered (rank-major) rows of the causal prefix each attends to
    q_spans: tuple[TokenSpans, TokenSpans]  # per-sample query lengths of each half
    k_spans: tuple[TokenSpans, TokenSpans]  # per-sample key prefix lengths of each half

    @torch.compiler.disable
    def sum_over_context(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (no gradient: counts) summed over the cp group, e.g. a sample's tokens per expert from its shards."""
        t = t.detach().clone()
        dist.all_reduce(t, group=self.group)
        return t

    @torch.compiler.disable  # its K/V collectives stay eager: a compiled block splits around them
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backend: str) -> torch.Tensor:
        k_all, v_all = _GatherTokens.apply(k, self.group), _GatherTokens.apply(v, self.group)
        return self._attend_halves(q, lambda rows: (k_all[rows], v_all[rows]), causal, backend)

    @torch.compiler.disable
    def attend_latent(self, q: torch.Tensor, latent: torch.Tensor, expand, causal: bool, backend: str
                      ) -> torch.Tensor:
        """Keys and values expanded from per-token `latent` rows (`expand(rows) -> (k, v)`): the latent crosses
        the cp group, not the expanded heads (DeepSeek-V3: 576 values a token against 128 · 320), and each half
        expands the prefix it reads — the expansion's cost grows with cp, the gather's shrinks by far more."""
        every = _GatherTokens.apply(latent, self.group)
        return self._attend_halves(q, lambda rows: expand(every[rows]), causal, backend)

    def _attend_halves(self, q: torch.Tensor, keys_of, causal: bool, backend: str) -> torch.Tensor:
        """Each sample's two local chunks attend to their causal prefixes; `keys_of(rows)`: (k, v) at gathered
        rows."""
        if not causal:
            raise ValueError("context parallel attention is causal only (encoders do not use cp)")
        out = None
        for half in (0, 1):
            kh, vh = keys_of(self.k_rows[half])
            qh, kh = q[self.q_rows[half]].to(vh.dtype), kh.to(vh.dtype)  # varlen needs one dtype
            oh = attend_prefix(qh, kh, vh, self.q_spans[half], self.k_spans[half], backend)
            if out is None:  # values may be narrower than keys (MLA): the output takes their width
                out = q.new_zeros((*q.shape[:-1], vh.shape[-1]))
            out = out.index_copy(0, self.q_rows[half], oh)
        return out


def shard_for_context(
    batch: Batch, group: dist.ProcessGroup, placeholder_ids: list[int]
) -> tuple[Batch, dict[int, torch.Tensor]]:
    """This cp rank's share of `batch` (always packed), and for each placeholder id the indices of its
    embedding rows that land on this rank (in local order) — the rows the LLM must insert here."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ids, labels, positions, lengths = _as_packed(batch)
    if any(n % (2 * size) for n in lengths):
        raise ValueError(f"context parallel needs every sample padded to a multiple of 2·cp = {2 * size}; "
                         f"got sample lengths {lengths} (set data.pad_to_multiple)")
    device = ids.device
    order = zigzag_order(lengths, size)
    keep = order.view(size, -1)[rank].to(device)  # every rank's share is equal: sum(lengths) / size
    selectors = {}
    for pid in placeholder_ids:
        is_slot = ids == pid
        slot_index = torch.cumsum(is_slot, 0) - 1  # which row of this modality each placeholder takes
        selectors[pid] = slot_index[keep][is_slot[keep]]
    local_lengths = [n // size for n in lengths]
    shard = _context(group, lengths, order, rank, size, device)
    counted = batch.spans.counted
    spans = replace(TokenSpans.from_lengths(local_lengths, device, batch.spans.backend), context=shard,
                    counted=None if counted is None else counted.reshape(-1)[keep])
    fields = {name: values.reshape(-1)[keep] for name, values in batch.fields.items()}  # shaped like the labels
    local_labels = labels[keep]
    targets = None if batch.targets is None else target_rows(local_labels)  # this rank's own target rows
    local = Batch(ids[keep], local_labels, positions[keep], spans, batch.modality_inputs, fields=fields,
                  targets=targets)
    return local, selectors


def _as_packed(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    if batch.spans.packed:
        cu = batch.spans.cu_seqlens.tolist()
        return batch.input_ids, batch.labels, batch.positions, [b - a for a, b in zip(cu[:-1], cu[1:])]
    rows, seq = batch.input_ids.shape  # one sample per row; trailing pads are never attended (causal)
    return (batch.input_ids.reshape(-1), batch.labels.reshape(-1), token_rows(batch.positions, batch.labels),
            [seq] * rows)


def _context(group, lengths: list[int], gathered: torch.Tensor, rank: int, size: int, device) -> ContextShard:
    """`gathered`: zigzag_order's global indices, in the order the cp all-gather puts the tokens."""
    kv_order = torch.empty_like(gathered)
    kv_order[gathered] = torch.arange(gathered.numel())  # global index → position in the gathered rows
    n = torch.tensor(lengths, dtype=torch.long)
    c = n // (2 * size)  # a chunk's tokens, per sample
    local_starts, global_starts = 2 * (c.cumsum(0) - c), n.cumsum(0) - n
    q_rows, k_rows, q_lens, k_lens = [], [], [], []
    for half, chunk in enumerate((rank, 2 * size - 1 - rank)):
        # each sample's half-th local chunk, and the keys of its causal prefix: its sample's first chunk+1 chunks
        q_rows.append(_ranges(local_starts + half * c, c).to(device))
        k_rows.append(kv_order[_ranges(global_starts, (chunk + 1) * c)].to(device))
        q_lens.append(c.tolist())
        k_lens.append(((chunk + 1) * c).tolist())
    assert int(2 * c.sum()) == sum(lengths) // size
    return ContextShard(
        group,
        (q_rows[0], q_rows[1]),
        (k_rows[0], k_rows[1]),
        tuple(TokenSpans.from_lengths(q_lens[h], device) for h in (0, 1)),
        tuple(TokenSpans.from_lengths(k_lens[h], device) for h in (0, 1)),
    )
