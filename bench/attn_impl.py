"""Attention kernels on the GPU, forward + backward, at the benchmarks' shapes: which flash implementation to use.

    python bench/attn_impl.py [--fa4]

Rows: SDPA per sample through cuDNN and through flash (FlashAttention 2, torch's own), and `varlen_attn`
(FlashAttention 2 varlen), each on the LLM-alone shape (Qwen3-1.7B: one 8,192-token document, 16 query heads,
8 KV heads, head_dim 128) and on the 2B workload's LLM (Qwen2.5-1.5B: 12 / 2 heads, 8,192 tokens in documents of
64–1,024 tokens). With `--fa4`, torch's `activate_flash_attention_impl("FA4")` (flash-attn-4, CuTe DSL) is
switched on after the first rows and the flash and varlen rows run again: FA4 replaces what aten's flash
ops dispatch to. Each row: median ms of fwd+bwd (CUDA events, 20 repeats after 5), the max |difference| of the
output from cuDNN's (flash rows) or FA2 varlen's (varlen rows). One JSON line per row.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.flash_impl import activate


def timed(fn, reps: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def sdpa_rows(q, k, v, bounds, backend):
    """One SDPA call per document ([1, heads, len, dim]), as loom's `_packed_sdpa`: fwd + bwd."""
    def run():
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            with sdpa_kernel(backend):
                outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                            .squeeze(0).transpose(0, 1))
        out = torch.cat(outs)
        out.backward(grad)
        return out
    grad = torch.randn_like(q)
    return run


def varlen_rows(q, k, v, bounds):
    import inspect

    from torch.nn.attention.varlen import varlen_attn
    # torch 2.11 expresses causality as window_size=(-1, 0), later releases also as is_causal (as loom's `_varlen`)
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    grad = torch.randn_like(q)
    kv_heads = k.shape[1]
    rep = q.shape[1] // kv_heads

    def run():
        # torch 2.11's varlen_attn takes equal heads: K/V repeated, as loom's `_repeat_kv`
        kk, vv = (t.repeat_interleave(rep, dim=1) for t in (k, v))
        out = varlen_attn(q, kk, vv, cu, cu, longest, longest, **causal)
        out.backward(grad)
        return out
    return run


def shapes(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    docs, total = [], 0
    while total < 8192:  # the 2B workload's text: 64–1,024-token documents filling 8,192 tokens
        n = min(int(torch.randint(64, 1025, (1,), generator=g)), 8192 - total)
        docs.append(n)
        total += n
    return {"llm-alone 1x8192 16/8 heads": ([0, 8192], 16, 8),
            "mm-llm 8192 in %d docs 12/2 heads" % len(docs): ([0] + torch.tensor(docs).cumsum(0).tolist(), 12, 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fa4", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    impls = ["default"] + (["FA4"] if args.fa4 else [])
    refs = {}
    for impl in impls:
        if impl != "default":
            try:
                activate(impl)
            except Exception as e:  # noqa: BLE001 — report why, the default rows stand
                print(json.dumps({"bench": "attn", "impl": impl, "error": f"{type(e).__name__}: {e}"[:600]}))
                break
        for name, (bounds, hq, hk) in shapes().items():
            q = torch.randn(bounds[-1], hq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(bounds[-1], hk, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(bounds[-1], hk, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            rows = {"sdpa-flash": sdpa_rows(q, k, v, bounds, SDPBackend.FLASH_ATTENTION),
                    "varlen": varlen_rows(q, k, v, bounds)}
            if impl == "default":
                rows = {"sdpa-cudnn": sdpa_rows(q, k, v, bounds, SDPBackend.CUDNN_ATTENTION), **rows}
            for kind, fn in rows.items():
                try:
                    out = fn().detach()
                    ms = timed(fn)
                    ref = refs.setdefault((name, "sdpa-cudnn" if kind != "varlen" else "varlen"), out)
                    diff = float((out.float() - ref.float()).abs().max())
                    print(json.dumps({"bench": "attn", "impl": impl, "shape": name, "kernel": kind,
                                      "fwd_bwd_ms": round(ms, 3), "max_abs_diff": diff}), flush=True)
                except Exception as e:  # noqa: BLE001
                    print(json.dumps({"bench": "attn", "impl": impl, "shape": name, "kernel": kind,
                                      "error": f"{type(e).__name__}: {e}"[:600]}), flush=True)
                q.grad = k.grad = v.grad = None


if __name__ == "__main__":
    main()
