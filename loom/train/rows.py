"""The rows seam: where each LLM microbatch's modality rows come from, and where their gradients go.

A step asks its row source four things, in this order (train/step.py):
- `begin(model, microbatches, train)`: before any LLM microbatch — the three-phase step's phase 1;
- `inserts(i, selectors)`: microbatch i's rows by placeholder id, when the LLM's first stage runs it (under
  cp only this rank's rows, which `selectors` pick);
- `backward_done(i)`: microbatch i's backward on the first stage is complete;
- `finish()`: after the LLM's last microbatch — the three-phase step's phase 3.
Three sources, one per placement:
- `LocalRows` (colocated, LLM not pipelined; one process): each microbatch's encoders run when the LLM asks,
  and the colocated bridge moves their rows inside autograd, so the backward needs nothing more;
- `WholeStepRows` (colocated, LLM pipelined): the encoders run once on the whole step, the first-stage bridge
  delivers the rows to the LLM's stage-0 ranks as leaves, and after the schedule their gradients go back and
  the encoders run their one backward;
- `ReceivedRows` (non-colocated): rows arrive point to point from the encoder ranks as each microbatch's
  forward runs; their gradients leave as soon as its backward is done (the encoder ranks' own program is
  train/encoder_ranks.py).
Forward only (`train=False`), no leaf is made and no gradient moves.
"""

from __future__ import annotations

from typing import Protocol

import torch

from loom.bridge.first_stage import FirstStageBridge
from loom.bridge.p2p import P2PBridge
from loom.data.batch import Batch
from loom.models.multimodal import MultimodalModel
from loom.parallel.gradient_sync import set_gradient_sync
from loom.train.inputs import StepBatch

Inserts = dict[int, torch.Tensor]  # placeholder id → the rows that replace its occurrences, in order


class RowSource(Protocol):
    def begin(self, model: MultimodalModel, microbatches: list[StepBatch], train: bool) -> None: ...

    def inserts(self, i: int, selectors: dict | None) -> Inserts: ...

    def backward_done(self, i: int) -> None: ...

    def finish(self) -> None: ...


def llm_inserts(model: MultimodalModel, llm: Batch, rows: dict[str, torch.Tensor], selectors: dict | None) -> Inserts:
    """Each modality's rows by placeholder id, checked against the whole LLM part `llm` (placeholder counts
    from its host copy: no device sync); under CP only this rank's rows, which `selectors` pick."""
    slots = {name: llm.count(pid) for name, pid in model.placeholder_ids.items()}
    inserts = model.inserts(llm.input_ids, rows, slots)
    return {pid: part[selectors[pid]] for pid, part in inserts.items()} if selectors else inserts


class LocalRows:
    """Every encoder runs on this rank's part of microbatch i when the LLM asks for its rows; `bridges` (colocated
    layouts; none on one process) move them from the encoder replica's samples to the LLM replica's."""

    def __init__(self, bridges: dict | None = None) -> None:
        self.bridges = bridges or {}

    def begin(self, model: MultimodalModel, microbatches: list[StepBatch], train: bool) -> None:
        self.model, self.microbatches = model, microbatches

    def inserts(self, i: int, selectors: dict | None) -> Inserts:
        mb, rows = self.microbatches[i], {}
        for name in self.model.encoder_names:
            rows[name] = self.model.encoder(name)(mb.encoder_items.get(name, []))
            if name in self.bridges:
                rows[name] = self.bridges[name](rows[name], mb.rows[name])
        return llm_inserts(self.model, mb.llm, rows, selectors)

    def backward_done(self, i: int) -> None:
        pass  # the bridge is in the graph: the microbatch's backward reached the encoders already

    def finish(self) -> None:
        self.microbatches = []


class WholeStepRows:
    """Phases 1 and 3 of the three-phase step: each encoder once on its share of the whole step, its rows to
    the LLM's stage-0 ranks (where they become leaves the microbatches slice), and, after the LLM's schedule,
    the leaves' gradients back to the encoder replicas that made them, then the encoders' one backward — so
    FSDP reduces the encoders' gradients once, over the whole step."""

    def __init__(self, bridges: dict[str, FirstStageBridge], first_stage: bool) -> None:
        self.bridges, self.first_stage = bridges, first_stage

    def begin(self, model: MultimodalModel, microbatches: list[StepBatch], train: bool) -> None:
        self.model, self.microbatches, self.train = model, microbatches, train
        if train:
            set_gradient_sync(model, True)  # the encoders run one forward and one backward per step
        self.encoded, self.rows = {}, {}
        for name in model.encoder_names:
            self.encoded[name] = model.encoder(name)([x for mb in microbatches for x in mb.encoder_items.get(name, [])])
            delivered = self.bridges[name].forward(self.encoded[name].detach(), self._counts(name))
            self.rows[name] = delivered.requires_grad_() if train and delivered is not None else delivered
        # microbatch i's rows start after the earlier microbatches' (they arrive in microbatch order)
        self.starts = {name: [0] for name in model.encoder_names}
        for name, pid in model.placeholder_ids.items():
            for mb in microbatches[:-1]:
                self.starts[name].append(self.starts[name][-1] + mb.llm.count(pid))

    def _counts(self, name: str) -> list:
        return [mb.rows[name] for mb in self.microbatches]

    def inserts(self, i: int, selectors: dict | None) -> Inserts:
        if not self.first_stage:
            return {}
        llm, mine = self.microbatches[i].llm, {}
        for name, rows in self.rows.items():
            start = self.starts[name][i]
            mine[name] = rows[start : start + llm.count(self.model.placeholder_ids[name])]
        return llm_inserts(self.model, llm, mine, selectors)

    def backward_done(self, i: int) -> None:
        pass  # the leaves' gradients are complete only after the whole schedule: `finish`

    def finish(self) -> None:
        if self.train:
            for name, encoded in self.encoded.items():
                leaf = self.rows[name]
                grad = None if leaf is None else (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
                encoded.backward(self.bridges[name].backward(grad, self._counts(name), encoded))
        self.encoded, self.rows, self.microbatches = {}, {}, []


class ReceivedRows:
    """The rows of a step's microbatches on an LLM stage-0 rank, sent by the encoder ranks: microbatch i's are
    received when its forward runs (the receive launched then, in the order the encoder ranks send), made
    leaves and inserted; their gradients go back after its backward. `like`: the rows' dtype, device, width."""

    def __init__(self, bridges: dict[str, P2PBridge], like: torch.Tensor) -> None:
        self.bridges, self.like = bridges, like
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}
        self.sends: list = []

    def begin(self, model: MultimodalModel, microbatches: list[StepBatch], train: bool) -> None:
        self.model, self.microbatches, self.train = model, microbatches, train

    def inserts(self, i: int, selectors: dict | None) -> Inserts:
        mb = self.microbatches[i]
        rows = {name: b.receive_rows(mb.rows[name], i, self.like) for name, b in self.bridges.items()}
        if self.train:
            self.leaves[i] = rows = {name: r.requires_grad_() for name, r in rows.items()}
        return llm_inserts(self.model, mb.llm, rows, selectors)

    def backward_done(self, i: int) -> None:
        """Microbatch i's rows' gradients to the encoder ranks that produced them."""
        for name, leaf in self.leaves.pop(i).items():
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)  # a cp rank may insert none
            self.sends.extend(self.bridges[name].send_grads(grad, self.microbatches[i].rows[name], i))

    def finish(self) -> None:
        for work in self.sends:
            work.wait()
        self.sends, self.microbatches = [], []
