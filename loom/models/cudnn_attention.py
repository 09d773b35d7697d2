"""cuDNN's packed (THD) attention: `cu_seqlens` segments over [tokens, heads, dim], as FlashAttention 2's varlen.

torch 2.11's `varlen_attn` runs FlashAttention 2 only (its cuDNN branch is switched off, and its backward call
does not match the op's schema); cuDNN's fused attention takes the same ragged rows through
`aten._cudnn_attention_forward` / `_cudnn_attention_backward` when `cum_seq_q/k` are given. On an H200 it ran
the 2B workload's packed items faster than FlashAttention 2 (bench/cudnn_varlen.py, bench/RESULTS.md round 7).

One custom op pair, so torch.compile treats each as one opaque call (as torch's own varlen op) and CUDA graphs
capture it: q/k/v contiguous (cuDNN's ragged offsets assume packed rows), equal q/k lengths (self-attention:
causal is top-left aligned, which equals bottom-right only then), equal head counts (GQA is expanded by the
caller), head dim a multiple of 8 up to 128, bf16/fp16.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("loom::cudnn_varlen", mutates_args=())
def cudnn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                True, 0.0, causal, False)
    return r[0], r[1]


@cudnn_varlen.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, causal):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((q.shape[0], q.shape[1], 1),
                                                                                      dtype=torch.float32)


@torch.library.custom_op("loom::cudnn_varlen_backward", mutates_args=())
def cudnn_varlen_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout 0: the philox state goes unread
    dq, dk, dv = torch.ops.aten._cudnn_attention_backward(grad.contiguous(), q, k, v, out, lse, rng, rng, None,
                                                          cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, causal)
    return dq, dk, dv


@cudnn_varlen_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens, max_seqlen, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.causal = max_seqlen, causal


def _backward(ctx, grad, _grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = cudnn_varlen_backward(grad, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.causal)
    return dq, dk, dv, None, None, None


cudnn_varlen.register_autograd(_backward, setup_context=_setup)


def cudnn_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, causal: bool) -> torch.Tensor:
    """Packed self-attention over `cu_seqlens` segments: [tokens, heads, dim] in, the same shape out."""
    if k.shape[-2] != q.shape[-2]:
        k, v = (t.repeat_interleave(q.shape[-2] // t.shape[-2], dim=-2) for t in (k, v))
    q, k, v = (t.contiguous() for t in (q, k, v))
    return cudnn_varlen(q, k, v, cu_seqlens, max_seqlen, causal)[0]


def cudnn_varlen_usable(q: torch.Tensor) -> bool:
    """Shapes and devices cuDNN's packed kernel takes (Hopper or later, where it was measured)."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 128
            and torch.cuda.get_device_capability(q.device)[0] >= 9)
