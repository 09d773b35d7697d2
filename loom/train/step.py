"""One optimizer step — one program for the one-process reference and for every layout on every rank.

Its phases read top to bottom; what differs between layouts is chosen once, from the rank's plan, at three
seams (each a small interface):
- where a microbatch's modality rows come from (`plan.rows`, train/rows.py): local encoders and the
  colocated bridge, the three-phase step's whole-step encoders and first-stage bridge, or point-to-point
  receives from encoder ranks;
- how the LLM runs its microbatches (`plan.runner`, train/runners.py): a loop, or the pipeline schedule;
- which objective (train/objective.py): the loss sum of a microbatch and the step's normaliser (SFT first).
An encoder rank of a non-colocated job runs its own program (train/encoder_ranks.py) in place of the middle.
The same program runs forward only (`forward_pass`: held-out metrics, and scoring to come).

Then one global grad norm over every module, one clip, one optimizer step — or a skip on every rank.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from loom.config import TrainConfig
from loom.models.moe import aux_loss_scale
from loom.models.multimodal import MultimodalModel
from loom.parallel.gradient_sync import finish_gradient_sync
from loom.train.encoder_ranks import EncoderRanks
from loom.train.expert_load import ExpertLoad
from loom.train.garbage import collect_at
from loom.train.inputs import StepInputs
from loom.train.objective import Objective, metric_means
from loom.train.optim import (
    GradNormShare,
    clip_and_check,
    clip_in_optimizer,
    fused_everywhere,
    lean_everywhere,
    reduce_values,
    set_lr,
)
from loom.train.rows import RowSource
from loom.train.runners import LLMRunner, RunContext


class ReferenceScores(Protocol):
    """A frozen reference policy (train/reference.py): before the step, each microbatch's `ref_logprobs` field."""

    def score_into(self, plan: StepPlan, model: MultimodalModel, inputs: StepInputs) -> None: ...


class StepPlan(Protocol):
    """What a step reads of this rank's plan (train/rank_plan.py's RankPlan, which calls the step: no cycle)."""

    comms: StepComms
    rows: RowSource | None
    runner: LLMRunner | None
    run_context: RunContext
    encoder_ranks: EncoderRanks | None
    reference: ReferenceScores | None

    @property
    def distributed(self) -> bool: ...


@dataclass
class StepComms:
    """Where a step's reductions go; the defaults are one process's (nothing to reduce)."""

    norm_share: GradNormShare | None = None  # this rank's part of the world's one grad-norm sum
    adds_loss: bool = False  # this rank adds its loss to the world's sum (LLM ranks at tp 0; zero off the last stage)
    expert_load: ExpertLoad | None = None  # a mixture-of-experts LLM: the bias update and load metrics per step


@dataclass
class StepResult:
    loss: float  # the objective's loss over the global batch
    grad_norm: float
    lr: float
    skipped: bool
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's, over the global batch (GRPO's)
    expert_load: dict[str, float] = field(default_factory=dict)  # `expert_load/<layer>`: max / mean tokens per expert


def train_step(plan: StepPlan, model: MultimodalModel, optimizer, inputs: StepInputs, cfg: TrainConfig, step: int,
               objective: Objective, inspect_grads: Callable[[MultimodalModel], None] | None = None) -> StepResult:
    """Forward and backward of every microbatch (gradients accumulate; FSDP reduces them once per step), then
    one clip and one optimizer step. `inspect_grads(model)` sees the raw gradients after the last backward,
    before clipping (loom verify)."""
    if plan.distributed:  # ranks wait for each other's collections: all at the same steps, not mid-step on one
        collect_at(step, cfg.gc_every)
    lr = set_lr(optimizer, step, cfg)
    if plan.reference is not None:  # the reference policy's logprobs, each microbatch's `ref_logprobs` field
        plan.reference.score_into(plan, model, inputs)
    loss = run_microbatches(plan, model, inputs, objective, train=True)
    finish_gradient_sync(model)  # the replicated modules' gradients summed over their replicas
    result = finish_step(model, optimizer, loss, lr, cfg, plan.comms, inspect_grads)
    result.metrics = metric_means(objective, lambda sums: world_sum(sums, plan.comms))
    return result


@torch.no_grad()
def forward_pass(plan: StepPlan, model: MultimodalModel, inputs: StepInputs, objective: Objective) -> float:
    """The step's program forward only: this rank's part of the objective's loss (the world's sum is the
    caller's to take); nothing is kept for a backward, no weight changes."""
    return float(run_microbatches(plan, model, inputs, objective, train=False))


