"""cuDNN's ragged (THD) attention against FlashAttention 2 varlen at the 2B workload's shapes (GPU; issue 33,
round 7).

    python bench/cudnn_varlen.py

torch's `varlen_attn` runs FlashAttention 2 only (its cuDNN branch is switched off); cuDNN's SDPA takes packed
[tokens, heads, dim] rows with `cum_seq_q/k` through `aten._cudnn_attention_forward/_backward`. Per case (the
2B workload's packed items at T = 8,192 and 16,384, loom's fixed segment counts and max_seqlen = the budget):
- forward + backward of each backend, captured in one CUDA graph and replayed (median ms over CUDA events), as
  the compiled step replays it;
- cuDNN's output and q/k/v gradients against FlashAttention 2's and against an fp64 per-item reference
  (‖Δ‖ / ‖ref‖), with contiguous q/k/v (and strided slices of one projection, on request).
One JSON line per row. On torch 2.11 + cuDNN 9.19 (bench/RESULTS.md, round 7) the forward was right and the
backward wrong (dq, dk), and strided q/k/v faulted (`PROBE_STRIDED=1` runs that case, last).
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F

from bench.workload import PackedSteps, Shape


def lengths_of(seq: int, per: int, step: int = 4) -> dict[str, list[int]]:
    batch = PackedSteps(Shape(), 1, per, seq).global_batch(step)
    return {"llm": [len(s) for s in batch],
            "vit": [(i.shape[-2] // 14) * (i.shape[-1] // 14) for s in batch for i in s.images],
            "audio": [(c.shape[-1] + 1) // 2 for s in batch for c in s.audio]}


def packed(lengths: list[int], total: int, segments: int) -> tuple[list[int], torch.Tensor]:
    """loom's spans: the items, the filler up to `total` rows, empty segments up to `segments`."""
    fill = total - sum(lengths)
    items = lengths + ([fill] if fill else [])
    cu = [0]
    for n in items:
        cu.append(cu[-1] + n)
    cu += [cu[-1]] * (segments + 1 - len(cu))
    return items, torch.tensor(cu, dtype=torch.int32, device="cuda")


def flash(q, k, v, cu, max_q, causal):
    from loom.models.attention import _varlen
    from loom.data.spans import TokenSpans
    spans = TokenSpans(cu_seqlens=cu, max_seqlen=max_q)
    return _varlen(q, k, v, spans, spans, causal)


class CudnnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_q, causal):
        r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_q, max_q, True, 0.0, causal, False)
        out, lse, seed, offset = r[0], r[1], r[6], r[7]
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu)
        ctx.max_q, ctx.causal = max_q, causal
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, seed, offset, cu = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            g.contiguous(), q, k, v, out, lse, seed, offset, BIAS[0], cu, cu, ctx.max_q, ctx.max_q, 0.0, ctx.causal)
        return dq, dk, dv, None, None, None


BIAS = [None]


def cudnn(q, k, v, cu, max_q, causal):
    return CudnnVarlen.apply(q, k, v, cu, max_q, causal)


def reference(q, k, v, items, causal):
    outs, start = [], 0
    for n in items:
        qs, ks, vs = (t[start:start + n].double().transpose(0, 1) for t in (q, k, v))
        if ks.shape[0] != qs.shape[0]:
            ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], 0) for t in (ks, vs))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
        start += n
    return torch.cat(outs)


