"""What the GPUs' links give FSDP2's collectives: all-gather (bf16) and reduce-scatter (fp32, bf16) at the sizes
of loom's units, bus bandwidth as nccl-tests counts it, one JSON line per size (rank 0).

    torchrun --standalone --nproc-per-node=4 bench/nccl_probe.py

Bus bandwidth = bytes of the gathered (or reduced) tensor × (n − 1) / n / time: the rate each link moved, which
the link's own rate bounds. A rate far below NVLink's (~300+ GB/s on 4 H200s) says the collectives cross a slower
path (PCIe, host memory), and then FSDP2's gathers cost milliseconds, not tenths.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

# a ViT block's gathered bf16 weights are ~30 MB, an LLM block's ~90 MB, the embedding ~470
SIZES_MB = (8, 32, 128, 512)


def timed(fn, repeats: int = 20) -> float:
    """Median seconds of `fn` by CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    for mb in SIZES_MB:
        for op, dtype in (("all_gather", torch.bfloat16), ("reduce_scatter", torch.float32),
                          ("reduce_scatter", torch.bfloat16)):
            whole = torch.randn(mb * 2**20 // dtype.itemsize // n * n, device="cuda").to(dtype)
            part = torch.empty(whole.numel() // n, device="cuda", dtype=dtype)
            if op == "all_gather":
                fn = lambda: dist.all_gather_into_tensor(whole, part)  # noqa: E731
            else:
                fn = lambda: dist.reduce_scatter_tensor(part, whole)  # noqa: E731
            s = timed(fn)
            if rank == 0:
                busbw = whole.numel() * dtype.itemsize * (n - 1) / n / s / 1e9
                print(json.dumps({"bench": "nccl", "op": op, "dtype": str(dtype).removeprefix("torch."), "mb": mb,
                                  "gpus": n, "ms": round(s * 1e3, 3), "busbw_gbs": round(busbw, 1)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
