"""A pipelined encoder's hidden states from one stage to the next, and their gradients back, point to point.

Each rank of stage s talks to the rank of stage s + 1 (and s − 1) at its own dp and tp coordinates: the hidden
states are replicated over tp (TP's row-parallel outputs are all-reduced; under SP each stage's last layer
gathers them whole), so every tp rank sends its own copy and no rank fans out. A microbatch's row count comes
from host data (its items' rows, or the minimal input's when it has none), so every receive is posted into
its final place with no shape exchanged.

Ordering (train/encoder_ranks.py `stage_order`): a stage sends every microbatch's hidden states before it
takes any gradient back, and the next stage posts every receive before it sends any gradient, so both sides
of a pair launch their messages in one order, as NCCL needs. Gloo matches by tag: a message's tag is unique
per microbatch and encoder. Hidden states go over the default group, gradients over the bridge's gradient
group, as the bridge's rows and gradients do (bridge/p2p.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.topology.grid import Grid


class StageLink:
    """This rank's stage of encoder `grid.module` ↔ the neighbouring stages of its replica. `index`/`count`: the
    encoder among the job's encoders (tags); `like`: the hidden states' dtype, device and width."""

    def __init__(self, grid: Grid, acts_group: dist.ProcessGroup, grads_group: dist.ProcessGroup, index: int,
                 count: int, like: torch.Tensor) -> None:
        me = grid.coord(dist.get_rank())
        stage, stages = me["pp"], grid.layout.pp
        at = lambda s: grid.rank_at(pp=s, dp=me["dp"], cp=0, tp=me["tp"])  # noqa: E731
        self.prev = at(stage - 1) if stage > 0 else None  # whence this stage's input comes
        self.next = at(stage + 1) if stage < stages - 1 else None  # where its output goes
        self.acts_group, self.grads_group = acts_group, grads_group
        self.index, self.count, self.like = index, count, like

    def _tag(self, mb: int) -> int:
        return mb * self.count + self.index

    def receive_input(self, rows: int, mb: int) -> tuple[torch.Tensor, object]:
        """Microbatch `mb`'s input from the previous stage (`rows` rows), posted now: the tensor, and the
        receive to wait for before reading it."""
        h = self.like.new_empty((rows, self.like.shape[-1]))
        return h, dist.irecv(h, self.prev, self.acts_group, tag=self._tag(mb))

    def send_output(self, h: torch.Tensor, mb: int):
        """Microbatch `mb`'s output of this stage to the next stage."""
        return dist.isend(h.contiguous(), self.next, self.acts_group, tag=self._tag(mb))

    def receive_output_grad(self, rows: int, mb: int) -> torch.Tensor:
        """The gradient of microbatch `mb`'s output, from the next stage."""
        grad = self.like.new_empty((rows, self.like.shape[-1]))
        dist.irecv(grad, self.next, self.grads_group, tag=self._tag(mb)).wait()
        return grad

    def send_input_grad(self, grad: torch.Tensor, mb: int):
        """The gradient of microbatch `mb`'s input, to the previous stage."""
        return dist.isend(grad.contiguous(), self.prev, self.grads_group, tag=self._tag(mb))