def graphed_ms(fn, reps: int = 20) -> float:
    """fn() queues forward + backward; captured once in a CUDA graph, replayed reps times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def case(name, heads, kv_heads, dim, causal, lengths, total, segments, max_q) -> None:
    torch.manual_seed(0)
    items, cu = packed(lengths, total, segments)
    base = {"case": name, "heads": heads, "kv_heads": kv_heads, "dim": dim, "causal": causal, "rows": total,
            "segments": segments, "max_q": max_q, "items": len(items)}
    width = (heads + 2 * kv_heads) * dim
    qkv = (torch.randn(total, width, device="cuda") * 1.0).to(torch.bfloat16)
    # strided: q / k / v as slices of one projection's output (what loom's fused q/k/v matmul hands attention)
    sq, sk, sv = (t.unflatten(-1, (-1, dim)) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    grad = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    ref = None
    results = {}
    variants = [("flash", flash, False), ("cudnn", cudnn, True)]
    if kv_heads != heads:
        variants.append(("cudnn_expanded", cudnn, "expand"))
    if os.environ.get("PROBE_STRIDED"):  # last: on torch 2.11 it faulted (illegal memory access), ending the run
        variants.append(("cudnn_strided", cudnn, False))
    for label, fn, contiguous in variants:
        row = dict(base, backend=label)
        try:
            q, k, v = sq, sk, sv
            if contiguous == "expand":
                r = heads // kv_heads
                q, k, v = q.contiguous(), k.repeat_interleave(r, 1).contiguous(), v.repeat_interleave(r, 1).contiguous()
            elif contiguous:
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = fn(q, k, v, cu, max_q, causal)
            out.backward(grad)
            got = [out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
            if contiguous == "expand":
                r = heads // kv_heads
                got[2], got[3] = (t.unflatten(1, (kv_heads, r)).sum(2) for t in got[2:])
            if ref is None:
                qd, kd, vd = (t.detach().double().requires_grad_() for t in (sq, sk, sv))
                o = reference(qd, kd, vd, items, causal)
                o.backward(grad.double())
                ref = [o.detach(), qd.grad, kd.grad, vd.grad]
            results[label] = got
            row["rel_err_vs_fp64"] = [round(rel(a, b), 5) for a, b in zip(got, ref)]
            if label != "flash" and "flash" in results:
                row["rel_err_vs_flash"] = [round(rel(a, b), 5) for a, b in zip(got, results["flash"])]
            row["nan"] = any(bool(t.isnan().any()) for t in got)
            if label == "cudnn":
                r = torch.ops.aten._cudnn_attention_forward(
                    q.detach(), k.detach(), v.detach(), None, cu, cu, max_q, max_q, True, 0.0, causal, False)
                row["outputs"] = [str((tuple(t.shape), tuple(t.stride()), t.dtype)) if torch.is_tensor(t) else str(t)
                                  for t in r]
                # dropout 0: do the philox tensors matter to the backward? (dummies instead of the forward's)
                dummy = torch.zeros((), dtype=torch.int64, device="cuda")
                dq2 = torch.ops.aten._cudnn_attention_backward(
                    grad, q.detach(), k.detach(), v.detach(), r[0], r[1], dummy, dummy, BIAS[0], cu, cu, max_q,
                    max_q, 0.0, causal)[0]
                row["dummy_rng_dq_rel"] = round(rel(dq2, got[1]), 6)

            def step(q=q, k=k, v=v):  # gradients returned, not accumulated: no AccumulateGrad under capture
                torch.autograd.grad(fn(q, k, v, cu, max_q, causal), (q, k, v), grad)
            row["ms"] = round(graphed_ms(step), 4)

            def fwd(q=q, k=k, v=v):
                with torch.no_grad():
                    fn(q, k, v, cu, max_q, causal)
            row["fwd_ms"] = round(graphed_ms(fwd), 4)
            flops = sum(4 * n * n * dim * heads for n in items) / (2 if causal else 1)
            row["fwd_tflops"] = round(flops / row["fwd_ms"] / 1e9, 1)
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)


def main() -> None:
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "fwd_schema": str(torch.ops.aten._cudnn_attention_forward.default._schema),
                      "bwd_schema": str(torch.ops.aten._cudnn_attention_backward.default._schema)}), flush=True)
    # attn_bias: the backward's schema takes a Tensor; None first, else an empty one
    for bias in (None, torch.empty(0, device="cuda")):
        BIAS[0] = bias
        try:
            q = torch.randn(64, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            cu = torch.tensor([0, 40, 64, 64], dtype=torch.int32, device="cuda")
            cudnn(q, q, q, cu, 64, False).sum().backward()
            print(json.dumps({"bias_arg": "None" if bias is None else "empty", "ok": True}), flush=True)
            break
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"bias_arg": "None" if bias is None else "empty", "error": str(e)[:300]}), flush=True)
    for seq, per in ((8192, 6), (16384, 12)):
        lens = lengths_of(seq, per)
        vit_rows = -(-sum(lens["vit"]) // (seq // 4)) * (seq // 4)
        aud_rows = -(-max(sum(lens["audio"]), 1) // (seq // 4)) * (seq // 4)
        case(f"vit{seq}", 16, 16, 72, False, lens["vit"], vit_rows, per + 1, seq)
        case(f"llm2b{seq}", 12, 2, 128, True, lens["llm"], seq, per + 1, seq)
        case(f"audio{seq}", 6, 6, 64, False, lens["audio"] or [1], aud_rows, per + 1, seq)
    # the LLM-alone shape (Qwen3-1.7B, one 8,192-token document) as a check against SDPA's dense cuDNN kernel
    case("qwen3_8192", 16, 8, 128, True, [8192], 8192, 2, 8192)
    print(json.dumps({"sdpa_dense_note": "dense cuDNN SDPA for qwen3_8192 below"}), flush=True)
    q = torch.randn(1, 16, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(q)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def dense():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True).backward(g)
    print(json.dumps({"case": "qwen3_8192", "backend": "sdpa_cudnn_dense", "ms": round(graphed_ms(dense), 4),
                      "scale_note": math.sqrt(128)}), flush=True)


if __name__ == "__main__":
    main()
