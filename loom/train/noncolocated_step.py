"""One optimizer step with the encoders and the LLM on disjoint ranks (non-colocated): one multi-module pipeline.

The encoders are the first stage of a pipeline that continues into the LLM's stages. Each encoder rank runs
its microbatches 1F1B-style: `warmup` forwards, then a forward of microbatch i + warmup before the backward
of microbatch i, whose row gradients it waits for — so the encoder works on microbatch i + 1 while the LLM
works on microbatch i, and no more than `warmup` microbatches of activations are alive. The rows travel by
the point-to-point bridge (bridge/p2p.py). An LLM stage-0 rank posts every microbatch's receive up front,
inserts microbatch i's rows when its forward of i runs, and returns their gradient as soon as its backward
of i is done; with pp > 1 its stages run the pipelining schedule as in the colocated case.

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

from loom.bridge.p2p import Incoming, P2PBridge
from loom.config import TrainConfig
from loom.models.multimodal import MultimodalModel
from loom.parallel.context import shard_for_context
from loom.parallel.fsdp import set_gradient_sync
from loom.parallel.pipeline import Pipeline
from loom.train.inputs import StepBatch, StepInputs
from loom.train.loss import loss_function
from loom.train.optim import set_lr
from loom.train.pipeline_step import schedule_inputs
from loom.train.step import StepComms, StepResult, finish_step, local_tensor


def encoder_warmup(schedule: str, llm_stages: int, microbatches: int) -> int:
    """Microbatches an encoder rank runs ahead of its first backward. The LLM's stage 0 holds up to
    `llm_stages` microbatches in flight under 1F1B (one when the LLM is not pipelined), and one more keeps the
    next microbatch's rows ready when a gradient comes back; other schedules run every forward first."""
    if llm_stages == 1 or schedule == "1f1b":
        return min(microbatches, llm_stages + 1)
    return microbatches


def encoder_train_step(model: MultimodalModel, optimizer, inputs: StepInputs, cfg: TrainConfig, step: int,
                       comms: StepComms, bridges: dict[str, P2PBridge], hosted: list[str], warmup: int,
                       like: torch.Tensor, inspect_grads=None) -> StepResult:
    """An encoder rank's step: its encoders (`hosted`) forward microbatch after microbatch, rows out, row
    gradients in, backward; then the step's shared finish. `like`: the rows' dtype, device and width."""
    lr = set_lr(optimizer, step, cfg)
    micro = inputs.microbatches
    n = len(micro)
    # posted microbatch-major, the order the LLM sends in: NCCL matches a pair's messages by order, not tag
    posted = [{name: bridges[name].receive_grads(mb.rows[name], i, like) for name in hosted}
              for i, mb in enumerate(micro)]
    grads = {name: [p[name] for p in posted] for name in hosted}
    outputs: list[dict[str, torch.Tensor] | None] = [None] * n
    sends = []

    def forward(i: int) -> None:
        outputs[i] = {name: model.encoder(name)(micro[i].encoder_items.get(name, [])) for name in hosted}
        for name in hosted:
            sends.extend(bridges[name].send_rows(outputs[i][name].detach(), micro[i].rows[name], i))

    def backward(i: int) -> None:
        set_gradient_sync(model, i == n - 1)  # FSDP reduces once, after the step's last backward
        outs, outputs[i] = outputs[i], None
        torch.autograd.backward([outs[name] for name in hosted], [grads[name][i].wait() for name in hosted])

    for i in range(min(warmup, n)):
        forward(i)
    for i in range(n):
        if i + warmup < n:
            forward(i + warmup)
        backward(i)
    for work in sends:
        work.wait()
    return finish_step(model, optimizer, 0.0, lr, cfg, comms, inspect_grads)


class ReceivedRows:
    """The modality rows of a step's microbatches on an LLM stage-0 rank: every receive posted up front, each
    microbatch's rows made leaves and inserted when its forward runs, their gradients returned after its
    backward."""

    def __init__(self, model: MultimodalModel, bridges: dict[str, P2PBridge], micro: list[StepBatch],
                 like: torch.Tensor) -> None:
        self.model, self.bridges, self.micro = model, bridges, micro
        # posted microbatch-major, the order the encoders send in: NCCL matches a pair's messages by order
        posted = [{name: b.receive_rows(mb.rows[name], i, like) for name, b in bridges.items()}
                  for i, mb in enumerate(micro)]
        self.incoming: dict[str, list[Incoming]] = {name: [p[name] for p in posted] for name in bridges}
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}
        self.sends: list = []

    def inserts(self, i: int, selectors: dict | None) -> dict[int, torch.Tensor]:
        """Microbatch i's rows by placeholder id (this cp rank's, under `selectors`), as leaves requiring grad."""
        rows = {name: inc[i].wait().requires_grad_() for name, inc in self.incoming.items()}
        self.leaves[i] = rows
        llm = self.micro[i].llm
        slots = {name: llm.count(pid) for name, pid in self.model.placeholder_ids.items()}
        inserts = self.model.inserts(llm.input_ids, rows, slots)  # checked against the whole microbatch
        return {pid: part[selectors[pid]] for pid, part in inserts.items()} if selectors else inserts

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
            logits = model.language(batch.input_ids, batch.positions, batch.layout, rows.inserts(i, selectors))
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
