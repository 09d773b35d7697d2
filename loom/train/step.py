"""One optimizer step — the same code for the one-process reference and for every layout.

The only differences between them are the microbatches (the reference runs the whole global batch as one)
and where the step's reductions go (`StepComms`): the reported loss is summed over the data replicas, and
the LM head's logits may be vocab-sharded (loss parallel). Gradient reduction is FSDP's, the grad norm
DTensor's; the supervised-token count comes from host data (train/inputs.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from loom.config import TrainConfig
from loom.data.batch import Batch
from loom.models.multimodal import MultimodalModel
from loom.parallel.context import shard_for_context
from loom.parallel.fsdp import set_gradient_sync
from loom.train.inputs import StepBatch, StepInputs
from loom.train.loss import loss_function
from loom.train.optim import GradNormShare, clip_and_check, reduce_values, set_lr


@dataclass
class StepComms:
    """Where a step's reductions go; the defaults are one process's (nothing to reduce)."""

    norm_share: GradNormShare | None = None  # this rank's part of the world's one grad-norm sum
    adds_loss: bool = False  # this rank adds its loss to the world's sum (LLM ranks at tp 0; zero off the last stage)
    loss_parallel: bool = False  # logits arrive vocab-sharded (LLM tp > 1)
    cp_group: dist.ProcessGroup | None = None  # the LLM's context-parallel group, when cp > 1
    stage_group: dist.ProcessGroup | None = None  # the LLM's pipeline group, when pp > 1


@dataclass
class StepResult:
    loss: float  # mean token loss over the global batch
    grad_norm: float
    lr: float
    skipped: bool


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def forward(
    model: MultimodalModel, inputs: StepBatch, llm: Batch, bridges: dict | None = None, selectors: dict | None = None
) -> torch.Tensor:
    """Each encoder on its own part, its rows moved to the LLM's part by its bridge, then the LLM on
    `llm` — the LLM part itself, or this cp rank's part of it with `selectors` picking the rows it holds."""
    embeds = {}
    for name in model.encoder_names:
        rows = model.encoder(name)(inputs.encoder_items.get(name, []))
        if bridges:
            rows = bridges[name](rows, inputs.rows[name])
        embeds[name] = rows
    return model.language(llm.input_ids, llm.positions, llm.spans, llm_inserts(model, inputs.llm, embeds, selectors))


def llm_inserts(model: MultimodalModel, llm: Batch, rows: dict[str, torch.Tensor], selectors: dict | None
                ) -> dict[int, torch.Tensor]:
    """Each modality's rows by placeholder id, checked against the whole LLM part `llm` (placeholder counts
    from its host copy: no device sync); under CP only this rank's rows, which `selectors` pick."""
    slots = {name: llm.count(pid) for name, pid in model.placeholder_ids.items()}
    inserts = model.inserts(llm.input_ids, rows, slots)
    return {pid: part[selectors[pid]] for pid, part in inserts.items()} if selectors else inserts


def train_step(
    model: MultimodalModel,
    optimizer,
    inputs: StepInputs,
    cfg: TrainConfig,
    step: int,
    comms: StepComms,
    bridges: dict | None = None,
    autocast=contextlib.nullcontext,
    inspect_grads: Callable[[MultimodalModel], None] | None = None,
) -> StepResult:
    """Forward and backward of every microbatch (gradients accumulate; FSDP reduces them once, after the
    last), then one clip and one optimizer step. `inspect_grads(model)` sees the raw gradients after the
    last backward, before clipping (loom verify)."""
    # every microbatch divides by the supervised tokens of the *global* batch, known from host data:
    # gradients then add up over microbatches and dp × cp to the reference's mean
    n_tokens = max(1, inputs.supervised)
    lr = set_lr(optimizer, step, cfg)
    loss_total = 0.0  # a device tensor after the first microbatch: read once, at the end
    last = len(inputs.microbatches) - 1
    for i, micro in enumerate(inputs.microbatches):
        set_gradient_sync(model, i == last)
        batch, selectors = micro.llm, None
        if comms.cp_group is not None:
            batch, selectors = shard_for_context(batch, comms.cp_group, list(model.placeholder_ids.values()))
        with loss_parallel() if comms.loss_parallel else contextlib.nullcontext():
            with autocast():
                logits = forward(model, micro, batch, bridges, selectors)
            loss_sum = loss_function(cfg.compile, comms.loss_parallel)(logits, batch.labels)
            (loss_sum / n_tokens).backward()  # loss parallel needs its backward inside the context too
        loss_total = loss_total + local_tensor(loss_sum.detach())
    return finish_step(model, optimizer, float(loss_total) / n_tokens, lr, cfg, comms, inspect_grads)


def finish_step(model: MultimodalModel, optimizer, loss: float, lr: float, cfg: TrainConfig, comms: StepComms,
                inspect_grads: Callable[[MultimodalModel], None] | None) -> StepResult:
    """After the last backward: one global grad norm, clipping, the optimizer step (skipped on every rank
    when the norm is not finite); `loss`: this rank's part of the step's mean loss."""
    if inspect_grads is not None:
        inspect_grads(model)
    norm, finite = clip_and_check(model, cfg.grad_clip, comms.norm_share)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if comms.norm_share is not None:  # under a layout: every rank reports the step's loss
        loss = reduce_values([loss if comms.adds_loss else 0.0], dist.ReduceOp.SUM, None)[0]
    return StepResult(loss, norm, lr, not finite)
