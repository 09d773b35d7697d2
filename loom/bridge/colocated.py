"""The colocated bridge: modality embeddings from an encoder's data-parallel shards to the LLM's.

Both grids span the same ranks, tp fastest, so a replica of either module is a contiguous block of ranks.
The module with fewer replicas has the larger blocks, and each of its blocks holds whole replicas of the
other module:
- fan-in (encoder dp > LLM dp): an LLM replica needs the rows of the k encoder replicas inside its block.
  Forward gathers them; backward narrows the (replicated) gradient back to this rank's rows.
- fan-out (encoder dp < LLM dp): an encoder replica's rows cover k LLM replicas. Forward narrows to this
  rank's LLM replica; backward gathers the k replicas' gradients back into the encoder's order.
- equal: the replicas coincide; nothing moves.
Rows are ragged — samples carry different numbers of modality tokens — so only flat [rows, hidden] tensors
move: each replica's first rank sends its rows once to every other rank of the block (one batch of
point-to-point sends of the same tensor), the other ranks send none. Every rank knows every replica's row
count from host data (train/inputs.py), so nothing is read back from the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.bridge.replica_rows import ReplicaRows, sum_over_context
from loom.topology.grid import Grid


def exchange_rows(x: torch.Tensor, counts: list[int], me: int, send: bool, group: dist.ProcessGroup) -> torch.Tensor:
    """Every sender's rows, concatenated in group-rank order, on every rank of the group. counts[i]: the rows
    group member i sends (0 for a non-sender); `me` is this rank's index in the group."""
    if send and x.shape[0] != counts[me]:
        raise RuntimeError(f"bridge: this rank holds {x.shape[0]} rows, but its samples say it sends {counts[me]}")
    members = dist.get_process_group_ranks(group)
    out = x.new_empty((sum(counts), *x.shape[1:]))
    starts = [sum(counts[:i]) for i in range(len(counts))]
    # One batch of sends that all read the same payload (no copy per destination) and receives straight into
    # `out`: on NCCL a single grouped launch, like all_to_all (built on the same send/recv); all_to_all_single
    # needs one copy of the rows per destination in its input, gloo has no uneven all_gather or all_to_all.
    ops = [dist.P2POp(dist.irecv, out[starts[i] : starts[i] + n], members[i], group)
           for i, n in enumerate(counts) if n and i != me]
    if send and counts[me]:
        payload = x.contiguous()
        ops += [dist.P2POp(dist.isend, payload, r, group) for i, r in enumerate(members) if i != me]
        out[starts[me] : starts[me] + counts[me]] = payload
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return out


class _GatherRows(torch.autograd.Function):
    """forward: gather the senders' rows; backward: this rank's slice of the gradient (no communication:
    every rank of the block holds the same full gradient)."""

    @staticmethod
    def forward(ctx, x, counts: list[int], me: int, send: bool, sender_index: int, group, cp_group) -> torch.Tensor:
        """sender_index: group rank of the member that sends this rank's replica (its first rank)."""
        out = exchange_rows(x, counts, me, send, group)
        ctx.offset = sum(counts[:sender_index])
        ctx.rows, ctx.cp_group = x.shape[0], cp_group
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = sum_over_context(grad, ctx.cp_group)
        return grad[ctx.offset : ctx.offset + ctx.rows], None, None, None, None, None, None


class _NarrowRows(torch.autograd.Function):
    """forward: rows [start, start + length) of this rank's encoder output; backward: gather every LLM
    replica's gradient rows (one sender per replica) back into the encoder replica's full order."""

    @staticmethod
    def forward(ctx, x, start: int, length: int, counts: list[int], me: int, send: bool, group, cp_group):
        ctx.counts, ctx.me, ctx.send, ctx.group, ctx.cp_group = counts, me, send, group, cp_group
        return x[start : start + length].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = sum_over_context(grad, ctx.cp_group)
        full = exchange_rows(grad.contiguous(), ctx.counts, ctx.me, ctx.send, ctx.group)
        return full, None, None, None, None, None, None, None


