"""The reference policy (`train.reference = "initial" | CHECKPOINT`): frozen weights the policy's KL is
measured against, under the same layout, with no optimizer state and no gradients.

Kept as a copy of this rank's local parts of the parameters beside the model's own (a second set of shards,
not a second model, plan or pipeline). Before a step, `score_into` swaps them into the model tensor by
tensor, runs the step's program forward only, and swaps the trained weights back: a swap is three copies
of one tensor, so the trained weights return bit for bit (tests/test_reference.py).

The scores become each microbatch's `ref_logprobs` field, whole, as if the data had brought them: each
token's place in its microbatch rides as a field through CP sharding; the records of a microbatch's cp
ranks are gathered and written back in place, so the training pass shards them with the labels again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from loom.checkpoint.read import CheckpointWeights
from loom.config import JobConfig
from loom.data.batch import IGNORE_INDEX, Batch
from loom.parallel.fsdp import reshard
from loom.parallel.materialize import WeightSource, local_part
from loom.parallel.tied import tied_copy_names
from loom.train.inputs import StepInputs
from loom.train.step import forward_pass
from loom.train.token_fields import REFERENCE
from loom.train.token_stats import chunked_token_stats

# a token's microbatch and its index in it (whole, flattened), exact in fp32 below 2**24
MICROBATCH, TOKEN = "reference_microbatch", "reference_token"


class ReferencePolicy:
    def __init__(self, model: nn.Module, temperature: float, weights: WeightSource | None = None) -> None:
        """The reference is the model's weights now ("initial"), or `weights` (a checkpoint's) read into this
        rank's parts."""
        self.temperature, self.model = temperature, model
        # by name, looked up at each swap: FSDP2 may put new Parameter objects on the modules at its lazy init
        self.parts = {name: local_part(p)[0].detach().clone() for name, p in model.named_parameters()}
        if weights is not None:
            twins = tied_copy_names(model)  # a pipelined LLM's head copy of the embedding reads the embedding
            with torch.no_grad():
                for name, p in model.named_parameters():
                    part = self.parts[name]
                    local, box = local_part(p)
                    if local.numel():
                        owner, _, attr = name.rpartition(".")
                        part.copy_(weights.part(twins.get(name, name), model.get_submodule(owner), attr, p.shape,
                                                box, part.device, False))

    @torch.no_grad()
    def swap(self) -> None:
        """The model's weights and the reference's trade places (again: back)."""
        for name, p in self.model.named_parameters():
            local, part = local_part(p)[0], self.parts[name]
            held = local.clone()
            local.copy_(part)
            part.copy_(held)

    def score_into(self, plan, model: nn.Module, inputs: StepInputs) -> None:
        """Each microbatch's `ref_logprobs` field: the reference's logprob of every target."""
        # every rank runs the pass (an encoder rank of a non-colocated job feeds it); data that brings its own
        # ref_logprobs needs no reference policy: train.reference = "none"
        llm = [mb.llm for mb in inputs.microbatches if mb.llm is not None]
        for i, batch in enumerate(llm):
            batch.fields[MICROBATCH] = torch.full_like(batch.labels, i, dtype=torch.float32)
            batch.fields[TOKEN] = torch.arange(batch.labels.numel(), device=batch.labels.device,
                                               dtype=torch.float32).view_as(batch.labels)
        recorder = _Recorder(self.temperature)
        reshard(model)  # a forward-only pass before this one (scoring, held-out) left the root unit unsharded
        self.swap()
        try:
            forward_pass(plan, model, inputs, recorder)
        finally:
            reshard(model)  # FSDP's root unit kept the reference's weights unsharded: gathered afresh next
            self.swap()
        cp_group = plan.run_context.cp_group
        for i, batch in enumerate(llm):
            index, values = recorder.of(i)
            if cp_group is not None:  # each cp rank scored its share of the microbatch's tokens
                every: list = [None] * dist.get_world_size(cp_group)
                dist.all_gather_object(every, (index, values), group=cp_group)
                index, values = torch.cat([e[0] for e in every]), torch.cat([e[1] for e in every])
            whole = torch.zeros(batch.labels.numel())
            whole[index] = values
            batch.fields[REFERENCE] = whole.view_as(batch.labels).to(batch.labels.device)
            del batch.fields[MICROBATCH], batch.fields[TOKEN]


def reference_policy(model: nn.Module, cfg: JobConfig) -> ReferencePolicy | None:
    """`train.reference`: none, the model's weights as built ("initial"), or a checkpoint's, as this rank's
    parts beside the model's."""
    ref = cfg.train.reference
    if ref == "none":
        return None
    temperature = cfg.train.grpo.temperature if cfg.train.objective == "grpo" else 1.0  # DPO's answers: as given
    return ReferencePolicy(model, temperature, None if ref == "initial" else CheckpointWeights(ref))


class _Recorder:
    """The scoring pass's objective: no loss; each target's logprob kept with its microbatch and place in it."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def normaliser(self, inputs: StepInputs) -> int:
        return 1

    def loss_sum(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        keep = batch.labels != IGNORE_INDEX
        lp = chunked_token_stats(logits, batch.labels, self.temperature).logprobs  # fp32 a chunk at a time
        if not batch.labels.numel():  # an empty microbatch (a replica without samples): nothing to record
            return torch.zeros((), device=batch.labels.device)
        microbatch = int(batch.fields[MICROBATCH].reshape(-1)[0])  # host data: before the step, a sync is fine
        self.records[microbatch] = (batch.fields[TOKEN][keep].long().cpu(), lp[keep].float().cpu())
        return torch.zeros((), device=batch.labels.device)

    def of(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Microbatch i's records; none on a rank that computes no loss (a pipeline's earlier stage)."""
        return self.records.get(i, (torch.zeros(0, dtype=torch.long), torch.zeros(0)))
