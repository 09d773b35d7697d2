"""Issue 33's untried attention route and the LM head's rows, at the 2B workload's real shapes (GPU).

    python bench/flex_probe.py [--seq 8192 16384] [--step 5]

Rows (one JSON line each; median ms of forward + backward over CUDA events, bench/attn_impl.py `timed`):
- packed attention over one step's items — the ViT's images (16 heads of 72, bidirectional) and the LLM's
  samples plus the filler's segments (12 query / 2 KV heads of 128, causal) — through FlashAttention 2 varlen
  (loom's CUDA path) and through compiled FlexAttention with a document block mask; the output's max |Δ|
  from FA2's;
- the LM head and loss (Qwen2.5-1.5B: 1,536 → 151,936, compiled token loss) over all T rows, and over the
  supervised rows alone (the step's text), gathered first: what computing logits only where a label reads them
  would save.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F

from bench.attn_impl import timed
from bench.workload import PackedSteps, Shape
from loom.data.batch import IGNORE_INDEX
from loom.data.spans import TokenSpans, filler_lengths
from loom.models.attention import _varlen
from loom.train.loss import token_loss_sum


def step_lengths(seq: int, step: int) -> tuple[list[int], list[int], int]:
    """(image patches per image, LLM sample lengths with the filler's segments, supervised tokens) of one step."""
    shape = Shape()
    samples = PackedSteps(shape, 1, 3 * seq // 4096, seq).global_batch(step)
    images = [(im.shape[1] // shape.patch) * (im.shape[2] // shape.patch) for s in samples for im in s.images]
    llm = [len(s.tokens) for s in samples]
    fill = seq - sum(llm)
    return images, llm + (filler_lengths(fill) if fill else []), sum(sum(s.supervised) for s in samples)


def attention_rows(what: str, lengths: list[int], heads: int, kv_heads: int, dim: int, causal: bool) -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = sum(lengths)
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device="cuda")
    spans = TokenSpans(cu_seqlens=cu, max_seqlen=max(lengths))
    ref = _varlen(q, k, v, spans, spans, causal).detach()
    flops = (2 if causal else 4) * 3 * heads * dim * sum(n * n for n in lengths)
    fa2 = timed(lambda: _varlen(q, k, v, spans, spans, causal).backward(grad))
    print(json.dumps({"probe": what, "kernel": "fa2_varlen", "items": len(lengths), "rows": total,
                      "ms": round(fa2, 3), "tflops": round(flops / fa2 / 1e9, 1)}), flush=True)

    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))

    def same_item(b, h, qi, ki):
        return doc[qi] == doc[ki]

    def causal_item(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)

    flex = torch.compile(flex_attention, dynamic=False)
    for block in (128, 64):
        row = {"probe": what, "kernel": f"flex_block{block}", "items": len(lengths), "rows": total}
        try:
            mask = create_block_mask(causal_item if causal else same_item, None, None, total, total,
                                     device="cuda", BLOCK_SIZE=block)
            qt, kt, vt, gt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, grad))

            def run(mask=mask):
                return flex(qt, kt, vt, block_mask=mask, enable_gqa=kv_heads != heads)
            out = run().detach().squeeze(0).transpose(0, 1)
            row["max_diff"] = float((out - ref).abs().max())
            ms = timed(lambda: run().backward(gt))
            row.update(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), vs_fa2=round(fa2 / ms, 3))
        except Exception as e:  # noqa: BLE001 — a probe reports what failed and goes on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps(row), flush=True)


def head_rows(seq: int, supervised: int) -> None:
    hidden, vocab = 1536, 151936
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(vocab, (seq,), device="cuda")
    labels[supervised:] = IGNORE_INDEX
    loss = torch.compile(token_loss_sum)
    for rows in (seq, supervised):
        def run(rows=rows):
            loss(F.linear(h[:rows], weight), labels[:rows]).backward()
        ms = timed(run)
        print(json.dumps({"probe": "lm_head+loss", "T": seq, "rows": rows, "ms": round(ms, 3)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--step", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    for seq in args.seq:
        images, llm, supervised = step_lengths(seq, args.step)
        print(json.dumps({"T": seq, "images": images, "llm": llm, "supervised": supervised}), flush=True)
        attention_rows(f"vit@{seq}", images, 16, 16, 72, causal=False)
        attention_rows(f"llm@{seq}", llm, 12, 2, 128, causal=True)
        head_rows(seq, supervised)


if __name__ == "__main__":
    main()
