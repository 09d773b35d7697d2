"""One MoE block, grouped GEMM against the per-expert loop: do they agree, and how fast is each (forward +
backward), on the GPU in bf16 and fp32 (the loop only) or on CPU.

    PYTHONPATH=. python bench/moe_kernels.py --tokens 8192 --hidden 2048 --inter 768 --experts 16 --top-k 2

Prints one JSON line per kernel: the step times (min / median / max over --steps), and the largest difference
of the output and of each gradient from the loop's, relative to the loop's largest value.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from loom.models.moe import MoEBlock
from loom.models.router import RouterSpec


def run(kernel: str, args, device: torch.device, dtype: torch.dtype, x: torch.Tensor, g: torch.Tensor):
    torch.manual_seed(0)
    block = MoEBlock(args.hidden, RouterSpec(args.experts, args.top_k), args.inter, kernel=kernel).to(device)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    times = []
    for _ in range(args.steps):
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            y = block(xi)
        y.backward(g)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    grads = {n: p.grad.float() for n, p in block.named_parameters()}
    return times, y.detach().float(), xi.grad.float(), grads, block.experts.use_grouped(x.to(dtype))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(args.tokens, args.hidden, device=device)
    g = torch.randn(args.tokens, args.hidden, device=device) / args.tokens
    base = None
    for kernel in ("loop", "grouped"):
        times, y, gx, grads, grouped = run(kernel, args, device, dtype, x, g)
        row = {"kernel": kernel, "grouped_used": grouped, "device": torch.cuda.get_device_name() if device.type ==
               "cuda" else "cpu", "torch": torch.__version__, "dtype": str(dtype), **vars(args),
               "step_ms": [round(1e3 * t, 2) for t in (min(times), sorted(times)[len(times) // 2], max(times))]}
        if base is None:
            base = (y, gx, grads)
        else:
            rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
            row["rel_diff"] = {"out": rel(y, base[0]), "x_grad": rel(gx, base[1]),
                               **{n: rel(grads[n], base[2][n]) for n in grads}}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
