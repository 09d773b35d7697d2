"""DPO (direct preference optimisation) as an objective of the step's seam.

Per pair of answers to one prompt, chosen (c) and rejected (r):
    loss = −log σ(β · [(lp_c − lp_ref_c) − (lp_r − lp_ref_r)])
where lp is an answer's summed logprob under the policy and lp_ref under the reference policy (the
`ref_logprobs` field, which train.reference scores before the step); with `length_normalise` each sum is
divided by its answer's tokens. An optional SFT term adds α · the chosen answer's mean token cross-entropy.
The step divides the sum over pairs by the global batch's pairs.

Pairs: the data keeps a pair's two sequences side by side in one microbatch (data/sample.py `SamplePair`,
train/step_parts.py `split_llm_parts`), chosen first, so the microbatch's sequences 2j and 2j + 1 are pair j;
fillers (no targets) come after every real sequence and are masked by their zero token count.

Context parallel: each cp rank holds a part of every sequence, so its per-sequence sums are partial. They are
added over cp with an identity backward, every cp rank then computes the whole loss, and the value counts once
(cp rank 0) while the gradient flows on every rank into its own tokens: each rank's gradient is f'(S)·∂S_rank,
and their sum over cp (FSDP's reduce) is f'(S)·∂S, as one process computes it — not cp times that, which an
all-reduce's own backward (a sum of cp equal gradients) would give.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.config import DPOConfig
from loom.data.batch import IGNORE_INDEX, Batch, sequence_index
from loom.train.metric_sums import MetricSums
from loom.train.inputs import StepInputs
from loom.train.token_fields import REFERENCE
from loom.train.token_stats import chunked_token_stats, sum_over_shards

SEQUENCE = "dpo_sequence"  # each token's sequence in its whole microbatch: derived before CP splits it
METRICS = ("reward_margin", "accuracy", "chosen_reward", "rejected_reward")


class DPO(MetricSums):
    metric_names = METRICS  # summed over this rank's pairs (cp ranks alike: the means are the same)

    def __init__(self, cfg: DPOConfig, cp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.cfg, self.cp_group = cfg, cp_group

    def normaliser(self, inputs: StepInputs) -> int:
        """The global batch's pairs (every DPO answer has a target: each sequence counts); each microbatch's
        sequence index becomes a field, so CP shards it with the labels."""
        for mb in inputs.microbatches:
            if mb.llm is not None:
                mb.llm.fields[SEQUENCE] = sequence_index(mb.llm).float()
        return max(1, inputs.sequences // 2)

    def loss_sum(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, fields = self.cfg, batch.fields
        if REFERENCE not in fields:
            raise ValueError(f"train.objective = 'dpo' needs {REFERENCE!r} per answer token: set train.reference")
        mask = (batch.labels != IGNORE_INDEX).float()
        lp = chunked_token_stats(logits, batch.labels).logprobs * mask  # fp32 logits a chunk at a time
        # one slot per sequence (filler segments included), read from the spans: the same on every cp rank (each
        # holds a share of every sequence), whatever rows the head ran on, and no sync
        slots, index = batch.sequences, fields[SEQUENCE].long().reshape(-1)
        per_token = torch.stack([lp - fields[REFERENCE] * mask, lp, mask]).reshape(3, -1)
        sums = torch.zeros(3, slots, device=lp.device).index_add(1, index, per_token)
        gain, logprob, tokens = sum_over_shards(sums, self.cp_group)  # whole sequences; backward the identity
        if cfg.length_normalise:
            gain = gain / tokens.clamp(min=1)
        pairs = slots // 2
        chosen, rejected = gain[: 2 * pairs].view(pairs, 2).unbind(1)
        real = (tokens[: 2 * pairs].view(pairs, 2) > 0).all(1).float()
        margin = cfg.beta * (chosen - rejected)
        loss = -F.logsigmoid(margin) * real
        if cfg.sft_weight:
            chosen_tokens = tokens[: 2 * pairs : 2].clamp(min=1)
            loss = loss - cfg.sft_weight * logprob[: 2 * pairs : 2] / chosen_tokens * real
        self.add_metrics(real, [margin, margin > 0, cfg.beta * chosen, cfg.beta * rejected])
        total = loss.sum()
        if self.cp_group is not None and dist.get_rank(self.cp_group) != 0:
            total = total - total.detach()  # the value once (cp rank 0); the gradient on every rank
        return total
