"""The encoder ranks' own program when the encoders and the LLM sit on disjoint ranks (non-colocated).

The encoders are the first stage of a pipeline that continues into the LLM's stages. An encoder rank follows
the order in which the LLM's stage 0 runs forwards and backwards (`stage0_order`): before stage 0's forward
of microbatch i it sends microbatch i's rows, before its own backward of i it takes back their gradients, and
it computes each forward one microbatch ahead — so the encoder works on microbatch i + 1 while the LLM works
on microbatch i, holding one microbatch of activations more than the LLM's stage 0. The rows travel by the
point-to-point bridge (bridge/p2p.py); on NCCL a pair's messages queue in launch order, so both sides launch
them in this one order (the LLM side: train/rows.py `ReceivedRows`). Forward only, the order is every
microbatch's forward in turn: the order of a forward-only schedule.

A pipelined encoder (pp > 1, parallel/encoder_pipeline.py) extends the pipeline backwards: its last stage runs
the program above, taking each microbatch's input from the stage before (parallel/stage_link.py) and sending
back its gradient; an earlier stage runs every forward, then every backward (`stage_order`). All of a rank's
encoders sit at the same stage (topology/checks.py), so one order serves them all.

Loss and counts: the LLM ranks divide every microbatch's loss by the step's global normaliser, known on every
rank from host data, so each encoder gradient is the reference's whatever the ratio of encoder dp to LLM dp.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom.bridge.p2p import P2PBridge
from loom.models.multimodal import MultimodalModel
from loom.parallel.gradient_sync import set_gradient_sync
from loom.parallel.stage_link import StageLink
from loom.topology.role import StagePosition
from loom.train.inputs import StepBatch


def stage0_order(schedule: str, llm_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which the LLM's stage 0 runs each microbatch's forward ("F", i) and backward ("B", i):
    the order of its bridge messages (rows in before F, gradients out after B). Not pipelined: F0 B0 F1 B1 …;
    gpipe: every F, then every B; 1F1B (torch's Schedule1F1B): `llm_stages` forwards, then B and F alternate."""
    m = microbatches
    if llm_stages == 1:
        return [(kind, i) for i in range(m) for kind in ("F", "B")]
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, llm_stages)
        order = [("F", i) for i in range(warmup)]
        for b in range(m):
            order.append(("B", b))
            if warmup + b < m:
                order.append(("F", warmup + b))
        return order
    raise ValueError(f"no stage-0 order for pp_schedule = {schedule!r} with non-colocated encoders")


def stage_order(llm_order: list[tuple[str, int]], last: bool, train: bool, microbatches: int
                ) -> list[tuple[str, int]]:
    """The order of an encoder stage's forwards and backwards. Forward only: every microbatch in turn. The last
    (or only) stage follows the LLM stage 0's order (`llm_order`), which its bridge messages must keep; an
    earlier stage of a pipelined encoder runs every forward, then the backwards in the order their gradients
    arrive (GPipe: it holds every microbatch's activations) — so it launches every message to the next stage
    before any from it, and the next stage, which posts every input's receive first, launches them alike."""
    forwards = [("F", i) for i in range(microbatches)]
    if not train:
        return forwards
    return llm_order if last else forwards + [event for event in llm_order if event[0] == "B"]


@dataclass
class EncoderRanks:
    """What an encoder rank's program needs: its encoders (`hosted`) and their bridges, the LLM stage 0's
    training order, and the rows' dtype, device and width (`like`). Pipelined encoders: `links` to the
    neighbouring stages of each, and the stage they sit at (every hosted encoder at the same one: checked)."""

    bridges: dict[str, P2PBridge]
    hosted: list[str]
    order: list[tuple[str, int]]
    like: torch.Tensor
    links: dict[str, StageLink] = field(default_factory=dict)
    stage: StagePosition = StagePosition(0, 1)  # not pipelined: the only stage

    def run(self, model: MultimodalModel, microbatches: list[StepBatch], train: bool) -> None:
        """Every microbatch's forward (and, training, backward) in this stage's order (`stage_order`): the last
        stage sends rows to the LLM and takes their gradients back, an earlier one sends its hidden states to
        the next stage and takes theirs back; a later stage passes its inputs' gradients back."""
        n, first, last = len(microbatches), self.stage.is_first, self.stage.is_last
        order = stage_order(self.order, last, train, n)
        last_backward = next((i for kind, i in reversed(order) if kind == "B"), None)
        # a later stage's inputs: every microbatch's receive posted first (see `stage_order`), in the order the
        # stage before sends them (microbatch by microbatch, encoder by encoder)
        received = {} if first else {
            (i, name): self.links[name].receive_input(model.encoder(name).rows(mb.item_rows[name]), i)
            for i, mb in enumerate(microbatches) for name in self.hosted}
        outputs: list[dict[str, torch.Tensor] | None] = [None] * n
        inputs: list[dict[str, torch.Tensor] | None] = [None] * n
        sends = []

        def forward(i: int) -> None:
            if i >= n or outputs[i] is not None:
                return
            mb, inputs[i], outputs[i] = microbatches[i], {}, {}
            for name in self.hosted:
                items = mb.encoder_items.get(name, [])
                if name not in self.links:  # not pipelined: the whole encoder
                    outputs[i][name] = model.encoder(name)(items)
                    continue
                if not first:
                    h, work = received.pop((i, name))
                    work.wait()
                    items = inputs[i][name] = h.requires_grad_(train)
                outputs[i][name] = model.encoder(name)(items, mb.item_rows[name])

        def send(i: int) -> None:
            for name in self.hosted:
                out = outputs[i][name].detach()
                if last:
                    sends.extend(self.bridges[name].send_rows(out, microbatches[i].rows[name], i))
                else:
                    sends.append(self.links[name].send_output(out, i))

        def backward(i: int) -> None:
            mb = microbatches[i]
            grads = [self.bridges[name].receive_grads(mb.rows[name], i, self.like) if last else
                     self.links[name].receive_output_grad(outputs[i][name].shape[0], i) for name in self.hosted]
            set_gradient_sync(model, i == last_backward)  # FSDP reduces once, after the step's last backward
            outs, outputs[i] = outputs[i], None
            torch.autograd.backward([outs[name] for name in self.hosted], grads)
            for name, h in inputs[i].items():  # a later stage: its input's gradient to the stage before
                sends.append(self.links[name].send_input_grad(h.grad if h.grad is not None else torch.zeros_like(h), i))
            inputs[i] = None

        for kind, i in order:
            if kind == "F":
                forward(i)
                send(i)
                if not train:
                    outputs[i] = inputs[i] = None
                if last:
                    forward(i + 1)  # ahead: ready when the LLM asks for it
            else:
                backward(i)
        for work in sends:
            work.wait()
