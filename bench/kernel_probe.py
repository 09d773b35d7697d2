"""Kernel-level probes behind issue 33's round-5 levers, forward + backward at the benchmarks' shapes (GPU).

    python bench/kernel_probe.py [--varlen]

Rows (one JSON line each, median ms over CUDA events):
- attention over one 8,192-token document, Qwen3-1.7B heads (16 / 8): grouped K/V heads repeated before SDPA
  (loom's `grouped_sdpa`) against SDPA's own `enable_gqa`, per backend that accepts it;
- varlen attention (FlashAttention 2) over the 2B workload's packed items, with max_seqlen at the fixed budget
  (T, what compiled code passes today) against the longest item: max_seqlen only sizes the kernel's grid;
- the attention block's projections and the MLP's: separate q / k / v (gate / up) matmuls against one
  matmul over the concatenated weight, at the LLM-alone shape and the 2B workload's LLM (Qwen2.5-1.5B).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.attn_impl import timed


def attention_rows() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 16, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, 16, 8192, 128, device="cuda", dtype=torch.bfloat16)

    def repeated():
        kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

    def native():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    ref = None
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for name, fn in (("repeat", repeated), ("enable_gqa", native)):
            row = {"probe": "attention", "backend": backend.name, "kv": name}
            try:
                with sdpa_kernel([backend]):
                    out = fn()
                    ref = out.detach() if ref is None else ref
                    row["max_diff"] = float((out.detach() - ref).abs().max())
                    row["ms"] = round(timed(lambda: fn().backward(grad)), 3)
            except RuntimeError as e:
                row["error"] = str(e).splitlines()[0][:160]
            print(json.dumps(row), flush=True)


def varlen_rows() -> None:
    from loom.data.spans import TokenSpans
    from loom.models.attention import _varlen

    # (what, heads, kv heads, head dim, causal, item lengths): six images of 224–448 px at patch 14 plus the filler
    # that rounds the rows to 2,048 (CUDA graphs); the LLM's six samples of ~1,365 tokens filling T = 8,192
    cases = [("vit", 16, 16, 72, False, [529, 1024, 256, 784, 576, 324, 603]),
             ("llm", 12, 2, 128, True, [1900, 1100, 700, 2300, 1500, 692, 0])]
    for what, hq, hkv, d, causal, lengths in cases:
        total = sum(lengths)
        q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        ref = None
        for bound in (8192, 4096, 2048, max(lengths)):
            spans = TokenSpans(cu_seqlens=cu, max_seqlen=bound)

            def run(spans=spans):
                return _varlen(q, k, v, spans, spans, causal)
            out = run().detach()
            ref = out if ref is None else ref
            print(json.dumps({"probe": "varlen", "what": what, "max_seqlen": bound, "rows": total,
                              "ms": round(timed(lambda: run().backward(grad)), 3),
                              "fwd_ms": round(timed(run), 3), "max_diff": float((out - ref).abs().max())}),
                  flush=True)


def projection_rows() -> None:
    shapes = {"qwen3-1.7b": (2048, 2048, 1024, 6144), "qwen2.5-1.5b": (1536, 1536, 256, 8960)}
    for model, (d, dq, dkv, ff) in shapes.items():
        x = torch.randn(8192, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for what, outs in (("qkv", (dq, dkv, dkv)), ("gate_up", (ff, ff))):
            ws = [torch.randn(o, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for o in outs]
            wcat = torch.cat([w.detach() for w in ws]).requires_grad_()
            g_sep = [torch.randn(8192, o, device="cuda", dtype=torch.bfloat16) for o in outs]
            g_cat = torch.cat(g_sep, dim=1)

            def separate():
                torch.autograd.backward([F.linear(x, w) for w in ws], g_sep)

            def fused():
                F.linear(x, wcat).backward(g_cat)

            print(json.dumps({"probe": "projection", "model": model, "what": what,
                              "separate_ms": round(timed(separate), 3), "fused_ms": round(timed(fused), 3)}),
                  flush=True)


if __name__ == "__main__":
    if "--varlen" in sys.argv:
        varlen_rows()
    else:
        attention_rows()
        projection_rows()