class _SumOverContext(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the LLM's cp group (equal dp under cp)."""

    @staticmethod
    def forward(ctx, x, cp_group):
        ctx.cp_group = cp_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return sum_over_context(grad, ctx.cp_group), None


class ColocatedBridge:
    """Moves one encoder's embeddings to the LLM's layout on this rank; built once, at start-up."""

    def __init__(self, src: Grid, dst: Grid, debug_checks: bool = False) -> None:
        if src.layout.ranks != dst.layout.ranks:
            raise ValueError(f"{src.module} and {dst.module} are not colocated")
        self.src, self.dst = src, dst
        self.debug_checks = debug_checks
        me = dist.get_rank()
        self.src_dp, self.dst_dp = src.layout.dp, dst.layout.dp
        self.src_coord, self.dst_coord = src.coord(me), dst.coord(me)
        self.senders: list[int | None] = []  # per group member: the replica (dp index) it sends, or None
        if self.src_dp > self.dst_dp:  # fan-in: the block is the LLM replica, each encoder replica sends
            self.mode = "fan-in"
            self.group = dst.group("tp", "cp")
            members = dist.get_process_group_ranks(self.group)
            self.senders = [src.coord(r)["dp"] if src.coord(r)["tp"] == 0 else None for r in members]
            # encoder replicas are contiguous runs of ranks (tp fastest): the first one of mine sends
            self.sender_index = members.index(me) - self.src_coord["tp"]
        elif self.src_dp < self.dst_dp:  # fan-out: the block is the encoder replica, each LLM replica sends
            self.mode = "fan-out"
            self.group = src.group("tp")
            members = dist.get_process_group_ranks(self.group)
            first = lambda c: c["tp"] == 0 and c["cp"] == 0  # noqa: E731
            self.senders = [dst.coord(r)["dp"] if first(dst.coord(r)) else None for r in members]
        else:
            self.mode, self.group = "equal", None
            members = [me]
        self.me = members.index(me)
        self.send = bool(self.senders) and self.senders[self.me] is not None
        self.cp_group = dst.group("cp") if dst.layout.cp > 1 else None

    def __call__(self, rows: torch.Tensor, counts: ReplicaRows) -> torch.Tensor:
        """rows: this rank's encoder output ([rows, hidden], its encoder replica's samples in order);
        counts: every replica's row count on both sides (host data). Returns the rows of this rank's LLM
        replica's samples, in order."""
        if self.debug_checks:
            check_replicated(rows, self.src.group("tp"), f"{self.src.module} encoder")
        if self.mode == "equal":
            return _SumOverContext.apply(rows, self.cp_group) if self.cp_group is not None else rows
        if self.mode == "fan-in":  # the LLM replica's samples are its block's encoder replicas', in order
            sent = [counts.encoder[dp] if dp is not None else 0 for dp in self.senders]
            return _GatherRows.apply(rows, sent, self.me, self.send, self.sender_index, self.group, self.cp_group)
        # fan-out: the encoder replica's samples are its block's LLM replicas', in order
        first = self.src_coord["dp"] * (self.dst_dp // self.src_dp)
        start = sum(counts.llm[first : self.dst_coord["dp"]])
        sent = [counts.llm[dp] if dp is not None else 0 for dp in self.senders]
        return _NarrowRows.apply(rows, start, counts.llm[self.dst_coord["dp"]], sent, self.me, self.send,
                                 self.group, self.cp_group)


def check_replicated(x: torch.Tensor, group: dist.ProcessGroup, what: str) -> None:
    """Debug check: `x` must be bit-identical on every rank of `group` (an encoder's TP ranks)."""
    if dist.get_world_size(group) == 1:
        return
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, x.detach().contiguous(), group=group)
    for i, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            diff = float((other.float() - gathered[0].float()).abs().max())
            raise RuntimeError(f"{what}: output differs between its tp ranks (rank {i} of the group, max |Δ| {diff:g})")
