"""A model-ready batch, the next-token label rule, and padded (BSHD) collation."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from loom.data.mrope import padded_streams
from loom.data.sample import Sample, decoded
from loom.data.spans import TokenSpans

IGNORE_INDEX = -100
MODALITIES = ("vision", "audio")
# target rows are rounded up to this (tensor-core friendly; a compiled loss sees few shapes)
TARGET_MULTIPLE = 64


@dataclass
class Batch:
    """Tokens of several samples, packed ([T]) or padded ([B, S]), with everything the model needs."""

    input_ids: torch.Tensor
    labels: torch.Tensor  # next-token targets; IGNORE_INDEX where nothing is supervised
    positions: torch.Tensor  # position of each token inside its own sample; M-RoPE: labels' shape + [3] streams
    spans: TokenSpans
    modality_inputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # in placeholder order
    host_ids: torch.Tensor | None = None  # input_ids as they were on the host before .to(device)
    # per-token fields shaped like `labels` (Sample.token_fields): moved, packed and sharded without being named
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    # the rows whose logits an objective reads (`target_rows`): the LLM's head runs on these alone; None: all
    targets: torch.Tensor | None = None

    @property
    def num_supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def count(self, token_id: int) -> int:
        """Occurrences of a token id, read from the host copy when there is one (no device sync)."""
        ids = self.input_ids if self.host_ids is None else self.host_ids
        return int((ids == token_id).sum())

    @property
    def sequences(self) -> int:
        """Samples (and filler segments) of the batch, read from its spans: the same on a targets view."""
        return self.spans.cu_seqlens.numel() - 1 if self.spans.packed else self.spans.pad_mask.shape[0]

    def at_targets(self) -> Batch:
        """The batch at its target rows, flattened: labels, positions and fields as the objective reads them
        beside the head's logits of those rows (spans kept: the sample count). Itself without targets."""
        if self.targets is None:
            return self
        at = lambda t: token_rows(t, self.labels).index_select(0, self.targets)  # noqa: E731
        return Batch(at(self.input_ids), at(self.labels), at(self.positions), self.spans,
                     fields={k: at(t) for k, t in self.fields.items()})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """Page-locked host copies, so `.to(cuda, non_blocking=True)` overlaps the copy (DataLoader calls it)."""
        return self.map(torch.Tensor.pin_memory)

    def map(self, fn) -> Batch:
        """Every tensor through `fn`; the host ids stay on the host."""
        sp = self.spans
        spans = replace(sp, cu_seqlens=None if sp.cu_seqlens is None else fn(sp.cu_seqlens),
                         pad_mask=None if sp.pad_mask is None else fn(sp.pad_mask),
                         counted=None if sp.counted is None else fn(sp.counted))
        return Batch(fn(self.input_ids), fn(self.labels), fn(self.positions), spans,
                     {k: [fn(t) for t in v] for k, v in self.modality_inputs.items()},
                     self.input_ids if self.input_ids.device.type == "cpu" else self.host_ids,
                     {k: fn(t) for k, t in self.fields.items()}, None if self.targets is None else fn(self.targets))


