"""Expert parallelism's exchange in chunks (`parallel.ep_chunks = C`): each MoE layer's all-to-alls overlapped with
the experts' compute.

One exchange per layer (parallel/experts.py) leaves the all-to-alls exposed: the experts wait for every token to
arrive and the block for every output to come home. With C > 1 the MoE block sorts its tokens by (chunk, expert),
a chunk being a run of consecutive tokens (models/moe.py: the same sort, no extra row move), and hands counts
[C, E]: each chunk is an exchange of its own. All chunks' counts cross in one even all-to-all and their split
sizes reach the host in one read, as for one exchange; then, per chunk, in one order on every rank:

    dispatch 0 ─ dispatch 1 ─ combine 0 ─ dispatch 2 ─ combine 1 ─ …      (the EP group's stream, in issue order)
               └ experts 0 ─┴ experts 1 ─┴ experts 2 ─ …                   (the compute stream)

each all-to-all issued asynchronously (`async_op=True`) and waited on just before its rows are needed: chunk
i+1's dispatch and chunk i−1's combine travel while chunk i computes. A wait makes the compute stream wait for
the collective on CUDA (the host blocks on gloo, where only correctness is tested). Backward mirrors it: the
gradient's reverse all-to-all starts in the backward of the node that waited (`_Arrive`) and is waited for in
the backward of the node that started it (`_Send`); autograd runs later-made nodes first, so every combine's
reverse starts before the last chunk's experts differentiate, and each chunk's reverse dispatch travels while
the chunk before it differentiates. Every rank issues the same collectives in the same order, a chunk with no
row included (an empty exchange still takes part). Rows stay in host-given order: deterministic, no atomics.

Under compile the driver's own frame runs eagerly (`torch.compiler.disable(recursive=False)`) and calls only
eager helpers and `_grouped_experts`, a plain function of tensors that dynamo compiles as a frame of its own on
an unbacked row count: one graph for every chunk, layer and routing (tests/test_ep_recompiles.py).
A chunk that receives no row computes one zero row instead, as one exchange does (`arrival_places`).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from loom.models.experts import Experts, compute_dtype
from loom.parallel.local import local_tensor

# inductor sizes kernels for an unbacked dim by a hint (8192 unless given); older torch may lack the argument
_HAS_HINT = "hint_override" in inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters


def arrival_places(arrived: torch.Tensor, received: torch.Tensor, ep: int, recv: list[int],
                   hint: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows that `arrived` from the EP group (`received` [ep · local]: what each source sent each of my
    experts; `recv` its sums on the host) as the experts take them: the rows (one zero row if none), the counts
    and each row's place in expert order; the rows marked unbacked, hinted `hint`."""
    local = received.numel() // ep
    # arrival order is runs of (source, local expert); the experts want (local expert, source): each row's place
    # there is its run's start in that order plus its offset in the run (no sort; the experts move it there)
    runs = received.view(ep, local)
    by_source = runs.flatten().cumsum(0) - runs.flatten()
    by_expert = (runs.t().flatten().cumsum(0) - runs.t().flatten()).view(local, ep).t().flatten()
    # output_size from the host's counts: without it repeat_interleave reads its total back (a second sync)
    run = torch.repeat_interleave(torch.arange(ep * local, device=received.device), runs.flatten(),
                                  output_size=sum(recv))
    back = torch.arange(sum(recv), device=received.device) + (by_expert - by_source).index_select(0, run)
    if sum(recv) == 0:
        # nothing arrived: one zero row for the last local expert instead (output 0, gradients 0, dropped in
        # _combine; the cat keeps the all-to-all's backward in the graph), so the compiled experts never run on 0
        # rows — torch 2.11's inductor kernels fail to launch on an unbacked size of 0 (ZeroDivisionError, 4 H200s)
        arrived, back = torch.cat([arrived, arrived.new_zeros(1, *arrived.shape[1:])]), back.new_zeros(1)
        received = received.clone()
        received[-1] += 1
    # the compiled frame sees row counts with no value to guard on (no 0/1 case, no bound): one graph for all,
    # sized by the rows sent (the balanced case's rows received)
    for t in (arrived, back):
        torch._dynamo.decorators.mark_unbacked(t, 0, **({"hint_override": hint} if _HAS_HINT else {}))
    return arrived, received, back


