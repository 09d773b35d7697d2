"""Qwen2-VL's M-RoPE positions: three streams per token (time, height, width), built on the host with the tokens.

A text token's three positions are equal and count up by one. An image's placeholder run takes the merged patch
grid of that image (t × h/merge × w/merge tokens, row-major): each token's positions are the run's start plus its
(t, h, w) index in the grid, and the text after continues from the largest position so far + 1 (Qwen2-VL's
`get_rope_index`). Each sample starts at 0, like its one-stream positions; a sample's padding counts on.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from loom.data.sample import Sample

STREAMS = 3  # time, height, width


def mrope_positions(tokens: list[int], image_token_id: int, grids: list[tuple[int, int, int]], merge: int = 2
                    ) -> list[tuple[int, int, int]]:
    """The (time, height, width) position of every token; `grids`: each image's patch grid (t, h, w) before the
    merger, in placeholder order (the processor's `image_grid_thw`)."""
    out: list[tuple[int, int, int]] = []
    grids, i, next_pos = list(grids), 0, 0
    while i < len(tokens):
        if tokens[i] != image_token_id:
            out.append((next_pos, next_pos, next_pos))
            next_pos, i = next_pos + 1, i + 1
            continue
        if not grids:
            raise ValueError(f"mrope_positions: an image placeholder at token {i} without a grid left "
                             f"(more image runs than image_grid_thw rows)")
        t, h, w = grids.pop(0)
        if h % merge or w % merge:
            raise ValueError(f"mrope_positions: grid {(t, h, w)} is not whole {merge}×{merge} groups")
        h, w = h // merge, w // merge
        n = t * h * w
        if tokens[i:i + n] != [image_token_id] * n:
            raise ValueError(f"mrope_positions: the image at token {i} has grid {(t, h * merge, w * merge)}, "
                             f"so {n} placeholders, but the run there is shorter")
        out += [(next_pos + a, next_pos + b, next_pos + c) for a in range(t) for b in range(h) for c in range(w)]
        next_pos += max(t, h, w)  # the largest position of the image + 1
        i += n
    if grids:
        raise ValueError(f"mrope_positions: {len(grids)} image grids left over: fewer placeholder runs than images")
    return out


def padded_streams(positions: list[tuple[int, int, int]] | None, length: int, padded: int) -> torch.Tensor:
    """One sample's [padded, 3] positions: its own (or 0, 1, 2, … on all three streams when it has none), its
    padding counting on from the largest + 1."""
    if positions is None:
        return torch.arange(padded).unsqueeze(1).expand(padded, STREAMS).clone()
    if len(positions) != length:
        raise ValueError(f"a sample of {length} tokens carries {len(positions)} M-RoPE positions")
    own = torch.tensor(positions, dtype=torch.long).view(length, STREAMS)
    start = int(own.max()) + 1 if length else 0
    pad = torch.arange(start, start + padded - length).unsqueeze(1).expand(-1, STREAMS)
    return torch.cat([own, pad])


def with_mrope_positions(sample: Sample, image_token_id: int, patch: int, merge: int) -> Sample:
    """`sample` carrying its M-RoPE positions, each image's grid read from its (resized) shape: a still image is
    one temporal patch of (H / patch) × (W / patch)."""
    grids = [(1, item.shape[-2] // patch, item.shape[-1] // patch) for item in sample.images]
    return replace(sample, rope_positions=mrope_positions(sample.tokens, image_token_id, grids, merge))