def token_rows(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A per-token tensor with its token dims (the labels') flattened into one: [tokens, ...] (M-RoPE's three
    position streams stay a trailing dim)."""
    return values.reshape(-1, *values.shape[labels.dim():])


def target_rows(labels: torch.Tensor) -> torch.Tensor:
    """Where the flattened labels are targets, rounded up to TARGET_MULTIPLE (at least one multiple) with the
    first row that is not: the head computes logits only there (an SFT step's prompts, images and clips have
    none to read), and the extra rows' ignored labels add nothing. Collation calls it on the host, so no step
    waits for it (CP sharding calls it again on a rank's share, where that step already reads its lengths back)."""
    flat = labels.reshape(-1)
    rows = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    if not flat.numel():  # a replica without samples this step
        return rows
    extra = max(TARGET_MULTIPLE, round_up(rows.numel(), TARGET_MULTIPLE)) - rows.numel()
    if extra:
        ignored = (flat == IGNORE_INDEX).nonzero()
        if not ignored.numel():  # every sample's last token predicts nothing: there is always one
            raise ValueError("target_rows: labels without an ignored position")
        rows = torch.cat([rows, ignored[0].expand(extra)])
    return rows


def sequence_index(batch: Batch) -> torch.Tensor:
    """The sample each token belongs to, shaped like the labels: a packed batch's segment of cu_seqlens, a
    padded batch's row."""
    labels = batch.labels
    if batch.spans.packed:
        ends = batch.spans.cu_seqlens[1:].long()
        return torch.bucketize(torch.arange(labels.numel(), device=ends.device), ends, right=True).view_as(labels)
    return torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(labels)


def supervised_sequences(batch: Batch) -> int:
    """Samples of the batch with at least one target."""
    index = sequence_index(batch)[batch.labels != IGNORE_INDEX]
    return int(index.unique().numel())


def shifted_labels(sample: Sample) -> list[int]:
    """labels[i] = tokens[i+1] when that token is supervised, else IGNORE; the last token predicts nothing,
    so a label never crosses into the next sample."""
    toks, sup = sample.tokens, sample.supervised
    return [toks[i + 1] if sup[i + 1] else IGNORE_INDEX for i in range(len(toks) - 1)] + [IGNORE_INDEX]


def supervised_count(sample: Sample) -> int:
    """Targets of a sample after the shift: what Batch.num_supervised counts for it."""
    return sum(label != IGNORE_INDEX for label in shifted_labels(sample))


def field_names(samples: list[Sample]) -> set[str]:
    """The token fields of a batch: every sample must carry the same ones (a batch tensor per name)."""
    names = {frozenset(s.token_fields) for s in samples}
    if len(names) > 1:
        raise ValueError(f"samples of one batch carry different token fields: {sorted(map(sorted, names))}")
    return set(next(iter(names), ()))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def gather_modality_inputs(samples: list[Sample]) -> dict[str, list[torch.Tensor]]:
    """Every sample's modality items, sample after sample: the order their placeholders appear in."""
    return {m: [decoded(item) for s in samples for item in s.items(m)] for m in MODALITIES}


def pad_samples(samples: list[Sample], pad_id: int, multiple_of: int = 1, backend: str = "auto",
                length: int = 0, rows: int = 0) -> Batch:
    """BSHD: one row per sample, right-padded to the longest sample rounded up to `multiple_of` — or, fixed,
    to `length` tokens and `rows` rows (filler rows after the samples)."""
    if not samples and not rows:
        raise ValueError("pad_samples: no samples to collate")
    seq = length or round_up(max(len(s) for s in samples), multiple_of)
    rows = rows or len(samples)
    if len(samples) > rows or any(len(s) > seq for s in samples):
        raise ValueError(f"pad_samples: {len(samples)} samples of up to {max(map(len, samples))} tokens do not fit "
                         f"[{rows}, {seq}]")
    ids = torch.full((rows, seq), pad_id, dtype=torch.long)
    labels = torch.full((rows, seq), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((rows, seq), dtype=torch.bool)
    fields = {name: torch.zeros((rows, seq)) for name in field_names(samples)}
    for row, s in enumerate(samples):
        n = len(s)
        ids[row, :n] = torch.tensor(s.tokens)
        labels[row, :n] = torch.tensor(shifted_labels(s))
        mask[row, :n] = True
        for name, values in s.token_fields.items():
            fields[name][row, :n] = torch.tensor(values, dtype=torch.float32)
    # a filler row's first token counts as real, so no query row is all masked (a softmax over nothing: NaN in
    # SDPA kernels without a safe softmax); it has no labels, so it adds nothing to the loss or the gradients
    mask[len(samples):, 0] = True
    positions = torch.arange(seq).expand(rows, seq).clone()
    if any(s.rope_positions is not None for s in samples):  # M-RoPE: [rows, seq, 3], filler rows 0, 1, 2, …
        positions = torch.stack([padded_streams(s.rope_positions, len(s), seq) for s in samples]
                                + [padded_streams(None, 0, seq)] * (rows - len(samples)))
    counted = mask.clone()
    counted[len(samples):] = False  # a filler row's token marked real for attention is not a sample's
    spans = replace(TokenSpans.from_pad_mask(mask, backend), counted=counted)
    return Batch(ids, labels, positions, spans, gather_modality_inputs(samples), fields=fields,
                 targets=target_rows(labels))
