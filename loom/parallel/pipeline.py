"""Pipeline parallelism for the LLM: the DecoderLM cut into stage modules from outside, run by a schedule of
`torch.distributed.pipelining`.

Stages: the layers are split into pp · v contiguous stages, balanced by per-token matmul FLOPs (the LM head
counts, often as several layers; the embedding is a lookup) unless `parallel.pp_split` gives the sizes.
Stage 0 also embeds and inserts the modality rows; the last stage also norms, projects and scores. A pp
rank holds stages r, r + pp, … (loop order), or r and 2·pp − 1 − r for zbv (V order).

The model stays plain: each stage module *reuses* the DecoderLM's own submodules, and this rank's stages are
gathered in a `PipelinedLM` under the DecoderLM's names (`layers.7.mlp…`), so state dicts, the optimizer,
verify and checkpoints name every weight as the one-process model does.

Microbatches: the schedule passes each stage a microbatch index (`mb`, a host tensor); the stage reads that
microbatch's batch (positions, token spans with the CP shard, labels, per-token fields) from a table the step
fills from host data before the schedule runs, and stage 0 asks the step's row source for its modality rows
— only the hidden states travel between stages.
Losses: the last stage returns the objective's loss of the microbatch divided by the step's normaliser (for
SFT the *global* supervised-token count), so the schedule's own gradient scaling stays off (`scale_grads=False`).
Gradient reduction (`parallel.pp_grad_reduce`): "step" is PipelineStage's own — FSDP2's sync off for every
microbatch, one reduce-scatter per block after the last (unsharded gradients held through the step);
"microbatch" keeps FSDP2's sync on (`ShardedGradStage`): each microbatch's backward reduce-scatters and
reshards, so memory stays sharded for M× the reduce-scatter traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor

from loom.data.batch import Batch
from loom.models.llm import DecoderLM, LLMConfig, at_rows, embed_with_inserts

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = ("gpipe", "1f1b")  # schedules that take one stage per rank, not a list
ZERO_BUBBLE = ("zero_bubble", "zbv")  # backward split into input and (deferred) weight gradients


# ---------------------------------------------------------------- the split


def layer_flops(cfg: LLMConfig) -> int:
    """Matmul FLOPs per token of one decoder layer's forward (attention's T² part aside: it grows with T
    alike on every stage)."""
    d, hd = cfg.hidden_size, (cfg.key_dim + cfg.value_dim) // 2
    attn = d * cfg.num_heads * hd * 2 + d * cfg.num_kv_heads * hd * 2  # q, o; k, v (MLA: as if expanded)
    return 2 * (attn + 3 * d * cfg.intermediate_size)


def head_flops(cfg: LLMConfig) -> int:
    return 2 * cfg.hidden_size * cfg.vocab_size


def split_layers(cfg: LLMConfig, stages: int, sizes: list[int] | None = None) -> list[list[int]]:
    """Layer indices of each stage: `sizes` as given, or the contiguous split whose costliest stage is
    cheapest (the head's FLOPs added to the last stage; exact by dynamic programming, n·S² is tiny)."""
    n = cfg.num_layers
    if not sizes:
        sizes = balanced_sizes([layer_flops(cfg)] * n, stages, last_extra=head_flops(cfg))
    bounds = [sum(sizes[:s]) for s in range(stages + 1)]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]


def balanced_sizes(costs: list[int], stages: int, last_extra: int, first_extra: int = 0) -> list[int]:
    """Layers per stage: the contiguous split of `costs` whose costliest stage (the last with `last_extra`, the
    first with `first_extra`) is cheapest."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the lowest max-stage cost splitting the first i layers into s stages (≥ 1 layer each)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            extra = (last_extra if s == stages else 0) + (first_extra if s == 1 else 0)
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    sizes, i = [], n
    for s in range(stages, 0, -1):
        sizes.append(i - cut[s][i])
        i = cut[s][i]
    return sizes[::-1]


def stages_of_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stage indices pp rank `pp_rank` holds: loop order, or V order for zbv."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


# ---------------------------------------------------------------- stage modules


class StageRows(Protocol):
    """Where stage 0 gets each microbatch's modality rows, and whom it tells when a microbatch's backward is done
    (train/rows.py: rows computed before the schedule, or received from encoder ranks while it runs)."""

    def inserts(self, i: int, selectors: dict[int, torch.Tensor] | None) -> dict[int, torch.Tensor]: ...

    def backward_done(self, i: int) -> None: ...


@dataclass
class MicrobatchData:
    """What every stage needs of one microbatch besides the hidden states: built from host data."""

    batch: Batch  # this cp rank's LLM part: positions, token spans, labels and per-token fields
    selectors: dict[int, torch.Tensor] | None  # under cp: which of each modality's rows land on this rank


class MicrobatchTable:
    """One step's microbatches, where stage 0's rows come from and the last stage's loss: filled by `Pipeline.run`
    before the schedule runs, read by this rank's stages (which hold the table from construction)."""

    def __init__(self) -> None:
        self.microbatches: list[MicrobatchData] = []
        self.rows: StageRows | None = None
        # the last stage's loss of one microbatch, already divided by the step's normaliser
        self.loss: Callable[[torch.Tensor, Batch], torch.Tensor] | None = None

    def __getitem__(self, mb: torch.Tensor) -> MicrobatchData:
        return self.microbatches[int(mb)]  # a host tensor: no device sync


