"""The encoder ranks' own program when the encoders and the LLM sit on disjoint ranks (non-colocated).

The encoders are the first stage of a pipeline that continues into the LLM's stages. An encoder rank follows
the order in which the LLM's stage 0 runs forwards and backwards (`stage0_order`): before stage 0's forward
of microbatch i it sends microbatch i's rows, before its own backward of i it takes back their gradients, and
it computes each forward one microbatch ahead — so the encoder works on microbatch i + 1 while the LLM works
on microbatch i, holding one microbatch of activations more than the LLM's stage 0. The rows travel by the
point-to-point bridge (bridge/p2p.py); on NCCL a pair's messages queue in launch order, so both sides launch
them in this one order (the LLM side: train/rows.py `ReceivedRows`). Forward only, the order is every
microbatch's forward in turn: the order of a forward-only schedule.

Loss and counts: the LLM ranks divide every microbatch's loss by the step's global normaliser, known on every
rank from host data, so each encoder gradient is the reference's whatever the ratio of encoder dp to LLM dp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.bridge.p2p import P2PBridge
from loom.models.multimodal import MultimodalModel
from loom.parallel.fsdp import set_gradient_sync
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


@dataclass
class EncoderRanks:
    """What an encoder rank's program needs: its encoders (`hosted`) and their bridges, the LLM stage 0's
    training order, and the rows' dtype, device and width (`like`)."""

    bridges: dict[str, P2PBridge]
    hosted: list[str]
    order: list[tuple[str, int]]
    like: torch.Tensor

    def run(self, model: MultimodalModel, microbatches: list[StepBatch], train: bool) -> None:
        """Every microbatch's rows sent (and, training, their gradients taken back and run backward) in the
        LLM stage 0's order."""
        n = len(microbatches)
        order = self.order if train else [("F", i) for i in range(n)]
        outputs: list[dict[str, torch.Tensor] | None] = [None] * n
        sends = []

        def forward(i: int) -> None:
            if i < n and outputs[i] is None:
                outputs[i] = {name: model.encoder(name)(microbatches[i].encoder_items.get(name, []))
                              for name in self.hosted}

        def backward(i: int) -> None:
            grads = [self.bridges[name].receive_grads(microbatches[i].rows[name], i, self.like) for name in self.hosted]
            set_gradient_sync(model, i == n - 1)  # FSDP reduces once, after the step's last backward
            outs, outputs[i] = outputs[i], None
            torch.autograd.backward([outs[name] for name in self.hosted], grads)

        for kind, i in order:
            if kind == "F":
                forward(i)
                for name in self.hosted:
                    sends.extend(self.bridges[name].send_rows(outputs[i][name].detach(), microbatches[i].rows[name], i))
                if not train:
                    outputs[i] = None
                forward(i + 1)  # ahead: ready when the LLM asks for it
            else:
                backward(i)
        for work in sends:
            work.wait()
