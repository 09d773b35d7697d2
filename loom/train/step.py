"""One optimizer step — the same code for the one-process reference and for every layout.

The only difference between them is where the step's reductions go (`StepComms`): the supervised-token
count and the reported loss are summed over the data replicas, and the LM head's logits may be
vocab-sharded (loss parallel). Gradient reduction is FSDP's, the grad norm DTensor's.
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
from loom.train.loss import loss_function
from loom.train.optim import clip_and_check, set_lr


@dataclass
class StepComms:
    dp_group: dist.ProcessGroup | None = None  # ranks holding different LLM tokens (dp × cp); None: one process
    loss_parallel: bool = False  # logits arrive vocab-sharded (LLM tp > 1)
    cp_group: dist.ProcessGroup | None = None  # the LLM's context-parallel group, when cp > 1


@dataclass
class StepBatch:
    """One rank's inputs for one step: the LLM's share as a batch, each encoder's share as its items."""

    llm: Batch
    encoder_items: dict[str, list[torch.Tensor]]  # per encoder, in placeholder order of its share
    rows_per_sample: dict[str, list[int]]  # per encoder: modality tokens of each sample of its share
    llm_rows_per_sample: dict[str, list[int]]  # per encoder: its modality tokens of each sample of the LLM share
    tokens: int  # real tokens of the LLM share (padding excluded)

    @staticmethod
    def of(batch: Batch, rows_per_sample: dict[str, list[int]] | None = None, tokens: int = 0) -> StepBatch:
        """Every module reads the same samples (one process, or one layout): the batch's own items."""
        rows = rows_per_sample or {}
        return StepBatch(batch, batch.modality_inputs, rows, rows, tokens)


@dataclass
class StepResult:
    loss: float  # mean token loss over the global batch
    grad_norm: float
    lr: float
    skipped: bool


def sum_over(value: float | int, group: dist.ProcessGroup | None) -> float:
    if group is None:
        return float(value)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"  # NCCL reduces only device tensors
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t)


def global_token_count(batch: Batch, group: dist.ProcessGroup | None) -> float:
    """Supervised tokens of the whole global batch: this rank's share summed over the ranks holding others."""
    return max(1.0, sum_over(batch.num_supervised, group))


def local_value(t: torch.Tensor) -> float:
    return float(t.full_tensor() if isinstance(t, DTensor) else t)


def forward(
    model: MultimodalModel, inputs: StepBatch, llm: Batch, bridges: dict | None = None, selectors: dict | None = None
) -> torch.Tensor:
    """Each encoder on its own share, its rows moved to the LLM's share by its bridge, then the LLM on
    `llm` — the LLM share itself, or this cp rank's part of it with `selectors` picking the rows it holds."""
    embeds = {}
    for name in model.encoder_names:
        rows = model.encoder(name)(inputs.encoder_items.get(name, []))
        if bridges:
            rows = bridges[name](rows, inputs.rows_per_sample[name], inputs.llm_rows_per_sample[name])
        embeds[name] = rows
    slots = {name: inputs.llm.count(pid) for name, pid in model.placeholder_ids.items()}
    inserts = model.inserts(inputs.llm.input_ids, embeds, slots)  # checked against the whole share
    if selectors:
        inserts = {pid: rows[selectors[pid]] for pid, rows in inserts.items()}
    return model.language(llm.input_ids, llm.positions, llm.layout, inserts)


def train_step(
    model: MultimodalModel,
    optimizer,
    inputs: StepBatch,
    cfg: TrainConfig,
    step: int,
    comms: StepComms,
    bridges: dict | None = None,
    autocast=contextlib.nullcontext,
    inspect_grads: Callable[[MultimodalModel], None] | None = None,
) -> StepResult:
    """`inspect_grads(model)` sees the raw gradients after backward, before clipping (loom verify)."""
    batch, selectors = inputs.llm, None
    if comms.cp_group is not None:
        batch, selectors = shard_for_context(batch, comms.cp_group, list(model.placeholder_ids.values()))
    # every rank divides by the supervised tokens of the *global* batch: gradients then add up over dp × cp
    n_tokens = global_token_count(batch, comms.dp_group)
    lr = set_lr(optimizer, step, cfg)
    with loss_parallel() if comms.loss_parallel else contextlib.nullcontext():
        with autocast():
            logits = forward(model, inputs, batch, bridges, selectors)
        loss_sum = loss_function(cfg.compile, comms.loss_parallel)(logits, batch.labels)
        (loss_sum / n_tokens).backward()  # loss parallel needs its backward inside the context too
    if inspect_grads is not None:
        inspect_grads(model)
    norm, finite = clip_and_check(model, cfg.grad_clip)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = sum_over(local_value(loss_sum.detach()), comms.dp_group) / n_tokens
    return StepResult(loss, norm, lr, not finite)
