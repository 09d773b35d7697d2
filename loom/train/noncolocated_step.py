"""One optimizer step with the encoders and the LLM on disjoint ranks (non-colocated): one multi-module pipeline.

The encoders are the first stage of a pipeline that continues into the LLM's stages. An encoder rank
follows the order in which the LLM's stage 0 runs forwards and backwards (1F1B: as many forwards as the
LLM has stages, then backward and forward alternate): before stage 0's forward of microbatch i it sends
microbatch i's rows, before its own backward of i it takes back their gradients, and it computes each
forward one microbatch ahead — so the encoder works on microbatch i + 1 while the LLM works on microbatch i,
and the encoder holds one microbatch of activations more than the LLM's stage 0. The rows travel by the
point-to-point bridge (bridge/p2p.py). An LLM stage-0 rank receives microbatch i's rows when its forward of i
runs and returns their gradient as soon as its backward of i is done; with pp > 1 its stages run the
pipelining schedule as in the colocated case. Both sides launch a pair's messages in this one order: NCCL
runs them in launch order.

Loss and counts: every microbatch's loss divides by the step's global supervised-token count, known on every
rank from host data — encoder ranks included, which hold no loss — so each encoder gradient is the
reference's, whatever the ratio of encoder dp to LLM dp. One grad norm over both grids, one skip decision,
one lr: train/step.py `finish_step`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.distributed.tensor.parallel import loss_parallel

from loom.bridge.p2p import P2PBridge
from loom.config import TrainConfig
from loom.models.multimodal import MultimodalModel
from loom.parallel.context import shard_for_context
from loom.parallel.fsdp import set_gradient_sync
from loom.parallel.pipeline import Pipeline
from loom.train.inputs import StepBatch, StepInputs
from loom.train.loss import loss_function
from loom.train.optim import set_lr
from loom.train.pipeline_step import schedule_inputs
from loom.train.step import StepComms, StepResult, finish_step, llm_inserts, local_tensor


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


def encoder_train_step(model: MultimodalModel, optimizer, inputs: StepInputs, cfg: TrainConfig, step: int,
                       comms: StepComms, bridges: dict[str, P2PBridge], hosted: list[str],
                       order: list[tuple[str, int]], like: torch.Tensor, inspect_grads=None) -> StepResult:
    """An encoder rank's step: its encoders (`hosted`) send each microbatch's rows and take back their
    gradients in the LLM stage 0's order (`order`, stage0_order) — on NCCL a pair's messages queue in launch
    order, so both sides launch them in one order — computing each forward one microbatch ahead of its send,
    so it overlaps the LLM's work on the microbatch before. `like`: the rows' dtype, device and width."""
    lr = set_lr(optimizer, step, cfg)
    micro = inputs.microbatches
    n = len(micro)
    outputs: list[dict[str, torch.Tensor] | None] = [None] * n
    sends = []

    def forward(i: int) -> None:
        if i < n and outputs[i] is None:
            outputs[i] = {name: model.encoder(name)(micro[i].encoder_items.get(name, [])) for name in hosted}

    def backward(i: int) -> None:
        grads = [bridges[name].receive_grads(micro[i].rows[name], i, like) for name in hosted]
        set_gradient_sync(model, i == n - 1)  # FSDP reduces once, after the step's last backward
        outs, outputs[i] = outputs[i], None
        torch.autograd.backward([outs[name] for name in hosted], grads)

    for kind, i in order:
        if kind == "F":
            forward(i)
            for name in hosted:
                sends.extend(bridges[name].send_rows(outputs[i][name].detach(), micro[i].rows[name], i))
            forward(i + 1)  # ahead: ready when the LLM asks for it
        else:
            backward(i)
    for work in sends:
        work.wait()
    return finish_step(model, optimizer, 0.0, lr, cfg, comms, inspect_grads)


class ReceivedRows:
    """The modality rows of a step's microbatches on an LLM stage-0 rank: each microbatch's rows received
    when its forward runs (the receive launched then, in the order the encoder ranks send: see
    encoder_train_step), made leaves and inserted, their gradients returned after its backward."""

    def __init__(self, model: MultimodalModel, bridges: dict[str, P2PBridge], micro: list[StepBatch],
                 like: torch.Tensor) -> None:
        self.model, self.bridges, self.micro, self.like = model, bridges, micro, like
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}
        self.sends: list = []

    def inserts(self, i: int, selectors: dict | None) -> dict[int, torch.Tensor]:
        """Microbatch i's rows by placeholder id (this cp rank's, under `selectors`), as leaves requiring grad."""
        rows = {name: b.receive_rows(self.micro[i].rows[name], i, self.like).requires_grad_()
                for name, b in self.bridges.items()}
        self.leaves[i] = rows
        return llm_inserts(self.model, self.micro[i].llm, rows, selectors)

    def return_grads(self, i: int) -> None:
        """After microbatch i's backward: its rows' gradients to the encoder ranks that produced them."""
        for name, r in self.leaves.pop(i).items():
            grad = r.grad if r.grad is not None else torch.zeros_like(r)  # a cp rank may insert none of them
            self.sends.extend(self.bridges[name].send_grads(grad, self.micro[i].rows[name], i))

    def finish(self) -> None:
        for work in self.sends:
            work.wait()
        self.sends = []


def llm_train_step(model: MultimodalModel, optimizer, inputs: StepInputs, cfg: TrainConfig, step: int,
                   comms: StepComms, bridges: dict[str, P2PBridge], like: torch.Tensor,
                   inspect_grads=None) -> StepResult:
    """An LLM rank's step when the LLM is not pipelined: microbatch after microbatch, each with the rows the
    encoder ranks sent, gradients accumulated and reduced by FSDP after the last."""
    n_tokens = max(1, inputs.supervised)
    lr = set_lr(optimizer, step, cfg)
    micro = inputs.microbatches
    rows = ReceivedRows(model, bridges, micro, like)
    loss_total = 0.0
    for i, mb in enumerate(micro):
        set_gradient_sync(model, i == len(micro) - 1)
        batch, selectors = mb.llm, None
        if comms.cp_group is not None:
            batch, selectors = shard_for_context(batch, comms.cp_group, list(model.placeholder_ids.values()))
        with loss_parallel() if comms.loss_parallel else contextlib.nullcontext():
            logits = model.language(batch.input_ids, batch.positions, batch.spans, rows.inserts(i, selectors))
            loss_sum = loss_function(cfg.compile, comms.loss_parallel)(logits, batch.labels)
            (loss_sum / n_tokens).backward()
        rows.return_grads(i)
        loss_total = loss_total + local_tensor(loss_sum.detach())
    rows.finish()
    return finish_step(model, optimizer, float(loss_total) / n_tokens, lr, cfg, comms, inspect_grads)


def pipelined_llm_train_step(model: MultimodalModel, optimizer, inputs: StepInputs, cfg: TrainConfig, step: int,
                             comms: StepComms, bridges: dict[str, P2PBridge], pipeline: Pipeline,
                             like: torch.Tensor, inspect_grads=None) -> StepResult:
    """An LLM rank's step when the LLM is pipelined: the schedule runs every microbatch; stage 0 inserts each
    microbatch's rows as its forward runs and returns their gradients as its backward ends."""
    n_tokens = max(1, inputs.supervised)
    lr = set_lr(optimizer, step, cfg)
    micro = inputs.microbatches
    rows = ReceivedRows(model, bridges, micro, like) if pipeline.first else None
    ids, data = schedule_inputs(model, micro, comms,
                                lambda i, selectors: functools.partial(rows.inserts, i, selectors) if rows else {})
    with loss_parallel() if comms.loss_parallel else contextlib.nullcontext():
        loss = pipeline.run(ids, data, n_tokens, loss_function(cfg.compile, comms.loss_parallel),
                            rows.return_grads if rows else None)
    if rows is not None:
        rows.finish()
    return finish_step(model, optimizer, float(loss), lr, cfg, comms, inspect_grads)
