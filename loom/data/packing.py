"""Sequence packing (THD): variable-length samples concatenated into one token stream.

Invariants (each one tested):
- `cu_seqlens` holds the offset of every sample; attention never crosses one.
- positions restart at 0 in every sample (RoPE sees each sample as if alone); when a sample carries M-RoPE
  positions (data/mrope.py) the batch's are [T, 3], one row per token, so every per-token move keeps them.
- labels are shifted inside each sample; a sample's last token and all padding predict nothing (-100).
- each sample is padded to a multiple of `multiple_of` (2·cp, ·tp under sequence parallel), the padding
  belonging to that sample, so every later shard of a sample has equal length.
- with `pack_len`, final padding segments (data/spans.py `filler_lengths`) fill the pack to exactly that length.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from loom.data.batch import (IGNORE_INDEX, Batch, field_names, gather_modality_inputs, round_up, shifted_labels,
                             target_rows)
from loom.data.mrope import padded_streams
from loom.data.sample import Sample
from loom.data.spans import TokenSpans, filler_lengths


def packed_length(samples: list[Sample], multiple_of: int = 1) -> int:
    return sum(round_up(len(s), multiple_of) for s in samples)


def pack_samples(
    samples: list[Sample],
    pad_id: int,
    multiple_of: int = 1,
    pack_len: int | None = None,
    backend: str = "auto",
) -> Batch:
    if not samples and pack_len is None:
        raise ValueError("pack_samples: no samples to pack")
    ids, labels, positions, lengths = [], [], [], []
    streams = any(s.rope_positions is not None for s in samples)
    fields: dict[str, list[float]] = {name: [] for name in field_names(samples)}
    for s in samples:
        if len(s) == 0:
            raise ValueError("pack_samples: a sample has no tokens")
        n, padded = len(s), round_up(len(s), multiple_of)
        ids += s.tokens + [pad_id] * (padded - n)
        labels += shifted_labels(s) + [IGNORE_INDEX] * (padded - n)
        positions.append(padded_streams(s.rope_positions, n, padded) if streams else torch.arange(padded))
        lengths.append(padded)
        for name, values in s.token_fields.items():
            fields[name] += list(values) + [0.0] * (padded - n)
    total = len(ids)
    if pack_len is not None:
        if total > pack_len:
            raise ValueError(
                f"pack_samples: {len(samples)} samples need {total} tokens (each padded to a multiple of "
                f"{multiple_of}) but pack_len is {pack_len}"
            )
        if pack_len % multiple_of:
            raise ValueError(f"pack_samples: pack_len={pack_len} is not a multiple of {multiple_of}")
        fill = pack_len - total
        ids += [pad_id] * fill
        labels += [IGNORE_INDEX] * fill
        for values in fields.values():
            values += [0.0] * fill
        for piece in filler_lengths(fill, multiple_of):  # segments of their own: the filler attends only to itself
            positions.append(padded_streams(None, 0, piece) if streams else torch.arange(piece))
            lengths.append(piece)
    counted = torch.zeros(len(ids), dtype=torch.bool)  # each sample's own tokens: not its padding, not filler
    start = 0
    for s, n in zip(samples, lengths):
        counted[start : start + len(s)] = True
        start += n
    label_tensor = torch.tensor(labels, dtype=torch.long)
    return Batch(
        torch.tensor(ids, dtype=torch.long),
        label_tensor,
        torch.cat(positions) if positions else torch.zeros((0, 3) if streams else 0, dtype=torch.long),
        replace(TokenSpans.from_lengths(lengths, backend=backend), counted=counted),
        gather_modality_inputs(samples),
        fields={name: torch.tensor(values, dtype=torch.float32) for name, values in fields.items()},
        targets=target_rows(label_tensor),
    )
