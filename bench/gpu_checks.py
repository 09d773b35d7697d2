"""GPU-only numerical checks of the varlen attention paths against the SDPA path (the one CPU tests cover).

    python bench/gpu_checks.py

Prints ‖out − ref‖ / ‖ref‖ for packed causal attention and for the bottom-right-aligned prefix attention
used by context parallelism, bf16 varlen vs fp32 SDPA on the same inputs. bf16 lands near 1e-2 at most;
a wrong mask alignment gives O(1).
"""

from __future__ import annotations

import torch

from loom.models.attention import TokenLayout, attend, attend_prefix


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    lengths, heads, kv_heads, dim = [512, 64, 2048, 8, 1024], 8, 2, 64
    total = sum(lengths)
    q = torch.randn(total, heads, dim, device=dev)
    k = torch.randn(total, kv_heads, dim, device=dev)
    v = torch.randn(total, kv_heads, dim, device=dev)
    lay = TokenLayout.from_lengths(lengths, dev)
    ref = attend(q, k, v, TokenLayout.from_lengths(lengths, dev, backend="sdpa"), causal=True)
    fast = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), lay, causal=True)
    print(f"packed causal, varlen bf16 vs sdpa fp32: rel err {rel(fast, ref):.2e}")
    # prefix attention: each sample's last quarter of queries against its whole prefix
    q_lens = [n // 4 for n in lengths]
    q_rows = torch.cat([torch.arange(s + n - m, s + n) for s, n, m in
                        zip(torch.tensor([0] + lengths).cumsum(0).tolist(), lengths, q_lens)]).to(dev)
    ql, kl = TokenLayout.from_lengths(q_lens, dev), TokenLayout.from_lengths(lengths, dev)
    ref_p = attend_prefix(q[q_rows], k, v, ql, kl, backend="sdpa")
    fast_p = attend_prefix(q[q_rows].bfloat16(), k.bfloat16(), v.bfloat16(), ql, kl, backend="auto")
    print(f"prefix causal (bottom-right), varlen bf16 vs sdpa fp32: rel err {rel(fast_p, ref_p):.2e}")
    print(f"prefix rows vs full packed rows (sdpa, same queries): rel err {rel(ref_p, ref[q_rows]):.2e}")


if __name__ == "__main__":
    main()