class _InFlight:
    """One asynchronous all-to-all: its work handle and the tensors it reads and writes, held until it is waited
    for (freed earlier, the caching allocator could hand NCCL's buffers to the compute stream mid-transfer)."""

    def __init__(self) -> None:
        self.work = self.sent = self.out = None

    def start(self, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> None:
        self.sent = x.contiguous()
        self.out = x.new_empty(sum(recv), *x.shape[1:])
        self.work = dist.all_to_all_single(self.out, self.sent, recv, send, group=group, async_op=True)

    def finish(self) -> torch.Tensor:
        self.work.wait()
        out = self.out
        self.work = self.sent = self.out = None  # kept by autograd's ctx until backward: hold nothing large
        return out


class _Send(torch.autograd.Function):
    """Starts the all-to-all of `x` (split `send` out, `recv` in). Its output is an empty token that only orders
    autograd: the rows come out of `_Arrive`, which waits. Backward: waits for the reverse all-to-all that
    `_Arrive`'s backward started, and hands its rows on as `x`'s gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, flight: _InFlight, recv: list[int], send: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.flight = flight
        flight.start(x, recv, send, group)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token: torch.Tensor):
        return ctx.flight.finish(), None, None, None, None


class _Arrive(torch.autograd.Function):
    """Waits for the all-to-all `_Send` started and returns its rows. Backward: starts the reverse all-to-all of
    the rows' gradient and returns at once (the wait is `_Send`'s backward): what autograd runs in between
    overlaps it."""

    @staticmethod
    def forward(ctx, token: torch.Tensor, flight: _InFlight, recv: list[int], send: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.flight, ctx.sizes, ctx.group = flight, (recv, send), group
        return flight.finish()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv, send = ctx.sizes
        ctx.flight.start(grad, send, recv, ctx.group)
        return grad.new_empty(0), None, None, None, None


@torch.compiler.disable  # sizes from the host; the collectives eager
def _plan(group: dist.ProcessGroup, ep: int, x: torch.Tensor, counts: torch.Tensor, experts: Experts):
    """Every chunk's counts to the EP group (one even all-to-all) and all split sizes in one host read: what each
    source sends each local expert per chunk [ep, C, local], sent and received rows per chunk (host lists [C][ep]),
    x's chunks and the local weights."""
    chunks, num = counts.shape
    local = num // ep
    by_rank = counts.view(chunks, ep, local).transpose(0, 1).contiguous()  # [destination, chunk, local expert]
    received = torch.empty_like(by_rank)  # [source, chunk, local expert]
    dist.all_to_all_single(received, by_rank, group=group)
    send, recv = torch.stack([by_rank.sum(2).t(), received.sum(2).t()]).cpu().tolist()  # each [C][ep]
    pieces = torch.split(x, [sum(s) for s in send])  # one backward node: the chunks' gradients in one cat
    weights = tuple(local_tensor(p) for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    return received, send, recv, pieces, weights


@torch.compiler.disable
def _dispatch(piece: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup):
    flight = _InFlight()
    return _Send.apply(piece, flight, recv, send, group), flight


@torch.compiler.disable
def _arrive(sent: tuple[torch.Tensor, _InFlight], recv: list[int], send: list[int], group: dist.ProcessGroup,
            received: torch.Tensor, ep: int, hint: int):
    """Chunk's rows once they are here, as its experts take them (`arrival_places`)."""
    token, flight = sent
    arrived = _Arrive.apply(token, flight, recv, send, group)
    arrived, received, back = arrival_places(arrived, received.contiguous().view(-1), ep, recv, hint)
    return arrived, received.view(ep, -1).sum(0), back


@torch.compiler.disable
def _combine(y: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup):
    # without the zero row a chunk that received nothing computed
    return _dispatch(y.narrow(0, 0, sum(recv)), send, recv, group)


@torch.compiler.disable
def _home(sent: list, send: list[list[int]], recv: list[list[int]], group: dist.ProcessGroup) -> torch.Tensor:
    """Every chunk's outputs once home, in `x`'s order."""
    return torch.cat([_Arrive.apply(token, flight, s, r, group) for (token, flight), s, r in zip(sent, send, recv)])


def _grouped_experts(x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                     down: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    """`Experts.compute`'s grouped kernel as a function of tensors alone: under compile the frame dynamo compiles,
    the same for every layer (no module in it to guard on)."""
    return Experts._grouped(x.to(compute_dtype(x)), counts, (gate, up, down), back)


def _run(group: dist.ProcessGroup, ep: int, experts: Experts, x: torch.Tensor, counts: torch.Tensor,
         grouped: bool) -> torch.Tensor:
    """`x` [n, hidden] sorted by (chunk, expert), `counts` [C, E]: the experts' outputs in `x`'s order. Every call
    here but `compute` is an eager helper: this frame's own dynamo skips, the frames it calls it would compile."""
    compute = _grouped_experts if grouped else experts.compute
    received, send, recv, pieces, weights = _plan(group, ep, x, counts, experts)
    chunks, hint = len(send), max(1, x.shape[0] // len(send))
    dispatched = [_dispatch(pieces[0], recv[0], send[0], group)]
    combined = []
    for c in range(chunks):
        if c + 1 < chunks:  # the next chunk travels while this one computes
            dispatched.append(_dispatch(pieces[c + 1], recv[c + 1], send[c + 1], group))
        arrived, local_counts, back = _arrive(dispatched[c], recv[c], send[c], group, received[:, c], ep, hint)
        y = compute(arrived, local_counts, *weights, back)
        combined.append(_combine(y, recv[c], send[c], group))  # home while the next chunk computes
    return _home(combined, send, recv, group)


# the grouped kernel: this frame eager, the experts it calls compiled (a frame of their own). The wrapper makes a
# traced caller break its graph at the call; skipping the code itself keeps dynamo from looking at (and counting:
# tests/test_ep_recompiles.py) the frame on every call, which the wrapper alone leaves it doing
chunked_exchange = torch.compiler.disable(_run, recursive=False)
if hasattr(torch._dynamo.eval_frame, "skip_code"):
    torch._dynamo.eval_frame.skip_code(_run.__code__)
# the per-expert loop reads its counts on the host: all of it eager
chunked_exchange_eagerly = torch.compiler.disable(_run)
