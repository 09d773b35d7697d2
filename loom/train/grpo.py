"""GRPO (clipped policy gradient with group-normalised advantages) as an objective of the step's seam.

Per completion token: the ratio r = exp(lp − lp_old) of the policy to the behaviour policy that sampled it;
the loss max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)), capped at −A·c for A < 0 under a dual clip c; plus
β · k3, the estimate exp(d) − 1 − d of KL(policy ‖ reference) with d = lp_ref − lp clamped to ±20.

Per-token inputs are fields of the batch (aligned with the labels: field i belongs to the token label i
names): `advantage`, and optionally `logprobs` (lp_old) and `ref_logprobs` (lp_ref). Without `logprobs`, lp_old
is lp itself, detached: the value a scoring pass at the step's start would give on these weights (r = 1
exactly, the gradient −A·∇lp), without running one. `sampler_logprobs`, when present, only measure: the
mean |lp − theirs| is the `sampler_mismatch` metric (loom rl's one-step iterations: no scoring pass needed).

Normalisation, from host data, so every layout equals one process: "token" divides by the global batch's
completion tokens; "sequence" weighs each token by 1 / its sequence's completion tokens (a field derived
from the whole microbatches before CP splits them) and divides by the global batch's sequences.
"""

from __future__ import annotations

import torch

from loom.config import GRPOConfig
from loom.data.batch import IGNORE_INDEX, Batch, sequence_index
from loom.train.metric_sums import MetricSums
from loom.train.inputs import StepInputs
from loom.train.token_fields import ADVANTAGE, BEHAVIOUR, REFERENCE
from loom.train.token_stats import chunked_token_stats

SAMPLER = "sampler_logprobs"  # the sampler's own logprobs (loom rl, one step per iteration): their gap is a metric
SEQUENCE_WEIGHT = "sequence_weight"  # derived by the objective (normalise = "sequence")
# sampler_mismatch: the mean |lp − sampler's lp| where the data carries the sampler's, else 0
METRICS = ("clip_fraction", "kl", "entropy", "ratio", "ratio_deviation", "sampler_mismatch")


class GRPO(MetricSums):
    metric_names = METRICS  # summed over this rank's completion tokens

    def __init__(self, cfg: GRPOConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def normaliser(self, inputs: StepInputs) -> int:
        if self.cfg.normalise == "token":
            return max(1, inputs.supervised)
        for mb in inputs.microbatches:  # whole microbatches (the runner CP-shards them after): host data
            if mb.llm is not None:
                mb.llm.fields[SEQUENCE_WEIGHT] = sequence_weights(mb.llm)
        return max(1, inputs.sequences)

    def loss_sum(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, fields = self.cfg, batch.fields
        if ADVANTAGE not in fields:
            raise ValueError(f"train.objective = 'grpo' needs an {ADVANTAGE!r} per completion token in the data "
                             f"(this batch carries {sorted(fields) or 'no fields'})")
        mask = batch.labels != IGNORE_INDEX
        stats = chunked_token_stats(logits, batch.labels, cfg.temperature)  # fp32 logits a chunk at a time
        lp, advantage = stats.logprobs, fields[ADVANTAGE]
        old = fields[BEHAVIOUR] if BEHAVIOUR in fields else lp.detach()
        ratio = torch.exp((lp - old) * mask)  # 1 off the completion: no overflow where nothing is scored
        unclipped = -advantage * ratio
        clipped = -advantage * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        loss = torch.maximum(unclipped, clipped)
        if cfg.dual_clip:
            loss = torch.where(advantage < 0, torch.minimum(loss, -advantage * cfg.dual_clip), loss)
        kl = torch.zeros_like(lp)
        if REFERENCE in fields:
            d = (fields[REFERENCE] - lp).clamp(-20, 20)
            kl = torch.exp(d) - 1 - d
        elif cfg.kl_beta:
            raise ValueError(f"train.grpo.kl_beta = {cfg.kl_beta} needs {REFERENCE!r} per completion token in the data")
        if cfg.kl_beta:
            loss = loss + cfg.kl_beta * kl
        weight = mask * fields[SEQUENCE_WEIGHT] if cfg.normalise == "sequence" else mask
        gap = (lp.detach() - fields[SAMPLER]).abs() if SAMPLER in fields else torch.zeros_like(lp)
        self.add_metrics(mask, [clipped > unclipped, kl, stats.entropy, ratio, (ratio - 1).abs(), gap])
        return (loss * weight).sum()



def sequence_weights(batch: Batch) -> torch.Tensor:
    """1 / the completion tokens of each token's sequence, shaped like the labels."""
    index = sequence_index(batch)
    supervised = (batch.labels != IGNORE_INDEX).float()
    counts = torch.zeros(batch.sequences, device=index.device)
    counts.index_add_(0, index.reshape(-1), supervised.reshape(-1))
    return 1 / counts.clamp(min=1)[index]