def run_microbatches(plan: StepPlan, model: MultimodalModel, inputs: StepInputs, objective: Objective,
                     train: bool) -> float | torch.Tensor:
    """Every microbatch of the step through this rank's part of the model: this rank's part of the loss (a
    device tensor after the loop: read at the step's end, not here)."""
    if plan.encoder_ranks is not None:  # encoders on ranks of their own: their program, no loss here
        plan.encoder_ranks.run(model, inputs.microbatches, train)
        return 0.0
    # every microbatch divides by the normaliser of the *global* batch, known from host data: gradients then
    # add up over microbatches and dp × cp to the reference's
    normaliser = objective.normaliser(inputs)
    mark_cuda_graph_step()
    plan.rows.begin(model, inputs.microbatches, train)  # three-phase: the encoders on the whole step
    # the experts' auxiliary losses scale their gradients by the global batch's counts: a token's z-loss as the
    # token loss, a sample's balance term by the global sample count
    scales = (1.0 / normaliser, 1.0 / max(1, inputs.sequences))
    with aux_loss_scale(model, *scales) if train else contextlib.nullcontext():
        loss = plan.runner.run(model, inputs.microbatches, plan.rows, objective, normaliser, plan.run_context, train)
    plan.rows.finish()  # three-phase: the rows' gradients back into the encoders; sends completed
    return loss


def mark_cuda_graph_step() -> None:
    """A new step: blocks replayed as CUDA graphs (train.compile_mode) may reuse the memory of the last step's
    graph outputs, all read by now. Graph trees are loaded where blocks compile for CUDA graphs (before the
    first step: once any step is marked, every step must be); without them, marking would import all of
    inductor (~4 s of CPU per process) to bump a counter."""
    if "torch._inductor.cudagraph_trees" in sys.modules:
        torch.compiler.cudagraph_mark_step_begin()


def finish_step(model: MultimodalModel, optimizer, loss: float, lr: float, cfg: TrainConfig, comms: StepComms,
                inspect_grads: Callable[[MultimodalModel], None] | None) -> StepResult:
    """After the last backward: one global grad norm, clipping, the optimizer step (skipped on every rank
    when the norm is not finite); `loss`: this rank's part of the step's loss."""
    if inspect_grads is not None:
        inspect_grads(model)
    # fused AdamW: no host sync until the step's end (under a layout from its second step, once every AdamW has
    # the state fused_step's own path needs: torch's step over DTensors would not take the device-side clip)
    if fused_everywhere(optimizer) and (comms.norm_share is None or lean_everywhere(optimizer)):
        norm, finite = clip_in_optimizer(model, optimizer, cfg.grad_clip, comms.norm_share)
        optimizer.step()
    else:
        norm, finite = clip_and_check(model, cfg.grad_clip, comms.norm_share)
        if finite:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # once per optimizer step, from the whole step's counts: the routers' bias update and the experts' load
    load = comms.expert_load.finish(model, bool(finite)) if comms.expert_load is not None else {}
    loss = world_loss(loss, comms)  # under a layout: every rank reports the step's loss
    return StepResult(float(loss), float(norm), lr, not bool(finite), expert_load=load)


def world_sum(values: list[float], comms: StepComms) -> list[float]:
    """Values of the step's loss kind (each LLM replica's part, on its tp-0 last-stage rank) added over the
    world, the same on every rank; one process: as they are."""
    if comms.norm_share is None:
        return values
    return reduce_values([v if comms.adds_loss else 0.0 for v in values], dist.ReduceOp.SUM, None)


def world_loss(loss: float | torch.Tensor, comms: StepComms) -> float | torch.Tensor:
    """world_sum of the step's loss on the device: the host reads it once, after the optimizer step is queued."""
    if comms.norm_share is None:
        return loss
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces only device tensors
    if isinstance(loss, torch.Tensor) and comms.adds_loss:
        t = loss.detach().to(device, torch.float64)
    else:  # torch.full, not torch.tensor: a host value copied to the GPU would wait for the device's queue
        t = torch.full((), float(loss) if comms.adds_loss else 0.0, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t


def one_process_autocast(dtype: str, device: torch.device):
    """The context a one-process forward runs in: bf16 autocast when asked; under a layout FSDP's policy casts."""
    if dtype == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext
