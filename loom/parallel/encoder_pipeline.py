"""Pipeline parallelism for a non-colocated encoder: a ModalityEncoder cut into pp stages from outside.

Stages: the encoder's layers are split into pp contiguous runs, balanced by matmul FLOPs per row as the LLM's are
(parallel/pipeline.py `balanced_sizes`): the stem (patch embedding / convolutions) counts on the first stage,
the projector on the last. Stage 0 embeds the raw items and runs its layers; a middle stage runs its layers on
the hidden states it receives; the last stage also applies the final norm and the projector, so its output is
the rows the point-to-point bridge carries to the LLM.

The model stays plain: a stage is the encoder object itself with the layers of other stages, and the stem or
head it does not run, removed (`STEM` / `HEAD` name them), under a `EncoderStage` that registers it and the
projector under the ModalityEncoder's own names (`encoder.layers.3…`, `projector…`) — so the optimizer,
verify and checkpoints name every weight as on one process. Only hidden states `[rows, hidden]` travel between
stages; each stage knows its items' row counts from host data (train/inputs.py `StepBatch.item_rows`).
The program that runs the stages and moves their activations is train/encoder_ranks.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loom.models.encoder_layer import run_packed
from loom.models.multimodal import ModalityEncoder
from loom.models.sizes import matmul_params
from loom.parallel.pipeline import balanced_sizes
from loom.topology.role import StagePosition


def split_encoder_layers(modality: ModalityEncoder, stages: int) -> list[list[int]]:
    """Layer indices of each stage: the contiguous split whose costliest stage is cheapest, per row (every
    layer of an encoder computes on every row; the stem's matmuls added to the first stage, the projector's to
    the last)."""
    enc = modality.encoder
    costs = [matmul_params(layer) for layer in enc.layers]
    # the stem's modules (a CLIP tower's [CLS] row is a bare parameter, absent parts None)
    stem = sum(matmul_params(part) for name in enc.STEM if isinstance(part := getattr(enc, name), nn.Module))
    sizes = balanced_sizes(costs, stages, last_extra=matmul_params(modality.projector), first_extra=stem)
    bounds = [sum(sizes[:s]) for s in range(stages + 1)]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]


class EncoderStage(nn.Module):
    """Stage `index` of `count` of a ModalityEncoder (its `encoder` trimmed to the stage's parts, the projector on
    the last stage). forward(x, item_rows): x is the raw items on stage 0, else the previous stage's hidden
    states; `item_rows` the items' row counts (host data; none: the encoder's one minimal input, as unsplit)."""

    def __init__(self, modality: ModalityEncoder, layers: list[int], index: int, count: int) -> None:
        super().__init__()
        enc = modality.encoder
        self.position = StagePosition(index, count)
        first, last = self.position.is_first, self.position.is_last
        self.empty_rows = enc.num_tokens(enc.empty_input())  # rows of the minimal input (shape only: works on meta)
        enc.layers = nn.ModuleDict({str(i): enc.layers[i] for i in layers})  # keeps the one-process names
        for name in (enc.STEM if not first else ()) + (enc.HEAD if not last else ()):
            setattr(enc, name, None)  # another stage's part: no parameters here
        self.encoder = enc
        self.projector = modality.projector if last else None

    def rows(self, item_rows: list[int]) -> int:
        """The rows of the hidden states between stages for items of `item_rows` rows."""
        return sum(item_rows) or self.empty_rows

    def forward(self, x: list[torch.Tensor] | torch.Tensor, item_rows: list[int]) -> torch.Tensor:
        enc = self.encoder
        if self.position.is_first:  # no item of this modality: the minimal input, as ModalityEncoder.forward runs it
            h, lengths = enc.embed(x if item_rows else [enc.empty_input()])
        else:
            h, lengths = x, list(item_rows) or [self.empty_rows]
        h = run_packed(h, lengths, enc.layers.values(), enc.row_budget)
        if not self.position.is_last:
            return h
        rows = self.projector(enc.finish(h, lengths))
        return rows if item_rows else rows[:0].clone()  # no view: FSDP warns


def encoder_stage(modality: ModalityEncoder, index: int, count: int) -> EncoderStage:
    """Stage `index` of `count` of `modality` (the other stages' layers are dropped with it)."""
    return EncoderStage(modality, split_encoder_layers(modality, count)[index], index, count)
