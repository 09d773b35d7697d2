"""Scoring (`loom score`, and the RL loop's scoring pass): for each sample's target tokens, the policy's
log-probability of the given token, the entropy of its distribution and its top-k logits — under the job's
layout, by the step program run forward only with the `Scorer` objective.

Where each score belongs travels as per-token fields (`score_sample`: the sample's index in the input), so
packing, CP's load-balanced sharding and the pipeline's microbatch table move them with the labels and
nothing has to undo a permutation; a token's place in its sample travels so too (`score_position`: M-RoPE's
positions repeat within an image). Every rank that runs the
loss computes (the vocabulary's sums are collectives over tp); the ranks that add the step's loss (the LLM's
last stage, tp rank 0) contribute their records, every rank receives them all (all_gather_object), and the
samples come back in input order. A packed batch's labels never cross into the
next sample (the label rule), so no sample's last token is scored against the next one's first.

Memory: statistics are computed over chunks of `CHUNK_TOKENS` tokens, so fp32 logits are never held for a
whole microbatch (a chunk of 152K-vocabulary logits is 1024 · 152K · 4 B ≈ 0.6 GB).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.data.batch import IGNORE_INDEX, Batch
from loom.data.sample import Sample
from loom.train.inputs import StepInputs, plan_inputs
from loom.train.step import forward_pass
from loom.train.token_stats import VocabShard, token_stats, top_k, vocab_shard

SAMPLE = "score_sample"
POSITION = "score_position"  # a token's index in its sample
CHUNK_TOKENS = 1024


@dataclass
class SampleScores:
    """One sample's scored targets, in order: the target token ids and, for each, its log-probability, the
    entropy at that position, and the top-k logits (divided by the temperature) with their token ids."""

    targets: list[int]
    logprobs: list[float]
    entropy: list[float]
    top_k_ids: list[list[int]]
    top_k_logits: list[list[float]]


class Scorer:
    """The objective of a scoring pass: no loss (its sums are 0), per-token statistics kept on the side."""

    def __init__(self, k: int, temperature: float) -> None:
        self.k, self.temperature = k, temperature
        self.rows: list[tuple[torch.Tensor, ...]] = []  # per chunk: sample, position, target, lp, entropy, top k

    def normaliser(self, inputs: StepInputs) -> int:
        return 1

    def loss_sum(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        shard = vocab_shard(logits)  # every tp rank computes (the vocabulary's sums are collectives over tp)
        local = shard.local.reshape(-1, shard.local.shape[-1])
        labels, sample = batch.labels.reshape(-1), batch.fields[SAMPLE].reshape(-1)
        positions = batch.fields[POSITION].reshape(-1).long()
        for start in range(0, labels.numel(), CHUNK_TOKENS):
            part = slice(start, start + CHUNK_TOKENS)
            self._record(VocabShard(local[part], shard.offset, shard.group), labels[part], sample[part],
                         positions[part])
        return torch.zeros((), device=batch.labels.device)

    def _record(self, shard: VocabShard, labels, sample, positions) -> None:
        stats = token_stats(shard, labels, self.temperature)
        values, ids = top_k(shard, self.k, self.temperature) if self.k else (None, None)
        keep = labels != IGNORE_INDEX
        row = [sample[keep].long(), positions[keep], labels[keep], stats.logprobs[keep], stats.entropy[keep]]
        if self.k:
            row += [ids[keep], values[keep]]
        self.rows.append(tuple(t.detach().cpu() for t in row))


def score_samples(plan, model, samples: list[Sample], cfg, tok, counters, device: torch.device, k: int = 0,
                  temperature: float = 1.0) -> list[SampleScores]:
    """Every sample's scores, in input order, on every rank; `cfg.train.global_batch_size` samples at a time."""
    was_training = model.training
    model.eval()
    scorer = Scorer(k, temperature)
    size = cfg.train.global_batch_size
    for start in range(0, len(samples), size):
        chunk = [_tagged(s, start + i) for i, s in enumerate(samples[start:start + size])]
        inputs = plan_inputs(chunk, list(range(len(chunk))), cfg, tok, counters, plan.shares,
                             plan.sample_multiple, device)
        forward_pass(plan, model, inputs, scorer)
    model.train(was_training)
    rows = scorer.rows
    if plan.distributed:  # one copy of each record: the ranks that add the loss (tp rank 0 of the last stage)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, rows if plan.comms.adds_loss else [])
        rows = [r for rank_rows in every for r in rank_rows]
    return _by_sample(rows, len(samples), k)


def _tagged(sample: Sample, index: int) -> Sample:
    """`sample` with its index in the input and each token's index in it (the `score_sample` and `score_position`
    fields)."""
    fields = {**sample.token_fields, SAMPLE: [float(index)] * len(sample),  # exact in fp32 below 2**24
              POSITION: [float(i) for i in range(len(sample))]}
    return dataclasses.replace(sample, token_fields=fields)


def _by_sample(rows: list[tuple[torch.Tensor, ...]], n: int, k: int) -> list[SampleScores]:
    if not rows:
        return [SampleScores([], [], [], [], []) for _ in range(n)]
    columns = [torch.cat(c) for c in zip(*rows)]
    sample, position = columns[0], columns[1]
    order = torch.argsort(sample * (int(position.max()) + 1) + position)  # by sample, then position
    columns = [c[order] for c in columns]
    counts = torch.bincount(columns[0], minlength=n).tolist()
    out, at = [], 0
    for count in counts:
        part = [c[at:at + count] for c in columns]
        at += count
        out.append(SampleScores(part[2].tolist(), part[3].tolist(), part[4].tolist(),
                                part[5].tolist() if k else [], part[6].tolist() if k else []))
    return out
