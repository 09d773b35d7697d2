"""Held-out loss and token accuracy under the training layout: a forward-only pass on every rank.

The held-out samples are cut, task by task, into global batches of `train.global_batch_size`, and each is
planned exactly as a training step (train/inputs.py) and run through the step's own program forward only
(train/step.py `forward_pass`) — encoders, bridges, CP sharding, TP's vocab-sharded logits, the pipeline
schedule's `eval()`, point-to-point rows from encoder ranks — with the held-out objective (`TokenScores`).
Each LLM rank at tp 0 adds its summed token loss and correct predictions to one world sum, as the training
loss is summed; the supervised-token counts come from host data. So every rank returns the same metrics, and
they equal the one-process ones on the same weights (tests/test_heldout.py); no rank builds a second model.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loom.data.batch import IGNORE_INDEX, Batch
from loom.data.format import TokenCounter
from loom.data.sample import Sample
from loom.data.tokenizer import Vocabulary
from loom.models.multimodal import MultimodalModel
from loom.train.inputs import StepInputs, plan_inputs
from loom.train.loss import token_loss_sum
from loom.train.optim import reduce_values
from loom.train.step import forward_pass


def predicted_hits(logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """How many supervised tokens the logits' argmax predicts right. Vocab-sharded logits (a DTensor under
    loss parallel) are not gathered: each tp rank's best (value, vocab index) is exchanged and the best kept,
    the lowest index on a tie, as torch.argmax picks."""
    supervised = labels != IGNORE_INDEX
    if not isinstance(logits, DTensor):
        return ((logits.argmax(-1) == labels) & supervised).sum()
    local = logits.to_local().float()
    best, index = local.max(-1)
    index = index + dist.get_rank(tp_group) * local.shape[-1]  # equal vocab chunks in rank order (tp divides vocab)
    size = dist.get_world_size(tp_group)
    values, indices = [torch.empty_like(best) for _ in range(size)], [torch.empty_like(index) for _ in range(size)]
    dist.all_gather(values, best, group=tp_group)
    dist.all_gather(indices, index, group=tp_group)
    winner = torch.stack(values).argmax(0)  # first maximum: the lowest tp rank, so the lowest vocab index
    predicted = torch.stack(indices).gather(0, winner.unsqueeze(0)).squeeze(0)
    return ((predicted == labels) & supervised).sum()


class TokenScores:
    """The held-out pass's objective: each microbatch's summed token loss (the step's normaliser is 1: the
    caller divides the world's sums), and, on the side, how many of its targets the logits predict right."""

    def __init__(self, tp_group: dist.ProcessGroup | None) -> None:
        self.tp_group, self.hits = tp_group, torch.zeros((), dtype=torch.long)

    def loss_sum(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        self.hits = self.hits + predicted_hits(logits, batch.labels, self.tp_group).cpu()
        return token_loss_sum(logits, batch.labels)

    def normaliser(self, inputs: StepInputs) -> int:
        return 1


def heldout_metrics(plan, model: MultimodalModel, samples: list[Sample], cfg, tok: Vocabulary,
                    counters: dict[str, TokenCounter], device: torch.device) -> dict[str, float]:
    """`loss`, `token_accuracy` and each task's (`loss/<task>`, `token_accuracy/<task>`), teacher-forced, on
    every rank alike."""
    hosts_llm = "language" in plan.hosted
    tp_group = None
    if plan.distributed and hosts_llm and plan.topo.grids["language"].layout.tp > 1:
        tp_group = plan.topo.grids["language"].group("tp")
    was_training = model.training
    model.eval()
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # task → loss, hits, supervised
    by_task: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_task[s.task].append(s)
    size = cfg.train.global_batch_size
    for task, of_task in sorted(by_task.items()):
        for start in range(0, len(of_task), size):
            chunk = of_task[start:start + size]
            inputs = plan_inputs(chunk, list(range(len(chunk))), cfg, tok, counters, plan.shares,
                                 plan.sample_multiple, device)
            scores = TokenScores(tp_group)
            loss, hits = forward_pass(plan, model, inputs, scores), float(scores.hits)
            if plan.distributed:
                loss, hits = reduce_values([loss, hits] if plan.comms.adds_loss else [0.0, 0.0], dist.ReduceOp.SUM,
                                           None)
            sums[task][0] += loss
            sums[task][1] += hits
            sums[task][2] += inputs.supervised
    model.train(was_training)
    out = {}
    for task, (loss, hits, supervised) in sums.items():
        out[f"loss/{task}"], out[f"token_accuracy/{task}"] = loss / supervised, hits / supervised
    total = [sum(v[i] for v in sums.values()) for i in range(3)]
    out["loss"], out["token_accuracy"] = total[0] / max(1, total[2]), total[1] / max(1, total[2])
    return out
