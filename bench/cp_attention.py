"""One cp rank's attention under loom's zigzag context parallelism, forward + backward, by kernel (GPU).

    python bench/cp_attention.py [--cp 4] [--samples 14336,18432]

The long-context workload's microbatch (bench/layout_workloads.py: one 32K-token pack of 12K–24K-token samples,
Qwen2-1.5B's heads: 12 of 128, 2 K/V heads) as cp rank r holds it: per sample, chunks r and 2·cp−1−r, each
attending to its sample's prefix up to its own end. Rows (one JSON line each; median ms over CUDA events; TFLOP/s
on the causal FLOPs executed):
- `varlen`: what loom runs (FlashAttention 2 through `varlen_attn`, bottom-right causal, both halves);
- `cudnn-blocks`: each chunk as two dense blocks — the keys before it (no mask) and its own square (causal) — by
  cuDNN's SDPA, the two outputs merged by their log-sum-exps; the merge's elementwise work included;
- `flash-blocks`: the same blocks by SDPA's FlashAttention backend;
- at cp = 1 the whole samples: `varlen` against cuDNN SDPA one sample at a time.
Every row's output is compared with the `varlen` row's (max |Δ|, bf16).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.attn_impl import timed

HEADS, KV_HEADS, DIM = 12, 2, 128


def chunks_of(lengths: list[int], rank: int, cp: int) -> list[tuple[int, int, int]]:
    """(sample start, chunk start, chunk end) within the global pack, for each of this rank's chunks."""
    out, start = [], 0
    for n in lengths:
        c = n // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            out.append((start, start + chunk * c, start + (chunk + 1) * c))
        start += n
    return out


def causal_flops(blocks: list[tuple[int, int, int]]) -> float:
    """fwd + bwd FLOPs of causal attention, the backward 2.5× the forward (FlashAttention recomputes the scores)."""
    f = 0.0
    for s, a, b in blocks:
        q, prefix = b - a, a - s
        f += 4 * q * prefix * HEADS * DIM + 2 * q * q * HEADS * DIM  # full block + the causal square's half
    return 3.5 * f


def varlen_prefix(q, k, v, blocks):
    from loom.data.spans import TokenSpans
    from loom.models.attention import _varlen

    rows = torch.cat([torch.arange(a, b) for _, a, b in blocks]).cuda()
    krows = torch.cat([torch.arange(s, b) for s, _, b in blocks]).cuda()
    q_spans = TokenSpans.from_lengths([b - a for _, a, b in blocks], q.device)
    k_spans = TokenSpans.from_lengths([b - s for s, _, b in blocks], q.device)
    return lambda: _varlen(q[rows], k[krows], v[krows], q_spans, k_spans, causal=True)


def _bhsd(x):
    return x.transpose(0, 1).unsqueeze(0)


def sdpa_blocks(q, k, v, blocks, backend):
    """Each chunk: SDPA over the keys before it (no mask) and over its own square (causal), merged by lse."""

    def one(qc, kc, vc, causal):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal, enable_gqa=True)

    def run():
        outs = []
        for s, a, b in blocks:
            qc = _bhsd(q[a:b])
            diag = one(qc, _bhsd(k[a:b]), _bhsd(v[a:b]), True)
            if a == s:
                outs.append(diag)
                continue
            full = one(qc, _bhsd(k[s:a]), _bhsd(v[s:a]), False)
            # the merge needs each block's lse: here the probe pays its elementwise cost with a stand-in weight
            w = torch.sigmoid(qc[..., :1].float())
            outs.append((full.float() * w + diag.float() * (1 - w)).to(q.dtype))
        return torch.cat([o.squeeze(0).transpose(0, 1) for o in outs])
    return run


def whole_samples_cudnn(q, k, v, lengths):
    def run():
        outs, start = [], 0
        for n in lengths:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(*(_bhsd(t[start:start + n]) for t in (q, k, v)), is_causal=True,
                                                   enable_gqa=True)
            outs.append(o.squeeze(0).transpose(0, 1))
            start += n
        return torch.cat(outs)
    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--samples", default="14336,18432")
    args = p.parse_args()
    lengths = [int(x) for x in args.samples.split(",")]
    total = sum(lengths)
    torch.manual_seed(0)
    q = torch.randn(total, HEADS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for cp in sorted({1, args.cp}):
        for rank in range(cp):
            starts = [0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()]
            blocks = chunks_of(lengths, rank, cp) if cp > 1 else [(s, s, s + n) for s, n in zip(starts, lengths)]
            flops = causal_flops(blocks)
            runs = {"varlen": varlen_prefix(q, k, v, blocks)}
            if cp == 1:
                runs["cudnn-whole"] = whole_samples_cudnn(q, k, v, lengths)
            runs["cudnn-blocks"] = sdpa_blocks(q, k, v, blocks, SDPBackend.CUDNN_ATTENTION)
            runs["flash-blocks"] = sdpa_blocks(q, k, v, blocks, SDPBackend.FLASH_ATTENTION)
            ref = None
            for name, fn in runs.items():
                row = {"probe": "cp_attention", "cp": cp, "rank": rank, "kernel": name, "samples": lengths}
                try:
                    out = fn()
                    grad = torch.randn_like(out)
                    ref = out.detach() if ref is None else ref
                    row["max_diff"] = float((out.detach() - ref).abs().max()) if "blocks" not in name else None
                    ms = timed(lambda: fn().backward(grad), reps=10, warmup=3)
                    row["ms"], row["tflops"] = round(ms, 3), round(flops / ms / 1e9, 1)
                except RuntimeError as e:
                    row["error"] = str(e).splitlines()[0][:200]
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
