"""The point-to-point bridge: an encoder on its own ranks feeds the LLM's first stage on others (non-colocated).

Microbatch by microbatch, the first tp rank of each encoder replica (of its last stage, when the encoder is
pipelined) sends each chunk of its rows (flat `[rows, hidden]`, ragged over samples) to every stage-0 rank of
the LLM replica whose samples they are (its cp and tp peers get the same tensor: one send each, no copy per
peer); after the LLM's stage 0 has run that microbatch's backward, the rows' gradient, summed over the LLM's
cp group (each cp rank inserted only its own tokens' rows), goes from the replica's first stage-0 rank to
every rank of the producing encoder replica (stage).
Routes and row counts come from host data (bridge/routes.py), so no shape is exchanged before a send and
every receive is posted into its final place.

Ordering: NCCL matches a pair's messages by the order they are launched (and a GPU may run its NCCL
kernels in launch order), so both sides launch them in one order — the LLM stage 0's forward/backward order
(train/encoder_ranks.py and train/rows.py `ReceivedRows`). Gloo matches by tag: each message's tag is unique
per microbatch and bridge, and a test checks the launch orders agree, which gloo alone would not show. Rows go
over the default group, gradients over a group of their own, so the two kinds never share a communicator's
queue.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.bridge.replica_rows import ReplicaRows, sum_over_context
from loom.bridge.routes import Chunk, consumers, producers, step_chunks
from loom.topology.grid import Grid


class P2PBridge:
    """One encoder's rows from its grid to the LLM's stage-0 ranks on disjoint ranks, and their gradients back.
    `index`/`count`: this bridge among the job's bridges (a message's tag is unique per microbatch and bridge)."""

    def __init__(self, src: Grid, dst: Grid, rows_group: dist.ProcessGroup, grads_group: dist.ProcessGroup,
                 index: int, count: int) -> None:
        if set(src.layout.ranks) & set(dst.layout.ranks):
            raise ValueError(f"{src.module} and {dst.module} share ranks: use a colocated bridge")
        self.module = src.module
        self.producers, self.consumers = producers(src), consumers(dst)
        self.rows_group, self.grads_group = rows_group, grads_group
        self.index, self.count = index, count
        me = dist.get_rank()
        # the replica whose rows this rank sends: on its encoder's last pipeline stage only
        last = src.contains(me) and src.coord(me)["pp"] == src.layout.pp - 1
        self.my_encoder = src.coord(me)["dp"] if last else None
        self.my_llm = next((d for d, ranks in enumerate(self.consumers) if me in ranks), None)
        self.cp_group = dst.group("cp") if dst.layout.cp > 1 and self.my_llm is not None else None

    def consumes(self) -> bool:
        """Whether this rank is one of the LLM's stage-0 ranks (it receives rows and returns their gradients)."""
        return self.my_llm is not None

    def _tag(self, mb: int) -> int:
        return mb * self.count + self.index

    def _chunks(self, counts: ReplicaRows) -> list[Chunk]:
        return step_chunks([counts])

    # ------------------------------------------------------------ encoder side

    def send_rows(self, rows: torch.Tensor, counts: ReplicaRows, mb: int) -> list:
        """This rank's encoder output for microbatch `mb` to the LLM ranks that insert it (first tp rank only)."""
        if rows.shape[0] != counts.encoder[self.my_encoder]:
            raise RuntimeError(f"p2p bridge ({self.module}): the encoder produced {rows.shape[0]} rows, but its "
                               f"samples say {counts.encoder[self.my_encoder]}")
        me, works = dist.get_rank(), []
        for c in self._chunks(counts):
            if self.producers[c.encoder][0] == me:
                payload = rows[c.src : c.src + c.n].contiguous()  # a row range of a contiguous tensor: no copy
                works += [dist.isend(payload, r, self.rows_group, tag=self._tag(mb)) for r in self.consumers[c.llm]]
        return works

    def receive_grads(self, counts: ReplicaRows, mb: int, like: torch.Tensor) -> torch.Tensor:
        """The gradient of this rank's rows of microbatch `mb` (`like`: their dtype, device and width)."""
        grad = like.new_zeros((counts.encoder[self.my_encoder], like.shape[-1]))
        _wait([dist.irecv(grad[c.src : c.src + c.n], self.consumers[c.llm][0], self.grads_group, tag=self._tag(mb))
               for c in self._chunks(counts) if c.encoder == self.my_encoder])
        return grad

    # ------------------------------------------------------------ LLM side

    def receive_rows(self, counts: ReplicaRows, mb: int, like: torch.Tensor) -> torch.Tensor:
        """This rank's LLM replica's rows of microbatch `mb`, each chunk received into its place."""
        rows = like.new_empty((counts.llm[self.my_llm], like.shape[-1]))
        _wait([dist.irecv(rows[c.dst : c.dst + c.n], self.producers[c.encoder][0], self.rows_group,
                          tag=self._tag(mb)) for c in self._chunks(counts) if c.llm == self.my_llm])
        return rows

    def send_grads(self, grad: torch.Tensor, counts: ReplicaRows, mb: int) -> list:
        """The gradient of the rows `receive_rows` delivered, summed over cp, to the encoder ranks that made them."""
        grad = sum_over_context(grad, self.cp_group)
        me, works = dist.get_rank(), []
        for c in self._chunks(counts):
            if c.llm == self.my_llm and self.consumers[c.llm][0] == me:
                payload = grad[c.dst : c.dst + c.n].contiguous()
                works += [dist.isend(payload, r, self.grads_group, tag=self._tag(mb))
                          for r in self.producers[c.encoder]]
        return works


def _wait(works: list) -> None:
    """Receives from several senders run together; the result is read only once all have arrived."""
    for work in works:
        work.wait()
