"""The bridge of the three-phase step: an encoder's rows for a whole step to the LLM's first pipeline stage.

With a pipelined LLM (pp > 1) colocated with unpipelined encoders, every rank runs its encoder replica on
all of the step's microbatches at once (phase 1), but only the LLM's stage-0 ranks consume modality rows.
The LLM's pp dim is outermost, so an LLM replica is no contiguous block of ranks and the colocated bridge's
blocks do not apply; this bridge routes rows explicitly instead:
- forward: the first tp rank of each encoder replica sends each chunk of its rows to every stage-0 rank
  (all tp and cp ranks) of the LLM replica whose samples they are;
- backward: after the LLM's schedule (phase 2), each LLM replica's first stage-0 rank sends the rows'
  gradients (summed over its cp group first: each cp rank inserted only its own tokens' rows) to every rank
  of the encoder replica that produced them, which then runs the encoder's backward (phase 3).
Which encoder replica holds which LLM replica's samples is the same fan-in / fan-out / equal assignment as
the colocated bridge (train/step_parts.py `split_encoder_parts`), microbatch after microbatch; every rank
derives all chunks from host row counts, so one all_to_all_single moves each direction and nothing is read back.
These are explicit calls, not autograd: every rank takes part in both, including ranks that consume nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.bridge.replica_rows import ReplicaRows, sum_over_context
from loom.bridge.routes import consumers, producers, step_chunks
from loom.topology.grid import Grid
from loom.topology.layout import DIMS


class FirstStageBridge:
    """Moves one encoder's rows to the LLM's stage-0 ranks and their gradients back; built once."""

    def __init__(self, src: Grid, dst: Grid) -> None:
        if src.layout.ranks != dst.layout.ranks:
            raise ValueError(f"{src.module} and {dst.module} are not colocated")
        d = dst.layout
        self.group = src.group(*DIMS)  # every rank of both grids
        self.members = dist.get_process_group_ranks(self.group)
        me = dist.get_rank()
        self.producers, self.consumers = producers(src), consumers(dst)
        self.my_encoder = src.coord(me)["dp"]
        self.my_llm = dst.coord(me)["dp"] if me in self.consumers[dst.coord(me)["dp"]] else None
        self.cp_group = dst.group("cp") if d.cp > 1 and self.my_llm is not None else None

    def consumes(self) -> bool:
        """Whether this rank is an LLM stage-0 rank (it receives rows and sends their gradients)."""
        return self.my_llm is not None

    def forward(self, rows: torch.Tensor, counts: list[ReplicaRows]) -> torch.Tensor | None:
        """rows: this rank's encoder output for the whole step ([rows, hidden], microbatch after microbatch);
        returns this rank's LLM replica's rows for the whole step on stage-0 ranks, None elsewhere."""
        sends, recvs, me = {}, {}, dist.get_rank()
        for c in step_chunks(counts):
            if self.producers[c.encoder][0] == me:
                for r in self.consumers[c.llm]:
                    sends.setdefault(r, []).append((c.src, c.n))
            if c.llm == self.my_llm:
                recvs.setdefault(self.producers[c.encoder][0], []).append((c.dst, c.n))
        total = sum(counts[k].llm[self.my_llm] for k in range(len(counts))) if self.consumes() else 0
        out = self._route(rows, sends, recvs, total)
        return out if self.consumes() else None

    def backward(self, grad: torch.Tensor | None, counts: list[ReplicaRows], like: torch.Tensor) -> torch.Tensor:
        """grad: the gradient of the rows `forward` returned (stage-0 ranks; None elsewhere); returns the
        gradient of this rank's encoder output `like`."""
        if grad is not None:
            grad = sum_over_context(grad, self.cp_group)
        sends, recvs, me = {}, {}, dist.get_rank()
        for c in step_chunks(counts):
            sender = self.consumers[c.llm][0]
            if sender == me:
                for r in self.producers[c.encoder]:
                    sends.setdefault(r, []).append((c.dst, c.n))
            if c.encoder == self.my_encoder:
                recvs.setdefault(sender, []).append((c.src, c.n))
        source = grad if grad is not None else like.new_empty((0, like.shape[-1]))
        return self._route(source, sends, recvs, like.shape[0], like)

    def _route(self, x: torch.Tensor, sends: dict, recvs: dict, total: int, like: torch.Tensor | None = None
               ) -> torch.Tensor:
        """One all_to_all_single: sends[rank] lists (offset, n) row runs of `x` for that rank, in order;
        recvs[rank] lists where the runs from that rank land in the result of `total` rows, in order."""
        like = x if like is None else like
        order = self.members
        in_splits = [sum(n for _, n in sends.get(r, [])) for r in order]
        out_splits = [sum(n for _, n in recvs.get(r, [])) for r in order]
        pieces = [x[o : o + n] for r in order for o, n in sends.get(r, [])]
        payload = torch.cat(pieces) if pieces else like.new_empty((0, like.shape[-1]))
        received = like.new_empty((sum(out_splits), like.shape[-1]))
        dist.all_to_all_single(received, payload.contiguous(), out_splits, in_splits, group=self.group)
        # the runs tile the result: put them in place by their offsets
        runs, at = [], 0
        for r in order:
            for o, n in recvs.get(r, []):
                runs.append((o, at, n))
                at += n
        runs.sort()
        if runs and (runs[0][0] != 0 or any(a[0] + a[2] != b[0] for a, b in zip(runs, runs[1:]))
                     or runs[-1][0] + runs[-1][2] != total):
            raise RuntimeError(f"first-stage bridge: received row runs {runs} do not tile {total} rows")
        if not runs:
            return like.new_zeros((total, like.shape[-1]))
        return torch.cat([received[a : a + n] for _, a, n in runs])
