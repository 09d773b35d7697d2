"""How the tokens of a batch are arranged into samples: packed (THD, `cu_seqlens`) or padded (BSHD, a pad mask).

Data builds it from host lengths; attention reads it. It lives in data/ so that data never imports a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Filler rows (what rounds a packed stream up to its fixed size) are cut into up to this many segments: a
# segment attends to itself, so one filler of F rows costs attention F² (F²/2 causal) for rows nobody reads,
# as much as the real work again at the 2B benchmark's fill. Pieces cut it to ~F²/8 (the step: 1–1.5% at 16K
# tokens, bench/RESULTS.md); each adds only an empty block per head to the attention kernels' grid.
FILLER_PIECES = 8
# an encoder's packed stream is rounded up to this many rows with filler rows (segments attending only to
# themselves, dropped after the layers): the layers then see few distinct sizes, which keeps torch.compile's
# variants few (here, not in models/encoder_layer.py: topology/checks.py checks sequence parallel against it)
ROW_MULTIPLE = 64
# from this many tokens a sample's causal attention runs best in a call of its own through cuDNN's dense kernel:
# 1.52× FlashAttention 2 varlen at 8,192 tokens, 1.69× at 16,384, even at 4,096 (one H200, Qwen2-1.5B's heads,
# bench/cp_attention.py --crossover; bench/RESULTS.md 2026-11-29)
LONG_SAMPLE = 8192


def filler_lengths(fill: int, multiple: int = 1) -> list[int]:
    """`fill` filler rows as up to FILLER_PIECES near-equal segments, each a whole number of `multiple`s (a
    sample's multiple: context parallel shards every segment alike). `fill` is a multiple of `multiple`."""
    units = fill // multiple
    pieces = min(FILLER_PIECES, units)
    return [(units // pieces + (i < units % pieces)) * multiple for i in range(pieces)]


@dataclass(frozen=True)
class TokenSpans:
    """How the tokens of one batch are arranged; built once per batch, shared by every layer."""

    cu_seqlens: torch.Tensor | None = None  # packed: int32 [n_samples + 1]
    max_seqlen: int = 0
    pad_mask: torch.Tensor | None = None  # padded: bool [batch, seq], True at real tokens
    backend: str = "auto"
    # set under context parallelism: an object whose .attend(q, k, v, causal, backend) sees the other cp
    # ranks' keys (loom.parallel.context.ContextShard); the model code never looks inside
    context: object | None = None
    # cu_seqlens as host ints when built from host lengths: per-sample loops read these, never the device copy
    bounds: tuple[int, ...] | None = None
    # bool per token, True at a sample's own tokens (not its padding, not filler): what statistics such as the
    # experts' load count, so they do not change with the layout's padding; None: every token counts
    counted: torch.Tensor | None = None
    # every sample this many tokens long (empty padding segments aside), 0 otherwise: SDPA then attends over the
    # samples as rows of one batch, in one call (models/attention.py); a host int, so compiled code may branch on it
    equal_length: int = 0
    # some sample is LONG_SAMPLE tokens or longer (a host bool, so compiled code may branch on it: two variants)
    long_samples: bool = False

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @staticmethod
    def from_cu_seqlens(cu_seqlens: torch.Tensor, backend: str = "auto") -> TokenSpans:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        max_len = int(lengths.max()) if lengths.numel() else 0
        return TokenSpans(cu_seqlens=cu_seqlens.to(torch.int32), max_seqlen=max_len, backend=backend,
                          long_samples=max_len >= LONG_SAMPLE)

    @staticmethod
    def from_lengths(lengths: list[int], device: torch.device | str = "cpu", backend: str = "auto",
                     segments: int = 0, max_seqlen: int = 0) -> TokenSpans:
        """From host-side lengths: nothing is read back from the device (no stream sync mid-forward).
        Fixed shapes for compiled blocks: `segments` pads cu_seqlens with empty trailing segments to that many,
        `max_seqlen` replaces the longest length by an upper bound (both valid for every backend)."""
        if segments and segments < len(lengths):
            raise ValueError(f"TokenSpans: {len(lengths)} segments do not fit a budget of {segments}")
        if max_seqlen and max_seqlen < max(lengths, default=0):
            raise ValueError(f"TokenSpans: a segment of {max(lengths)} exceeds max_seqlen = {max_seqlen}")
        cu = torch.zeros(max(len(lengths), segments) + 1, dtype=torch.int32)
        cu[1 : len(lengths) + 1] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        cu[len(lengths) + 1 :] = sum(lengths)  # empty segments: attend to nothing, cost one idle block each
        bounds = tuple(cu.tolist())  # still the host tensor: no sync
        # from page-locked memory, non_blocking: CUDA may make an asynchronous copy from pageable memory wait for
        # the stream (an encoder's spans are built mid-step; the host would then idle the device while it catches up)
        if torch.device(device).type == "cuda":
            cu = cu.pin_memory()
        cu = cu.to(device, non_blocking=True)
        real = {n for n in lengths if n}
        return TokenSpans(cu_seqlens=cu, max_seqlen=max_seqlen or max(lengths, default=0), backend=backend,
                          bounds=bounds, equal_length=real.pop() if len(real) == 1 else 0,
                          long_samples=max(lengths, default=0) >= LONG_SAMPLE)

    @staticmethod
    def from_pad_mask(pad_mask: torch.Tensor, backend: str = "auto") -> TokenSpans:
        return TokenSpans(pad_mask=pad_mask.bool(), max_seqlen=pad_mask.shape[1], backend=backend)