class StageModule(nn.Module):
    """Layers `layers` of a DecoderLM; stage 0 also embeds, the last stage also norms, projects and scores."""

    def __init__(self, llm: DecoderLM, layers: list[int], first: bool, last: bool, table: MicrobatchTable):
        super().__init__()
        self.cfg = llm.cfg
        self.embed_tokens = llm.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): llm.layers[str(i)] for i in layers})
        self.norm = llm.norm if last else None
        self.lm_head = llm.lm_head if last else None
        self.rotary = llm.rotary
        self.table = table

    def forward(self, x: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        data = self.table[mb]
        if self.embed_tokens is not None:
            h = embed_with_inserts(self.embed_tokens, x, self.table.rows.inserts(int(mb), data.selectors))
        else:
            h = x
        rope = self.rotary(data.batch.positions, h.dtype, data.batch.labels.dim())
        for layer in self.layers.values():
            h = layer(h, rope, data.batch.spans)
        if self.lm_head is None:
            return h
        rows = data.batch.targets  # the head's rows (RunContext.context_share keeps them only where it can)
        loss = self.table.loss(self.lm_head(self.norm(h if rows is None else at_rows(h, rows))),
                               data.batch.at_targets())
        return loss.to_local() if isinstance(loss, DTensor) else loss  # replicated over tp: every rank has it


class PipelinedLM(nn.Module):
    """This rank's stages of the LLM (indices `indices` of `n_stages`), their parts registered under the
    DecoderLM's own names."""

    def __init__(self, llm: DecoderLM, stages: list[StageModule], indices: list[int], n_stages: int) -> None:
        super().__init__()
        self.cfg = llm.cfg
        self.indices, self.n_stages = indices, n_stages
        for name in ("embed_tokens", "norm", "lm_head"):
            part = next((getattr(s, name) for s in stages if getattr(s, name) is not None), None)
            if part is not None:
                self.add_module(name, part)
        self.layers = nn.ModuleDict({i: layer for s in stages for i, layer in s.layers.items()})
        self.rotary = llm.rotary
        self.stages = stages  # a plain list: the stages' parameters are registered once, above
        # name here → the one-process name of the weight it copies: the head's copy of a tied embedding
        tied = llm.cfg.tie_embeddings and hasattr(self, "lm_head")
        self.tied_copies = {"lm_head.weight": "embed_tokens.weight"} if tied else {}

    @property
    def table(self) -> MicrobatchTable:
        return self.stages[0].table


def split_language(llm: DecoderLM, pp_rank: int, pp: int, virtual: int, schedule: str,
                   sizes: list[int] | None) -> PipelinedLM:
    """This rank's stages of `llm` (the other layers are dropped with it)."""
    n_stages = pp * virtual  # zbv: validated to 2 per rank
    layers = split_layers(llm.cfg, n_stages, sizes)
    indices = stages_of_rank(pp_rank, pp, virtual, schedule)
    if llm.cfg.tie_embeddings and n_stages - 1 in indices:
        # one Parameter cannot live on two ranks, nor in two FSDP2 roots (zbv): the head gets its own copy of
        # the embedding, and the two gradients are summed after the schedule (parallel/tied.py)
        embed = llm.embed_tokens.weight
        llm.lm_head.weight = nn.Parameter(embed.detach().clone(), requires_grad=embed.requires_grad)
    table = MicrobatchTable()
    stages = [StageModule(llm, layers[s], s == 0, s == n_stages - 1, table) for s in indices]
    return PipelinedLM(llm, stages, indices, n_stages)


# ---------------------------------------------------------------- the schedule


class RowsAwareStage(PipelineStage):
    """A PipelineStage that tells stage 0's row source when its backward of a microbatch is complete (the
    non-colocated step returns the modality rows' gradients to the encoder ranks then); the pipelining stack has
    no such hook. Its module's table is the step's (`MicrobatchTable`), so nothing is reassigned per step."""

    def _rows_done(self, mb: int) -> None:
        if self.stage_index == 0 and self.has_backward:  # forward only (`eval`), the backward slots do nothing
            self.submod.table.rows.backward_done(mb)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        if full_backward:
            self._rows_done(bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        # zero-bubble: the first stage runs its whole backward here (it has no input gradient to send)
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._rows_done(bwd_chunk_id)


class ShardedGradStage(RowsAwareStage):
    """A stage whose FSDP2 module reduce-scatters its gradients and reshards after every microbatch's
    backward, as FSDP2 does without a pipeline (`parallel.pp_grad_reduce = "microbatch"`). The schedule's
    closing `perform_reduce_grad` then finds no unsharded gradient left and reduces nothing a second time."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type != "full":  # rejected by config (topology/checks.py): say so rather than reduce wrongly
            raise RuntimeError(f"pp_grad_reduce = 'microbatch' runs full backwards only, got {backward_type!r}")
        # by hand: PipelineStage turns FSDP2's sync off for every microbatch and has no switch to keep it on
        self.submod.set_requires_gradient_sync(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_is_last_backward(False)  # FSDP2 waits for the reductions once, in perform_reduce_grad
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


class Pipeline:
    """The schedule over this rank's stages; `run` trains one step's microbatches through it. Built at the
    first step, when the (fixed) microbatch shape is known: the schedule allocates its buffers once."""

    def __init__(self, lm: PipelinedLM, schedule: str, microbatches: int, group: dist.ProcessGroup,
                 device: torch.device, hidden_dtype: torch.dtype, tp_shards: int, grad_reduce: str = "step",
                 sum_tied_grads: Callable[[], None] | None = None) -> None:
        self.lm, self.indices, self.table, self.n_stages = lm, lm.indices, lm.table, lm.n_stages
        # an embedding tied to the head (parallel/tied.py): its two copies' gradients are summed after the schedule
        self.sum_tied_grads = sum_tied_grads
        self.schedule_name, self.microbatches, self.group, self.device = schedule, microbatches, group, device
        self.stage_class = ShardedGradStage if grad_reduce == "microbatch" else RowsAwareStage
        self.hidden_dtype, self.tp_shards = hidden_dtype, tp_shards  # tp_shards: tokens split over tp (SP)
        self.first = 0 in self.indices  # this rank runs stage 0: it embeds and inserts the modality rows
        self.schedule, self.stages = None, []

    def _build(self, ids: torch.Tensor) -> None:
        hidden = [*ids.shape, self.lm.cfg.hidden_size]
        # sequence parallel: each tp rank holds its shard of the tokens (packed dim 0, padded dim 1)
        hidden[0 if ids.dim() == 1 else 1] //= self.tp_shards
        meta = lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
        stages = []
        for module, s in zip(self.lm.stages, self.indices):
            # hidden states require grad (their gradient goes back a stage); the last stage returns the loss
            inputs = meta(ids.shape, ids.dtype) if s == 0 else meta(hidden, self.hidden_dtype).requires_grad_()
            last = s == self.n_stages - 1
            outputs = (meta((), torch.float32) if last else meta(hidden, self.hidden_dtype)).requires_grad_()
            stages.append(self.stage_class(module, s, self.n_stages, self.device, input_args=inputs,
                                           output_args=outputs, group=self.group))
        self.stages = stages
        cls = SCHEDULES[self.schedule_name]
        # the last stage's loss is already divided by the global token count: nothing to scale
        self.schedule = cls(stages[0] if self.schedule_name in SINGLE_STAGE else stages, self.microbatches,
                            loss_fn=lambda loss, _mb: loss, scale_grads=False)

    def run(self, microbatches: list[MicrobatchData], rows: StageRows,
            loss: Callable[[torch.Tensor, Batch], torch.Tensor], train: bool = True) -> torch.Tensor:
        """Every microbatch through the schedule — forward and backward (then a tied embedding's two gradients
        summed), or forward only (the schedule's `eval`). `rows`: stage 0's modality rows; `loss`: the last
        stage's loss of a microbatch, already divided by the step's normaliser. Returns this rank's summed
        losses: 0 off the last stage."""
        ids = [m.batch.input_ids for m in microbatches]  # stage 0's input: each microbatch's ids, one shape
        if self.schedule is None:
            self._build(ids[0])
        self.table.microbatches, self.table.rows, self.table.loss = microbatches, rows, loss
        mb = torch.arange(self.microbatches)
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        try:
            # the schedule cuts the concatenated ids (and mb) back into microbatches
            run(torch.cat(ids), target=mb, losses=losses, mb=mb, return_outputs=False)
        finally:
            self.table.microbatches, self.table.rows, self.table.loss = [], None, None
        if train and self.sum_tied_grads is not None:
            self.sum_tied_grads()
        return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)
