"""A rank's inputs for one optimizer step, from host data alone (ranks agree wherever their plans meet, with no
collective).

The global batch of step s is split into M microbatches per LLM replica: bins of exactly
`data.tokens_per_microbatch` tokens filled by the balancing packer (data/bins.py), or, without a token
budget, contiguous equal shares, padded (bshd) to exactly [R, S]: R = global_batch_size / (dp·M) rows of
S = `data.padded_length` tokens, so these shapes never change either. Each encoder replica then takes its
part of every microbatch: under fan-in (more encoder replicas than LLM replicas) a contiguous, row-balanced
part of one LLM replica's samples; under fan-out the LLM replicas of its block, one after another. The
bridge concatenates or narrows these row runs, so it only needs the row counts of the replicas it connects, which
the ranks concerned compute here. All of it is planned from the samples' shapes (data/shapes.py), as arrays
(data/shape_arrays.py, the placement train/step_parts.py), in planning cells (train/plan_cells.py): past
data.balance_replicas LLM replicas a rank plans only the cells of its own replicas, with the whole batch's totals
beside them. A rank renders and decodes only the samples its LLM replica and encoder replicas take (`plan_cells`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch

from loom.bridge.replica_rows import ReplicaRows
from loom.config import JobConfig
from loom.data.batch import Batch, pad_samples, round_up, supervised_sequences
from loom.data.format import TokenCounter
from loom.data.packing import pack_samples, packed_length
from loom.data.mrope import with_mrope_positions
from loom.data.conversations import BadSample
from loom.data.sample import Sample, decoded
from loom.data.shape_arrays import ShapeArrays
from loom.data.shapes import SampleShape, shape_of
from loom.data.tokenizer import Vocabulary
from loom.train.length_rules import limit
from loom.data.shape_columns import ShapeColumns
from loom.train.cell_batch import CellBatch
from loom.train.cell_placement import place
from loom.train.plan_cells import Cells
from loom.train.step_parts import item_starts, rounded, step_bin_stats
from loom.train.step_totals import StepTotals, step_totals
from loom.data.spans import FILLER_PIECES, TokenSpans

COMPILED_TOKEN_MULTIPLE = 64


@dataclass
class StepBatch:
    """One microbatch on this rank: the LLM's part as a batch, each encoder's part as its items."""

    llm: Batch | None  # None on a rank that does not host the LLM (non-colocated)
    encoder_items: dict[str, list[torch.Tensor]]  # per encoder, in placeholder order of its part
    rows: dict[str, ReplicaRows] = field(default_factory=dict)  # per encoder (none on one process)
    # per hosted encoder, its items' rows (host data): what a pipelined encoder's later stages need of them
    item_rows: dict[str, list[int]] = field(default_factory=dict)

    @staticmethod
    def of(batch: Batch) -> StepBatch:
        """Every module reads the same samples (one process): the batch's own items."""
        return StepBatch(batch, batch.modality_inputs)


class Share(NamedTuple):
    """A rank's part of one module's data: its replica (None where the rank does not host the module: no items,
    the row counts only), the module's replicas, and whether the rank's stage reads the module's raw inputs (a
    pipelined encoder's later stages take hidden states from the stage before: their media are not decoded)."""

    dp_rank: int | None
    dp_size: int
    reads_inputs: bool = True


@dataclass
class StepInputs:
    microbatches: list[StepBatch]
    supervised: int  # supervised tokens of the whole global batch: every microbatch's loss divides by it
    tokens: int  # real (non-padding) LLM tokens of this rank's replica over the step
    stats: dict[str, float] = field(default_factory=dict)  # bin balance and fill (with a token budget)
    global_tokens: int = 0  # real LLM tokens of the whole global batch (every rank knows it)
    # dataset index → why: samples whose files failed to decode here (found only by the rank that decodes
    # them; the step must not start until every rank knows them, train/step_data.py's step_inputs)
    failed: dict[int, str] = field(default_factory=dict)
    indices: list[int] = field(default_factory=list)  # the dataset indices of the samples this rank planned
    sequences: int = 0  # samples of the whole global batch with a target (sequence-normalised objectives)
    # the whole global batch's sums, its FLOP count's among them (train/flops.py); None: a step of given samples
    totals: StepTotals | None = None
    # dataset indices found bad when drawn (the same on every rank): in no rank's plan, so a drop needs no replan
    left_out: frozenset[int] = frozenset()

    @staticmethod
    def of(batch: Batch, tokens: int = 0) -> StepInputs:
        return StepInputs([StepBatch.of(batch)], batch.num_supervised, tokens, global_tokens=tokens,
                          sequences=supervised_sequences(batch))

    def to(self, device: torch.device, non_blocking: bool = False) -> StepInputs:
        return self.map(lambda t: t.to(device, non_blocking=non_blocking), lambda b: b.to(device, non_blocking))

    def pin_memory(self) -> StepInputs:
        """Page-locked host copies (the DataLoader's pinning thread calls it), for asynchronous copies."""
        return self.map(lambda x: x.pin_memory(), Batch.pin_memory)  # an item: a tensor, or anyres tiles

    def map(self, item_fn, batch_fn) -> StepInputs:
        micro = [StepBatch(None if m.llm is None else batch_fn(m.llm),
                           {k: [item_fn(x) for x in v] for k, v in m.encoder_items.items()}, m.rows, m.item_rows)
                 for m in self.microbatches]
        return dataclasses.replace(self, microbatches=micro)


