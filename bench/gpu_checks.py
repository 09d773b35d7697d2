"""GPU-only numerical checks of the varlen attention paths against the SDPA path (the one CPU tests cover).

    python bench/gpu_checks.py

Checks ‖out − ref‖ / ‖ref‖ for packed causal attention and for the bottom-right-aligned prefix attention
used by context parallelism, bf16 varlen vs fp32 SDPA on the same inputs, against tolerances: bf16 lands
near 1e-2 at most; a wrong mask alignment gives O(1). Prints a table; exits 1 if any check fails.
"""

from __future__ import annotations

import sys

import torch

from loom.data.spans import TokenSpans
from loom.models.attention import attend, attend_prefix

BF16_TOL = 2e-2  # bf16 (8-bit mantissa) lands near 1e-2; 2× headroom, still far below a mask error's O(1)
FP32_TOL = 1e-5  # the same fp32 SDPA math on the same rows: only summation order differs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check(name: str, err: float, tol: float) -> tuple[str, float, float, bool]:
    """(name, err, tol, passed); NaN never passes."""
    return name, err, tol, err <= tol


def report(rows: list[tuple[str, float, float, bool]]) -> bool:
    width = max(len(r[0]) for r in rows)
    print(f"{'check':<{width}}  {'rel err':>9}  {'tol':>7}  result")
    for name, err, tol, ok in rows:
        print(f"{name:<{width}}  {err:>9.2e}  {tol:>7.0e}  {'ok' if ok else 'FAIL'}")
    return all(ok for *_, ok in rows)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_checks.py needs a CUDA GPU (the varlen kernels run only there); none found")
    torch.manual_seed(0)
    dev = "cuda"
    lengths, heads, kv_heads, dim = [512, 64, 2048, 8, 1024], 8, 2, 64
    total = sum(lengths)
    q = torch.randn(total, heads, dim, device=dev)
    k = torch.randn(total, kv_heads, dim, device=dev)
    v = torch.randn(total, kv_heads, dim, device=dev)
    lay = TokenSpans.from_lengths(lengths, dev)
    ref = attend(q, k, v, TokenSpans.from_lengths(lengths, dev, backend="sdpa"), causal=True)
    fast = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), lay, causal=True)
    # prefix attention: each sample's last quarter of queries against its whole prefix
    q_lens = [n // 4 for n in lengths]
    q_rows = torch.cat([torch.arange(s + n - m, s + n) for s, n, m in
                        zip(torch.tensor([0] + lengths).cumsum(0).tolist(), lengths, q_lens)]).to(dev)
    ql, kl = TokenSpans.from_lengths(q_lens, dev), TokenSpans.from_lengths(lengths, dev)
    ref_p = attend_prefix(q[q_rows], k, v, ql, kl, backend="sdpa")
    fast_p = attend_prefix(q[q_rows].bfloat16(), k.bfloat16(), v.bfloat16(), ql, kl, backend="auto")
    rows = [
        check("packed causal, varlen bf16 vs sdpa fp32", rel(fast, ref), BF16_TOL),
        check("prefix causal (bottom-right), varlen bf16 vs sdpa fp32", rel(fast_p, ref_p), BF16_TOL),
        check("prefix rows vs full packed rows (sdpa fp32, same queries)", rel(ref_p, ref[q_rows]), FP32_TOL),
    ]
    if not report(rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
