"""Expert parallelism's exchange: each token travels once to every EP rank whose experts it chose, and once back.

Source rank. A token's k choices fall on some of the EP group's ranks; it is sent to each of those ranks once, as
one row, with which of that rank's local experts it chose and their routing weights (`_Route.routing`), in
(rank, token) order. The rows that come back — one per (token, rank), each already that rank's weighted sum — are summed
per token over its ranks, lowest rank first (row_moves.py `Copies`: no scatter-add, forward or backward).

Destination rank. Each arrived row is copied once per local expert it chose, in arrival order (source, token,
choice); the experts compute the copies, each copy's place in (local expert, source, token) order computed from
its expert id (the grouped kernel moves rows straight there); each copy is weighted and a row's copies summed
into one row, which goes home by the reverse all-to-all.

Collectives per dispatch, all in the EP group: one even all-to-all of counts (rows per rank, copies per local
expert, rows per copy number), read on the host once; the rows and their routing by uneven all-to-alls whose
backward is the reverse one; the sums home by one more. Nothing depends on arrival timing: deterministic.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loom.models.experts import Experts
from loom.models.row_moves import Copies, gather_copies, inverse, sum_copies, take_rows

# inductor sizes kernels for an unbacked dim by a hint (8192 unless given); older torch may lack the argument
_HAS_HINT = "hint_override" in inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


@dataclass(frozen=True)
class _Trip:
    """What the combine needs of a dispatch: the copies' weights, both sums' plans and the split sizes. It crosses
    the compiled frame between them untouched: dynamo guards on none of it (tests/test_ep_recompiles.py)."""

    weights: torch.Tensor
    arrived: Copies
    sent: Copies
    send: list[int]
    recv: list[int]


def exchange(group: dist.ProcessGroup, ep: int, experts: Experts, x: torch.Tensor, ids: torch.Tensor,
             weights: torch.Tensor) -> torch.Tensor:
    """`x` [n, hidden], `ids` / `weights` [n, k] each token's (global) experts and routing weights: the weighted
    sums [n, hidden]. Under compile the two exchanges run eagerly and the experts compiled on a row count dynamo
    treats as unbacked (below)."""
    if not experts.use_grouped(x):  # the per-expert loop reads its counts on the host: all of it eager
        return _exchange_eagerly(group, ep, experts, x, ids, weights)
    return _exchange(group, ep, experts, x, ids, weights)


def _exchange(group: dist.ProcessGroup, ep: int, experts: Experts, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    copies, counts, back, trip = _dispatch(group, ep, x, ids, weights, experts.num_experts)
    weights_ = (_local(p) for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    y = experts.compute(copies, counts, *weights_, back=back)
    return _combine(group, y, trip)


_exchange_eagerly = torch.compiler.disable(_exchange)


@torch.compiler.disable  # split sizes from the host: as ints in a compiled frame every step's values were guards
def _dispatch(group: dist.ProcessGroup, ep: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Trip]:
    """The copies this rank's experts compute (arrival order), the copies of each local expert, each copy's place
    in expert order, and what the combine needs."""
    local = num_experts // ep
    slots = min(ids.shape[1], local)  # the most choices a token can have on one rank: a row's slots
    route = _Route(ids, local, ep)
    sizes = torch.cat([route.rows_per_rank().unsqueeze(1), route.expert_counts(num_experts),
                       route.rows_with_more_than(slots)], 1)  # [ep, 1 + local + slots]
    received = torch.empty_like(sizes)  # [source, …]: what each EP rank sends to mine
    dist.all_to_all_single(received, sizes, group=group)
    # the host needs the split sizes and the sums' layer sizes: one read (the grouped kernel reads nothing more)
    host = torch.cat([sizes[:, 0], received[:, 0], received[:, 1 + local:].sum(0),
                      route.tokens_with_more_than(min(ids.shape[1], ep))]).cpu().tolist()
    send, recv = host[:ep], host[ep:2 * ep]
    arrived_layers, sent_layers = host[2 * ep:2 * ep + slots], host[2 * ep + slots:]
    sent = route.sent(send, sent_layers)
    rows = _AllToAll.apply(gather_copies(x, sent), recv, send, group)
    routing = _AllToAll.apply(route.routing(weights, sum(send), slots), recv, send, group)
    copies, weight, back, arrived = _arrived(rows, routing, local, arrived_layers)
    # the compiled frame sees row counts with no value to guard on (no 0/1 case, no bound): one graph for all,
    # sized by the copies made here (the balanced case's copies received)
    for t in (copies, back):
        torch._dynamo.decorators.mark_unbacked(t, 0, **({"hint_override": ids.numel()} if _HAS_HINT else {}))
    counts = received[:, 1:1 + local].sum(0)
    return copies, counts, back, _Trip(weight, arrived, sent, send, recv)


@torch.compiler.disable
def _combine(group: dist.ProcessGroup, y: torch.Tensor, trip: _Trip) -> torch.Tensor:
    """The copies' outputs weighted, summed per arrived row, sent home and summed per token over its ranks."""
    rows = sum_copies(y * trip.weights.unsqueeze(-1).to(y.dtype), trip.arrived)
    return sum_copies(_AllToAll.apply(rows, trip.send, trip.recv, group), trip.sent)


