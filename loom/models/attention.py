"""Attention backends behind one interface: padded (BSHD) and packed (THD) token arrangements.

Every module calls `attend(q, k, v, spans, causal)`. The spans say how tokens are arranged:
- padded: q/k/v are [batch, seq, heads, dim] and `pad_mask` [batch, seq] marks real tokens;
- packed: q/k/v are [tokens, heads, dim] and `cu_seqlens` [n+1] holds the sample offsets; attention
  never crosses a sample boundary.
Keys/values may have fewer heads than queries (grouped-query attention), and values another width than
queries and keys (multi-head latent attention).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from loom.data.spans import LONG_SAMPLE, TokenSpans

LONG_SAMPLE_MULTIPLE = 1024  # what a long sample's tokens are padded to for its own call (_dense_first_cudnn)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: TokenSpans, causal: bool) -> torch.Tensor:
    """Scaled dot-product attention (scale 1/√ of q's width); returns `q`'s shape with `v`'s last dim."""
    if spans.context is not None:
        return spans.context.attend(q, k, v, causal, spans.backend)
    if spans.packed:
        if _use_varlen(spans.backend, q):
            if spans.long_samples and spans.backend == "auto" and causal and v.shape[-1] == q.shape[-1]:
                return long_samples_apart(q, k, v, spans, causal)
            return _varlen(q, k, v, spans, spans, causal)
        if spans.equal_length and q.shape[0] % spans.equal_length == 0:
            return _rows_sdpa(q, k, v, spans.equal_length, causal)
        return _packed_sdpa(q, k, v, spans, causal)
    return _padded_sdpa(q, k, v, spans, causal)


def attend_latent(q: torch.Tensor, latent: torch.Tensor, expand, spans: TokenSpans, causal: bool) -> torch.Tensor:
    """Attention whose keys and values `expand(latent) -> (k, v)` makes from per-token `latent` rows (multi-head
    latent attention): under CP the latent rows are what crosses the ranks, each rank expanding what it reads."""
    if spans.context is not None:
        return spans.context.attend_latent(q, latent, expand, causal, spans.backend)
    k, v = expand(latent)
    return attend(q.to(v.dtype), k.to(v.dtype), v, spans, causal)  # varlen needs one dtype


def attend_prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_spans: TokenSpans, k_spans: TokenSpans, backend: str
) -> torch.Tensor:
    """Packed causal attention where each sample's queries are the *last* tokens of its keys (a query
    block ending where its key prefix ends): the mask is causal aligned to the bottom-right corner."""
    if _use_varlen(backend, q):
        return _varlen(q, k, v, q_spans, k_spans, causal=True)
    return _prefix_sdpa(q, k, v, q_spans, k_spans)


@torch.compiler.disable  # a Python loop over samples read from the data: nothing to compile
def _prefix_sdpa(q, k, v, q_spans: TokenSpans, k_spans: TokenSpans) -> torch.Tensor:
    outs = []
    qb, kb = host_bounds(q_spans), host_bounds(k_spans)
    for qs, qe, ks, ke in zip(qb[:-1], qb[1:], kb[:-1], kb[1:]):
        if qe == qs:
            continue
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril(diagonal=(ke - ks) - (qe - qs))
        qs_, ks_, vs_ = (t[a:b].transpose(0, 1).unsqueeze(0) for t, a, b in ((q, qs, qe), (k, ks, ke), (v, ks, ke)))
        outs.append(grouped_sdpa(qs_, ks_, vs_, mask).squeeze(0).transpose(0, 1))
    return torch.cat(outs) if outs else _no_rows(q, v)


def _no_rows(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_zeros((0, *q.shape[1:-1], v.shape[-1]))


def host_bounds(spans: TokenSpans) -> tuple[int, ...] | list[int]:
    """The sample offsets on the host: kept from the host lengths when there were any, else read back (a sync)."""
    return spans.bounds if spans.bounds is not None else spans.cu_seqlens.tolist()


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


def _varlen(q, k, v, q_spans: TokenSpans, k_spans: TokenSpans, causal: bool) -> torch.Tensor:
    """FlashAttention varlen; with fewer queries than keys its causal mask is bottom-right aligned."""
    fn, params = _VARLEN, _VARLEN_PARAMS
    if v.shape[-1] != q.shape[-1]:  # FlashAttention takes one head width: narrower values padded, cut after
        out = _varlen(q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1])), q_spans, k_spans, causal)
        return out[..., : v.shape[-1]]
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
    return fn(q, k, v, q_spans.cu_seqlens, k_spans.cu_seqlens, q_spans.max_seqlen, k_spans.max_seqlen, **kwargs)


