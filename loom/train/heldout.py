"""Held-out loss and token accuracy under the training layout: a forward-only pass on every rank.

The held-out samples are cut, task by task, into global batches of `train.global_batch_size`, and each is
planned exactly as a training step (train/inputs.py) and run forward through the same `forward` as
`train_step` — encoders, bridges, CP sharding, TP's vocab-sharded logits — with no backward and no optimizer.
Each LLM rank at tp 0 adds its summed token loss and correct predictions to one world sum, as the training
loss is summed; the supervised-token counts come from host data. So every rank returns the same metrics, and
they equal the one-process ones on the same weights (tests/test_heldout.py); no rank builds a second model.

A pipelined LLM runs the three-phase step's first two phases with the schedule's `eval()` (the last stage
scores each microbatch). Non-colocated encoder ranks send each microbatch's rows in microbatch order, the
order in which a forward-only LLM stage 0 receives them.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from loom.data.batch import IGNORE_INDEX, Batch
from loom.data.format import TokenCounter
from loom.data.sample import Sample
from loom.data.tokenizer import Vocabulary
from loom.models.multimodal import MultimodalModel
from loom.parallel.context import shard_for_context
from loom.train.inputs import StepBatch, StepInputs, plan_inputs
from loom.train.loss import token_loss_sum
from loom.train.noncolocated_step import ReceivedRows
from loom.train.optim import reduce_values
from loom.train.pipeline_step import schedule_inputs, stage0_inserts
from loom.train.step import StepComms, forward


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


LogitsOf = Callable[[int, StepBatch, Batch, dict | None], torch.Tensor]  # (i, microbatch, LLM part, CP selectors)


@torch.no_grad()
def heldout_step(inputs: StepInputs, comms: StepComms, logits_of: LogitsOf, placeholder_ids: list[int],
                 tp_group: dist.ProcessGroup | None, autocast=contextlib.nullcontext) -> tuple[float, float]:
    """(summed token loss, correct predictions) of one global batch: this rank's part of them (the world's
    sum under a layout, taken by the caller). `logits_of` runs the model on microbatch i: the encoders and
    bridges, or (non-colocated) the rows received from the encoder ranks."""
    loss, hits = torch.zeros(()), torch.zeros((), dtype=torch.long)
    for i, micro in enumerate(inputs.microbatches):
        batch, selectors = micro.llm, None
        if comms.cp_group is not None:
            batch, selectors = shard_for_context(batch, comms.cp_group, placeholder_ids)
        with loss_parallel() if comms.loss_parallel else contextlib.nullcontext():
            with autocast():
                logits = logits_of(i, micro, batch, selectors)
            part = token_loss_sum(logits, batch.labels)
        loss = loss + (part.to_local() if isinstance(part, DTensor) else part).detach().cpu()
        hits = hits + predicted_hits(logits, batch.labels, tp_group).cpu()
    return float(loss), float(hits)


@torch.no_grad()
def encoder_heldout_step(model: MultimodalModel, inputs: StepInputs, bridges: dict, hosted: tuple[str, ...]) -> None:
    """A non-colocated encoder rank: each microbatch's rows sent to the LLM's stage 0, in microbatch order (a
    forward-only schedule's order on the LLM side)."""
    sends = []
    for i, micro in enumerate(inputs.microbatches):
        for name in hosted:
            rows = model.encoder(name)(micro.encoder_items.get(name, []))
            sends.extend(bridges[name].send_rows(rows, micro.rows[name], i))
    for work in sends:
        work.wait()


@torch.no_grad()
def pipelined_heldout_step(model: MultimodalModel, inputs: StepInputs, comms: StepComms, pipeline,
                           inserts, tp_group: dist.ProcessGroup | None) -> tuple[float, float]:
    """`heldout_step` with a pipelined LLM: the schedule run forward only, the last stage scoring each
    microbatch; `inserts(i, selectors)` gives stage 0 microbatch i's modality rows."""
    ids, data = schedule_inputs(model, inputs.microbatches, comms, inserts)
    hits = []

    def scored(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hits.append(predicted_hits(logits, labels, tp_group).cpu())
        return token_loss_sum(logits, labels)

    with loss_parallel() if comms.loss_parallel else contextlib.nullcontext():
        loss = pipeline.evaluate(ids, data, scored)
    return float(loss), float(sum(hits)) if hits else 0.0


def _run(plan, model: MultimodalModel, inputs: StepInputs, tp_group, autocast) -> tuple[float, float]:
    """One held-out global batch on this rank, dispatched the way RankPlan.train_step dispatches a step."""
    comms, bridges, micro = plan.comms, plan.bridges, inputs.microbatches
    placeholders = list(model.placeholder_ids.values())
    if plan.topo is not None and not plan.topo.placement.colocated:
        if "language" not in plan.hosted:
            encoder_heldout_step(model, inputs, bridges, plan.hosted)
            return 0.0, 0.0
        rows = ReceivedRows(model, bridges, micro, plan.rows_like)
        if plan.pipeline is not None:
            inserts = lambda i, sel: functools.partial(rows.inserts, i, sel) if plan.pipeline.first else {}  # noqa: E731
            return pipelined_heldout_step(model, inputs, comms, plan.pipeline, inserts, tp_group)
        return heldout_step(inputs, comms, lambda i, m, b, sel: model.language(
            b.input_ids, b.positions, b.spans, rows.inserts(i, sel)), placeholders, tp_group, autocast)
    if plan.pipeline is not None:
        rows = {}  # the three-phase step's first phase: each encoder on the whole step, rows to stage 0
        for name in model.encoder_names:
            encoded = model.encoder(name)([item for mb in micro for item in mb.encoder_items.get(name, [])])
            rows[name] = bridges[name].forward(encoded, [mb.rows[name] for mb in micro])
        return pipelined_heldout_step(model, inputs, comms, plan.pipeline,
                                      stage0_inserts(model, micro, rows, plan.pipeline.first), tp_group)
    return heldout_step(inputs, comms, lambda i, m, b, sel: forward(model, m, b, bridges or None, sel),
                        placeholders, tp_group, autocast)


def heldout_metrics(plan, model: MultimodalModel, samples: list[Sample], cfg, tok: Vocabulary,
                    counters: dict[str, TokenCounter], device: torch.device) -> dict[str, float]:
    """`loss`, `token_accuracy` and each task's (`loss/<task>`, `token_accuracy/<task>`), teacher-forced, on
    every rank alike; {} where the layout has no forward-only pass yet (see the module docstring)."""
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
            loss, hits = _run(plan, model, inputs, tp_group, plan.autocast(cfg.train.dtype, device))
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