class _Route:
    """A source rank's routing by EP rank: which ranks each token goes to, and where its rows and choices go."""

    def __init__(self, ids: torch.Tensor, local: int, ep: int) -> None:
        self.ids, self.local, self.ep = ids, local, ep
        self.n, self.k = ids.shape
        rank = ids // local  # [n, k]
        ranks = torch.arange(ep, device=ids.device)
        self.per_rank = (rank.unsqueeze(-1) == ranks).sum(1)  # [n, ep]: token t's choices on rank r
        chosen = (self.per_rank > 0).t().flatten()  # [ep · n], rank-major: the rows sent, in this order
        self.chosen = chosen
        # each (rank, token) row's place in the send buffer, and each choice's slot in its row (the choices of
        # the same token on the same rank before it)
        self.place = (chosen.cumsum(0) - chosen.long()).view(ep, self.n)
        self.row = self.place.gather(0, rank.t()).t()  # [n, k]
        same = rank.unsqueeze(-1) == rank.unsqueeze(-2)
        self.slot = same.tril(-1).sum(-1)  # [n, k]

    def rows_per_rank(self) -> torch.Tensor:
        """[ep]: the rows sent to each rank (its tokens)."""
        return (self.per_rank > 0).sum(0)

    def expert_counts(self, num_experts: int) -> torch.Tensor:
        """[ep, local]: the choices of each expert, by the rank holding it."""
        flat = self.ids.flatten()
        return flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat)).view(self.ep, self.local)

    def rows_with_more_than(self, slots: int) -> torch.Tensor:
        """[ep, slots]: of the rows sent to each rank, how many carry more than j choices."""
        return (self.per_rank.t().unsqueeze(-1) > torch.arange(slots, device=self.ids.device)).sum(1)

    def tokens_with_more_than(self, ways: int) -> torch.Tensor:
        """[ways]: how many tokens go to more than j ranks."""
        return ((self.per_rank > 0).sum(1, keepdim=True) > torch.arange(ways, device=self.ids.device)).sum(0)

    def sent(self, send: list[int], layers: list[int]) -> Copies:
        """The rows sent as copies of the tokens: row (rank, token) in rank-major order; a token's j-th copy its
        j-th rank's (lowest first), so the rows coming back are summed in rank order."""
        n, device = self.n, self.ids.device
        total = sum(send)
        # the chosen (rank, token) pairs first, in order (a stable sort: no host read of their number)
        source = self.chosen.logical_not().to(torch.uint8).argsort(stable=True)[:total] % max(n, 1)
        ways = (self.per_rank > 0).sum(1)
        ranks = torch.where(self.per_rank > 0, torch.arange(self.ep, device=device), self.ep).sort(1).values
        by_ways = ways.argsort(descending=True, stable=True)
        place = self.place.flatten()
        plan = []
        for j, m in enumerate(layers):
            if m:  # sizes from the host: an empty layer costs no kernel
                tokens = by_ways[:m]
                plan.append((tokens, place.index_select(0, ranks[:, j].index_select(0, tokens) * n + tokens)))
        return Copies(source, tuple(plan), n)

    def routing(self, weights: torch.Tensor, rows: int, slots: int) -> torch.Tensor:
        """[rows, 2 · slots] (fp32, or the weights' wider dtype): per row sent, its chosen local experts' weights
        then ids (padded: weight 0, id `local`), in choice order. One collective, not two: ids below 2²⁴ are exact
        in fp32."""
        dtype = torch.promote_types(weights.dtype, torch.float32)
        at = (self.row * slots + self.slot).flatten()
        ids = self.ids.new_full((rows * slots,), self.local).index_copy_(0, at, (self.ids % self.local).flatten())
        # the weights' gradient comes back through index_copy's backward: a gather
        w = weights.new_zeros(rows * slots).index_copy(0, at, weights.flatten())
        return torch.cat([w.to(dtype).view(rows, slots), ids.to(dtype).view(rows, slots)], 1)


def _arrived(rows: torch.Tensor, routing: torch.Tensor, local: int,
             layers: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Copies]:
    """The arrived rows copied once per chosen local expert (row-major), each copy's weight, its place in expert
    order, and the copies as a plan to sum them back into rows."""
    slots = routing.shape[1] // 2
    weights, ids = routing[:, :slots], routing[:, slots:].detach().long()
    per_row = (ids < local).sum(1)  # each row's choices fill its first slots
    copies, device = sum(layers), rows.device
    start = per_row.cumsum(0) - per_row
    # output_size from the host's counts: without it repeat_interleave reads its total back (a second sync)
    row = torch.repeat_interleave(torch.arange(rows.shape[0], device=device), per_row, output_size=copies)
    slot = row * slots + torch.arange(copies, device=device) - start.index_select(0, row)
    expert = ids.flatten().index_select(0, slot)
    back = inverse(expert.argsort(stable=True))  # stable: (expert, source, token), as the rows arrived
    by_copies = per_row.argsort(descending=True, stable=True)
    plan = Copies(row, tuple((by_copies[:m], start.index_select(0, by_copies[:m]) + j) for j, m in
                             enumerate(layers) if m), rows.shape[0])
    return gather_copies(rows, plan), take_rows(weights.flatten(), slot), back, plan


class _AllToAll(torch.autograd.Function):
    """An uneven all-to-all whose backward is the reverse one; eager and a plain tensor out (functional
    collectives hand back an AsyncCollectiveTensor, a subclass `mark_unbacked` refuses)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.sizes, ctx.group = (recv, send), group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv, send = ctx.sizes
        return _AllToAll.apply(grad, send, recv, ctx.group), None, None, None