@torch.compiler.disable  # a loop over the samples' host bounds: compiled code would guard on every length
def long_samples_apart(q, k, v, spans: TokenSpans, causal: bool, long_from: int = LONG_SAMPLE,
                       run=None, one=None) -> torch.Tensor:
    """Packed attention with each sample of `long_from` tokens or more in a dense call of its own (`one`: cuDNN
    first), every run of shorter samples between them in one varlen call (`run`); pieces in token order.
    `run(q, k, v, spans, causal)` and `one(q, k, v, causal)` are the GPU kernels unless given (tests: CPU ones)."""
    run, one = run or _varlen_run, one or _dense_first_cudnn
    bounds = host_bounds(spans)
    pieces, first = [], 0  # first: the index of the first sample of the current run of short ones

    def flush(stop: int) -> None:  # samples first..stop-1 as one packed call
        start, end = bounds[first], bounds[stop]
        if end > start:
            lengths = [b - a for a, b in zip(bounds[first:stop], bounds[first + 1 : stop + 1])]
            sub = TokenSpans(cu_seqlens=spans.cu_seqlens[first : stop + 1] - start, max_seqlen=max(lengths),
                             backend=spans.backend, bounds=tuple(b - start for b in bounds[first : stop + 1]))
            pieces.append(run(q[start:end], k[start:end], v[start:end], sub, causal))

    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end - start >= long_from:
            flush(i)
            pieces.append(one(q[start:end], k[start:end], v[start:end], causal))
            first = i + 1
    flush(len(bounds) - 1)
    return torch.cat(pieces) if pieces else _no_rows(q, v)


def _varlen_run(q, k, v, spans: TokenSpans, causal: bool) -> torch.Tensor:
    return _varlen(q, k, v, spans, spans, causal)


def _dense_first_cudnn(q, k, v, causal: bool) -> torch.Tensor:
    """One causal sample, [tokens, heads, dim]: SDPA with cuDNN's kernel first (FlashAttention 2 otherwise), its
    tokens padded at the end to a multiple of LONG_SAMPLE_MULTIPLE: cuDNN builds an execution plan per shape
    (~0.15 s of host each, against 2–6 ms a call), so sample lengths share a few shapes over a run. Exact for the
    real tokens: under a causal mask no query reads a key after it."""
    n = q.shape[0]
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, -n % LONG_SAMPLE_MULTIPLE)) for t in (q, k, v))
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(order, set_priority=True):
        out = grouped_sdpa(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), causal=causal)
    return out.squeeze(0).transpose(0, 1)[:n]


def _repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    return x.repeat_interleave(n_heads // x.shape[-2], dim=-2)


def grouped_sdpa(q, k, v, mask=None, causal=False) -> torch.Tensor:
    """SDPA over [batch, heads, seq, dim], grouped K/V heads read in place (SDPA's enable_gqa: cuDNN and flash
    take it, 0.94x the time of expanded heads on an H200); expanded first under a mask, which the kernels that
    take a mask (memory-efficient) cannot combine with groups."""
    if k.shape[1] != q.shape[1] and mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)


def _padded_sdpa(q, k, v, spans: TokenSpans, causal: bool) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    mask = None
    if spans.pad_mask is not None:
        seq = q.shape[2]
        mask = spans.pad_mask[:, None, None, :]  # keys that are real
        if causal:
            mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    return grouped_sdpa(q, k, v, mask, causal).transpose(1, 2)


def _rows_sdpa(q, k, v, length: int, causal: bool) -> torch.Tensor:
    """Packed samples all `length` tokens long (fixed-length documents): one batched SDPA over [n, length],
    traced into the compiled block — no per-sample loop, no graph break around attention."""
    q, k, v = (t.unflatten(0, (-1, length)).transpose(1, 2) for t in (q, k, v))  # [n, h, length, d]
    return grouped_sdpa(q, k, v, causal=causal).transpose(1, 2).flatten(0, 1)


@torch.compiler.disable  # a Python loop over samples read from the data: nothing to compile
def _packed_sdpa(q, k, v, spans: TokenSpans, causal: bool) -> torch.Tensor:
    # One SDPA call per sample: exact, memory O(max_seqlen²) rather than O(tokens²) for a block mask.
    # FlexAttention has no CPU backward and varlen_attn is GPU-only, so this is the CPU path.
    bounds = host_bounds(spans)
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(grouped_sdpa(qs, ks, vs, causal=causal).squeeze(0).transpose(0, 1))
    return torch.cat(outs) if outs else _no_rows(q, v)
