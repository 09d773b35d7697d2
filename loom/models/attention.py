"""Attention backends behind one interface: padded (BSHD) and packed (THD) token layouts.

Every module calls `attend(q, k, v, layout, causal)`. The layout says how tokens are arranged:
- padded: q/k/v are [batch, seq, heads, dim] and `pad_mask` [batch, seq] marks real tokens;
- packed: q/k/v are [tokens, heads, dim] and `cu_seqlens` [n+1] holds the sample offsets; attention
  never crosses a sample boundary.
Keys/values may have fewer heads than queries (grouped-query attention).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TokenLayout:
    """How the tokens of one batch are arranged; built once per batch, shared by every layer."""

    cu_seqlens: torch.Tensor | None = None  # packed: int32 [n_samples + 1]
    max_seqlen: int = 0
    pad_mask: torch.Tensor | None = None  # padded: bool [batch, seq], True at real tokens
    backend: str = "auto"
    # set under context parallelism: an object whose .attend(q, k, v, causal, backend) sees the other cp
    # ranks' keys (loom.parallel.context.ContextShard); the model code never looks inside
    context: object | None = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @staticmethod
    def from_cu_seqlens(cu_seqlens: torch.Tensor, backend: str = "auto") -> TokenLayout:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        max_len = int(lengths.max()) if lengths.numel() else 0
        return TokenLayout(cu_seqlens=cu_seqlens.to(torch.int32), max_seqlen=max_len, backend=backend)

    @staticmethod
    def from_lengths(lengths: list[int], device: torch.device | str = "cpu", backend: str = "auto",
                     segments: int = 0, max_seqlen: int = 0) -> TokenLayout:
        """From host-side lengths: nothing is read back from the device (no stream sync mid-forward).
        Fixed shapes for compiled blocks: `segments` pads cu_seqlens with empty trailing segments to that many,
        `max_seqlen` replaces the longest length by an upper bound (both valid for every backend)."""
        if segments and segments < len(lengths):
            raise ValueError(f"TokenLayout: {len(lengths)} segments do not fit a budget of {segments}")
        if max_seqlen and max_seqlen < max(lengths, default=0):
            raise ValueError(f"TokenLayout: a segment of {max(lengths)} exceeds max_seqlen = {max_seqlen}")
        cu = torch.zeros(max(len(lengths), segments) + 1, dtype=torch.int32)
        cu[1 : len(lengths) + 1] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        cu[len(lengths) + 1 :] = sum(lengths)  # empty segments: attend to nothing, cost one idle block each
        # non_blocking: a plain host-to-device copy would also wait for the stream to drain
        cu = cu.to(device, non_blocking=True)
        return TokenLayout(cu_seqlens=cu, max_seqlen=max_seqlen or max(lengths, default=0), backend=backend)

    @staticmethod
    def from_pad_mask(pad_mask: torch.Tensor, backend: str = "auto") -> TokenLayout:
        return TokenLayout(pad_mask=pad_mask.bool(), max_seqlen=pad_mask.shape[1], backend=backend)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout, causal: bool) -> torch.Tensor:
    """Scaled dot-product attention; returns a tensor shaped like `q`."""
    if layout.context is not None:
        return layout.context.attend(q, k, v, causal, layout.backend)
    if layout.packed:
        if _use_varlen(layout.backend, q):
            return _varlen(q, k, v, layout, layout, causal)
        return _packed_sdpa(q, k, v, layout, causal)
    return _padded_sdpa(q, k, v, layout, causal)


def attend_prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_layout: TokenLayout, k_layout: TokenLayout, backend: str
) -> torch.Tensor:
    """Packed causal attention where each sample's queries are the *last* tokens of its keys (a query
    block ending where its key prefix ends): the mask is causal aligned to the bottom-right corner."""
    if _use_varlen(backend, q):
        return _varlen(q, k, v, q_layout, k_layout, causal=True)
    return _prefix_sdpa(q, k, v, q_layout, k_layout)


@torch.compiler.disable  # a Python loop over samples read from the data: nothing to compile
def _prefix_sdpa(q, k, v, q_layout: TokenLayout, k_layout: TokenLayout) -> torch.Tensor:
    outs = []
    qb, kb = q_layout.cu_seqlens.tolist(), k_layout.cu_seqlens.tolist()
    for qs, qe, ks, ke in zip(qb[:-1], qb[1:], kb[:-1], kb[1:]):
        if qe == qs:
            continue
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril(diagonal=(ke - ks) - (qe - qs))
        qs_, ks_, vs_ = (t[a:b].transpose(0, 1).unsqueeze(0) for t, a, b in ((q, qs, qe), (k, ks, ke), (v, ks, ke)))
        outs.append(_sdpa(qs_, ks_, vs_, mask).squeeze(0).transpose(0, 1))
    return torch.cat(outs) if outs else q[:0]


def _use_varlen(backend: str, q: torch.Tensor) -> bool:
    if backend == "sdpa":
        return False
    usable = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _VARLEN is not None
    if backend == "varlen" and not usable:
        raise RuntimeError(
            f"attention backend 'varlen' needs a CUDA device, bf16/fp16 inputs and "
            f"torch.nn.attention.varlen (got device={q.device}, dtype={q.dtype}); use backend='sdpa' or 'auto'"
        )
    return usable


try:
    from torch.nn.attention.varlen import varlen_attn as _VARLEN
except ImportError:
    _VARLEN = None
# read once, not per call: the keyword set differs between releases, and torch.compile traces calls only
_VARLEN_PARAMS = frozenset(inspect.signature(_VARLEN).parameters) if _VARLEN is not None else frozenset()


def _varlen(q, k, v, q_layout: TokenLayout, k_layout: TokenLayout, causal: bool) -> torch.Tensor:
    """FlashAttention varlen; with fewer queries than keys its causal mask is bottom-right aligned."""
    fn, params = _VARLEN, _VARLEN_PARAMS
    kwargs = {}
    # torch 2.11 takes is_causal; later releases express causality as window_size=(-1, 0)
    if "is_causal" in params:
        kwargs["is_causal"] = causal
    elif causal:
        kwargs["window_size"] = (-1, 0)
    if k.shape[-2] != q.shape[-2]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, q.shape[-2]), _repeat_kv(v, q.shape[-2])
    return fn(q, k, v, q_layout.cu_seqlens, k_layout.cu_seqlens, q_layout.max_seqlen, k_layout.max_seqlen, **kwargs)


def _repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    return x.repeat_interleave(n_heads // x.shape[-2], dim=-2)


def _sdpa(q, k, v, mask=None, causal=False) -> torch.Tensor:
    """SDPA over [batch, heads, seq, dim]; expands grouped K/V heads first (works on every device)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)


def _padded_sdpa(q, k, v, layout: TokenLayout, causal: bool) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    mask = None
    if layout.pad_mask is not None:
        seq = q.shape[2]
        mask = layout.pad_mask[:, None, None, :]  # keys that are real
        if causal:
            mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    return _sdpa(q, k, v, mask, causal).transpose(1, 2)


@torch.compiler.disable  # a Python loop over samples read from the data: nothing to compile
def _packed_sdpa(q, k, v, layout: TokenLayout, causal: bool) -> torch.Tensor:
    # One SDPA call per sample: exact, memory O(max_seqlen²) rather than O(tokens²) for a block mask.
    # FlexAttention has no CPU backward and varlen_attn is GPU-only, so this is the CPU path.
    bounds = layout.cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(_sdpa(qs, ks, vs, causal=causal).squeeze(0).transpose(0, 1))
    return torch.cat(outs) if outs else q[:0]
