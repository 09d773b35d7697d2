"""One optimizer step with a pipelined LLM (pp > 1) and colocated, unpipelined encoders: the three-phase step.

1. Encoders: every rank runs its encoder replicas on their share of the *whole* step (all microbatches at
   once); the first-stage bridge delivers the rows to the LLM's stage-0 ranks, where they become leaves
   (detached, requiring grad) that the microbatches' stage-0 inputs slice.
2. LLM: the pipeline schedule runs every microbatch forward and backward; each stage reads its
   microbatch's positions, token spans and labels from host data, and the last stage returns each
   microbatch's token loss divided by the step's global supervised-token count (from host data on every
   rank — not the last stage's count), so PP changes nothing numerically.
3. Encoders' backward: the rows' gradients go back from stage 0 to the encoder replicas that produced them,
   then each encoder runs its one backward, and FSDP reduces its gradients then — after the LLM's
   schedule, so the reduction covers the whole step. The encoders' gradients come from stage 0 only.
Then one global grad norm over every module (the LLM's summed over its stages), one clip, one optimizer
step or a skip on every rank (train/step.py `finish_step`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed.tensor.parallel import loss_parallel

from loom.bridge.first_stage import FirstStageBridge
from loom.config import TrainConfig
from loom.models.multimodal import MultimodalModel
from loom.parallel.context import shard_for_context
from loom.parallel.fsdp import set_gradient_sync
from loom.parallel.pipeline import MicrobatchData, MicrobatchInserts, Pipeline
from loom.train.inputs import StepBatch, StepInputs
from loom.train.loss import loss_function
from loom.train.optim import set_lr
from loom.train.step import StepComms, StepResult, finish_step, llm_inserts


def pipelined_train_step(model: MultimodalModel, optimizer, inputs: StepInputs, cfg: TrainConfig, step: int,
                         comms: StepComms, pipeline: Pipeline, bridges: dict[str, FirstStageBridge],
                         inspect_grads=None) -> StepResult:
    n_tokens = max(1, inputs.supervised)
    lr = set_lr(optimizer, step, cfg)
    micro = inputs.microbatches
    set_gradient_sync(model, True)  # the encoders run one forward and one backward per step

    # phase 1: each encoder on the whole step; its rows to the LLM's first stage
    encoded, rows = {}, {}
    for name in model.encoder_names:
        encoded[name] = model.encoder(name)([item for mb in micro for item in mb.encoder_items.get(name, [])])
        delivered = bridges[name].forward(encoded[name].detach(), [mb.rows[name] for mb in micro])
        rows[name] = None if delivered is None else delivered.requires_grad_()

    # phase 2: the LLM's schedule over the microbatches
    inserts = stage0_inserts(model, micro, rows, pipeline.first)
    ids, data = schedule_inputs(model, micro, comms, inserts)
    with loss_parallel() if comms.loss_parallel else contextlib.nullcontext():
        loss = pipeline.run(ids, data, n_tokens, loss_function(cfg.compile, comms.loss_parallel))

    # phase 3: the rows' gradients back to the encoder replicas that produced them, then their backward
    for name in model.encoder_names:
        r = rows[name]
        grad = None if r is None else (r.grad if r.grad is not None else torch.zeros_like(r))
        encoded[name].backward(bridges[name].backward(grad, [mb.rows[name] for mb in micro], encoded[name]))

    return finish_step(model, optimizer, float(loss), lr, cfg, comms, inspect_grads)


def stage0_inserts(model: MultimodalModel, micro: list[StepBatch], rows: dict[str, torch.Tensor | None],
                   first: bool) -> Callable[[int, dict | None], dict]:
    """`inserts(i, selectors)` for `schedule_inputs`: microbatch i's slice of each encoder's delivered rows
    (they arrive in microbatch order), on the rank running stage 0; nothing elsewhere."""
    taken = dict.fromkeys(rows, 0)

    def inserts(i: int, selectors: dict | None) -> dict:
        if not first:
            return {}
        llm, mine = micro[i].llm, {}
        for name, r in rows.items():
            n = llm.count(model.placeholder_ids[name])
            mine[name] = r[taken[name] : taken[name] + n]
            taken[name] += n
        return llm_inserts(model, llm, mine, selectors)

    return inserts


def schedule_inputs(model: MultimodalModel, micro: list[StepBatch], comms: StepComms,
                    inserts: Callable[[int, dict | None], MicrobatchInserts]) -> tuple[list, list[MicrobatchData]]:
    """Each microbatch's stage-0 token ids (this cp rank's shard) and host-built data for the schedule;
    `inserts(i, selectors)`: microbatch i's modality rows by placeholder id, this cp rank's under `selectors`
    (or a function the stage calls for them)."""
    ids, data = [], []
    for i, mb in enumerate(micro):
        batch, selectors = mb.llm, None
        if comms.cp_group is not None:
            batch, selectors = shard_for_context(batch, comms.cp_group, list(model.placeholder_ids.values()))
        ids.append(batch.input_ids)
        data.append(MicrobatchData(batch.positions, batch.spans, batch.labels, inserts(i, selectors)))
    return ids, data