def collate(samples: list[Sample], cfg: JobConfig, tok: Vocabulary, multiple: int | None = None,
            length: int | None = None, rows: int = 0) -> Batch:
    """Packed (THD) or padded (BSHD) batch of `samples`, each padded to `multiple` tokens (default
    data.pad_to_multiple); `length`: a packed batch filled to exactly that many tokens, or a padded one's
    rows of exactly that many tokens (`rows` of them)."""
    d, backend = cfg.data, cfg.model.attention
    multiple = multiple or d.pad_to_multiple
    samples = [with_streams(s, cfg, tok) for s in samples]
    # compiled blocks specialise on the token count's alignment and size range, and under FSDP one rank's
    # recompile stalls them all: rounding the count up to a multiple of 64 keeps the variants few
    step = math.lcm(multiple, COMPILED_TOKEN_MULTIPLE) if cfg.train.compile else multiple
    if d.format != "thd":
        return pad_samples(samples, tok.pad_id, step, backend=backend, length=length or 0, rows=rows)
    # a share without samples (fewer samples than replicas: RL's rollouts) is filler alone, not 0 tokens
    batch = pack_samples(samples, tok.pad_id, multiple,
                         length or max(round_up(packed_length(samples, multiple), step), step), backend=backend)
    if length and cfg.train.compile:
        # fixed shapes, so a compiled block never recompiles: cu_seqlens of a fixed length (at most one segment
        # per sample of the global batch, plus the filler's; each holds ≥ `multiple` tokens) and max_seqlen = T
        segments = min(cfg.train.global_batch_size + FILLER_PIECES, length // multiple)
        batch.spans = replace(TokenSpans.from_lengths(batch.spans.cu_seqlens.diff().tolist(), backend=backend,
                                                        segments=segments, max_seqlen=length),
                              counted=batch.spans.counted)
    return batch


def with_streams(sample: Sample, cfg: JobConfig, tok: Vocabulary) -> Sample:
    """An M-RoPE model's sample (Qwen2-VL) with its three position streams, read from its images' grids (so built
    before a step's LLM part drops its media); any other sample as it is."""
    if sample.rope_positions is not None or not (cfg.model.language.rope_scaling or {}).get("mrope_section"):
        return sample
    v = cfg.model.vision
    return with_mrope_positions(sample, tok.placeholder_ids["vision"], v.patch_size, v.merge_size)


def plan_inputs(samples: list[Sample], indices: list[int], cfg: JobConfig, tok: Vocabulary,
                counters: dict[str, TokenCounter], shares: dict[str, Share], multiple: int,
                device: torch.device) -> StepInputs:
    """This rank's microbatches of global batch `samples` (every one rendered already: held-out sets, RL's)."""
    shapes = [shape_of(s, counters) for s in samples]
    return plan_shapes(shapes, indices, samples.__getitem__, cfg, tok, counters, shares, multiple, device)


def plan_shapes(shapes: ShapeArrays | list[SampleShape], indices: list[int] | np.ndarray,
                render: Callable[[int], Sample], cfg: JobConfig, tok: Vocabulary, counters: dict[str, TokenCounter],
                shares: dict[str, Share], multiple: int, device: torch.device) -> StepInputs:
    """This rank's microbatches of a global batch planned from its samples' `shapes` alone; `render(p)`: the
    sample at position p, asked only for the positions this rank's LLM replica and encoder replicas take (a
    BadSample it raises is noted in `failed`, as a file that fails to decode is). `shares`: module → `Share`
    (a plain (dp rank, dp size) reads its inputs); the dp rank is None for a module this rank does not host
    (non-colocated): it gets no items (no LLM batch), but the row counts, which the bridges need on both sides.
    The batch is planned in cells (train/plan_cells.py), as a step is: its totals are the whole batch's."""
    if not isinstance(shapes, ShapeArrays):
        shapes = ShapeArrays.of(shapes, list(counters))
    indices = np.asarray(indices, dtype=np.int64)
    cells = Cells.of(cfg.data.balance_replicas, Share(*shares["language"]).dp_size)
    batch = CellBatch.whole(shapes, indices, len(item_starts(indices)), None, cells, cells.windows(shares),
                            step_totals(ShapeColumns.of(shapes)))
    taken = batch.taken
    return plan_cells(batch, render if taken is None else lambda p: render(int(taken[p])), cfg, tok, counters,
                      shares, multiple, device)


def plan_cells(batch: CellBatch, render: Callable[[int], Sample], cfg: JobConfig, tok: Vocabulary,
               counters: dict[str, TokenCounter], shares: dict[str, Share], multiple: int, device: torch.device
               ) -> StepInputs:
    """This rank's microbatches of a global batch from the samples of its planning cells (`batch`; `render(p)`:
    their sample at position p, as in `plan_shapes`). The placement is train/cell_placement.py's, over arrays: no
    Python loop over the cells' samples, none over the rest of the batch."""
    shapes, totals = batch.shapes, batch.totals
    rows = {n: shapes.row_sums(n) for n in counters}  # the LLM's: what the bridges carry
    work = {n: shapes.tower_sums(n) for n in counters}  # the towers': what balancing weighs
    llm_rank, llm_dp, _ = Share(*shares["language"])
    m = cfg.train.microbatches
    placed, cell_parts = place(batch, rounded(shapes.tokens, multiple), work, rows, shares, m,
                               cfg.data.tokens_per_microbatch)
    length = limit(cfg)[1] or None  # T packed, S padded: every microbatch the same shape
    # padded: [R, S], R = an equal share of the global batch (filler rows where skips left fewer samples)
    padded_rows = cfg.train.global_batch_size // (llm_dp * m) if cfg.data.padded_length else 0
    micro, real, failed, rendered = [], 0, {}, {}

    def sample(p: int) -> Sample | None:  # each position rendered once, whichever modules of this rank take it
        if p not in rendered:
            try:
                rendered[p] = render(p)
            except BadSample as e:
                failed[p], rendered[p] = str(e), None
        return rendered[p]

    for plan in placed:
        mine = plan.llm
        real += int(shapes.tokens[mine].sum())
        items, item_rows = {}, {}
        for name in counters:
            if name not in plan.encoders:
                continue
            replica, reads_inputs = plan.encoders[name], Share(*shares[name]).reads_inputs
            # only this replica's items are decoded (a user's files: here), and only where its stage reads them
            decoded = [x for p in replica for x in _decode(sample(p), p, name, failed)] if reads_inputs else []
            items[name] = [x.to(device) for x in decoded]
            item_rows[name] = [r for p in replica for r in shapes.item_rows(p, name)]
        llm = None
        if llm_rank is not None:
            # the LLM's part goes without media: the encoders' parts above carry them
            text = [dataclasses.replace(with_streams(s, cfg, tok), images=[], audio=[]) for p in mine
                    if (s := sample(p)) is not None]
            llm = collate(text, cfg, tok, multiple, length, padded_rows)
            for name in totals.fields - llm.fields.keys():  # a microbatch without samples (an empty bin): zeros
                llm.fields[name] = torch.zeros(llm.labels.shape)
            llm = llm.to(device)
        micro.append(StepBatch(llm, items, plan.counts, item_rows))
    stats = {}
    if cfg.data.tokens_per_microbatch:
        stats = step_bin_stats(cell_parts, shapes.tokens, work, length).as_dict()
    return StepInputs(micro, totals.supervised, real, stats, totals.tokens,
                      {int(batch.indices[p]): message for p, message in failed.items()}, batch.indices.tolist(),
                      sequences=totals.sequences, totals=totals)


def _decode(sample: Sample | None, p: int, name: str, failed: dict[int, str]) -> list[torch.Tensor]:
    """Sample `p`'s items for encoder `name`, decoded; a file that fails to decode is noted in `failed` (the
    step's callers agree on such samples across ranks) and gives no items, as a sample that failed to render."""
    if sample is None:
        return []
    try:
        return [decoded(item) for item in sample.items(name)]
    except BadSample as e:
        failed[p] = str(e)
        return []
