"""`loom plan --calibrate --gpus N --calibration FILE`: the cost model's machine facts, measured here.

Runs on every rank of N under torchrun (`python -m loom.plan_search.calibrate --out FILE`, which `loom plan
--calibrate` starts itself): all ranks measure at once, so a shared machine's contention is in the numbers
(4 CPU ranks on 2 cores each get half a core, as `loom train` would). Measured:
- the matmul rate (bf16 8192³ on CUDA, as flops.peak_matmul_tflops; fp32 512³ on CPU), the slowest rank's;
- loom's own decoder and encoder layers (layer_probe.py): each one's host time per layer, its attention's rate
  (a third of the matmul rate on an H200, where the model used to price attention at the matmul rate) and the rate
  its eager elementwise kernels reach over the bytes the cost model counts;
- memory bandwidth: a 64 MiB (CPU) / 1 GiB (CUDA) copy;
- host overhead: forward + backward of a generic block with a handful of tokens (norm, q/k/v, attention, SwiGLU),
  whose arithmetic is negligible, so its time is dispatch: a microbatch's own host cost, a layer's where the layer
  probe has not measured one, and the base the splits below are measured against;
- all_gather and all_reduce for each group size 2, 4, … ≤ N (every rank in one of the N/g groups, all at once):
  latency from a small buffer, bus bandwidth from a large one;
- the same block split over each group: tensor parallel (DTensor) and FSDP2 — what the split adds per layer
  beyond the plain block and beyond its collectives as the cost model prices them (`layer_extra_s`): dispatch,
  hooks, and waiting for the group's slowest rank, which dominate a small model's step.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from loom.plan_search.calibration import Calibration, LayerFacts, Link, save_calibration
from loom.plan_search.cost import collective_s
from loom.plan_search.layer_probe import median_seconds, time_layer


class _Block(nn.Module):
    """A transformer block's op sequence at a tiny size (what a layer launches, not what it computes)."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.gate, self.up = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).unbind(-3)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        x = x + self.out(a.transpose(0, 1).flatten(-2))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _split_block_s(kind: str, group, device: torch.device, repeats: int, sync) -> float:
    """Forward + backward of _Block split over `group`: tp (DTensor, colwise in, rowwise out) or fsdp (FSDP2)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, device.type)
    block = _Block().to(device)
    if kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(block, mesh, {"qkv": ColwiseParallel(), "out": RowwiseParallel(), "gate": ColwiseParallel(),
                                         "up": ColwiseParallel(), "down": RowwiseParallel()})
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(block, mesh=mesh)
        block.set_gradient_divide_factor(1.0)
        if dist.get_backend(group) == "gloo":  # no PREMUL_SUM on gloo (as parallel/fsdp.py)
            block.set_force_sum_reduction_for_comms(True)
    x = torch.randn(16, 64, device=device, requires_grad=True)
    dist.barrier()
    return median_seconds(lambda: block(x).sum().backward(), repeats * 3, sync)


def _priced(cal_links: dict[str, dict[int, Link]], kind: str, g: int) -> float:
    """What the cost model already charges _Block's collectives when split over g ranks."""
    cal = Calibration("", 1.0, 1.0, 0.0, 0.0, False, 0.0, cal_links)
    if kind == "tp":  # two row-parallel outputs forward, two column-parallel input gradients backward
        return 4 * collective_s(cal, "all_reduce", g, 16 * 64 * 4)
    params = sum(p.numel() for p in _Block().parameters()) * 4
    return 2 * collective_s(cal, "all_gather", g, params) + collective_s(cal, "reduce_scatter", g, params)


def measure(device: torch.device, quick: bool = False) -> Calibration:
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    repeats = 3 if quick else 10

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    n, dtype = (8192, torch.bfloat16) if cuda else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    dist.barrier()
    matmul_s = slowest(median_seconds(lambda: a @ b, repeats, sync))
    big = torch.ones((1 << 30) // 4 if cuda else (64 << 20) // 4, device=device)
    dst = torch.zeros_like(big)  # written before timing: no first-touch page faults in the copy
    dist.barrier()
    copy_s = slowest(median_seconds(lambda: dst.copy_(big), repeats, sync))
    block = _Block().to(device)
    x = torch.randn(16, 64, device=device, requires_grad=True)
    dist.barrier()
    layer_s = slowest(median_seconds(lambda: block(x).sum().backward(), repeats * 3, sync))
    matmul, memory = 2 * n**3 / matmul_s, 2 * big.numel() * 4 / copy_s  # read + write
    layers = {}
    for kind in ("decoder", "encoder"):
        facts = time_layer(kind, device, repeats, sync, matmul, memory)
        # the slowest rank's: its longest host time, its lowest rates
        layers[kind] = LayerFacts(slowest(facts.host_s), facts.forward_share,
                                  1 / slowest(1 / facts.attention_flops_per_s),
                                  1 / slowest(1 / facts.elementwise_bytes_per_s))
    links: dict[str, dict[int, Link]] = {"all_gather": {}, "all_reduce": {}}
    extras: dict[str, dict[int, float]] = {"tp": {}, "fsdp": {}}
    small, large = 4096, (256 << 20 if cuda else 8 << 20)
    g = 2
    while g <= world:
        if world % g == 0:
            groups = [dist.new_group(list(range(s, s + g))) for s in range(0, world, g)]  # every rank creates all
            mine = groups[rank // g]
            for kind in links:
                times = {}
                for nbytes in (small, large):
                    out = torch.empty(nbytes // 4, device=device)
                    part = torch.empty(nbytes // 4 // g, device=device)
                    fn = ((lambda o=out, p=part: dist.all_gather_into_tensor(o, p, group=mine)) if kind == "all_gather"
                          else (lambda o=out: dist.all_reduce(o, group=mine)))
                    dist.barrier()
                    times[nbytes] = slowest(median_seconds(fn, repeats, sync))
                factor = (2 if kind == "all_reduce" else 1) * (g - 1) / g  # bus bytes per buffer byte
                extra = max(times[large] - times[small], 1e-9)
                links[kind][g] = Link(times[small], factor * (large - small) / extra)
            for kind in extras:
                split = slowest(_split_block_s(kind, mine, device, repeats, sync))
                extras[kind][g] = max(0.0, split - layer_s - _priced(links, kind, g))
        g *= 2
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({torch.get_num_threads()} threads per rank)"
    return Calibration(
        device=f"{name}, {world} ranks ({dist.get_backend()})",
        matmul_flops_per_s=matmul,
        memory_bytes_per_s=memory,
        overhead_per_layer_s=layer_s,
        overhead_per_microbatch_s=layer_s,
        host_overlaps_device=cuda,
        memory_reserved_bytes=(4 if cuda else 0.5) * 2**30,
        collectives=links,
        source=f"measured by loom plan --calibrate on {world} ranks",
        layer_extra_s=extras,
        layers=layers,
    )


def summary(cal: Calibration) -> str:
    """One line of what was measured; the collectives and splits only where there was a group to measure them."""
    parts = [f"{cal.matmul_flops_per_s / 1e9:,.1f} GFLOP/s", f"host {cal.overhead_per_layer_s * 1e3:.2f} ms per layer"]
    parts += [f"{kind} layer: host {f.host_s * 1e3:.2f} ms, attention {f.attention_flops_per_s / 1e9:,.1f} GFLOP/s, "
              f"elementwise {f.elementwise_bytes_per_s / 1e9:,.1f} GB/s" for kind, f in cal.layers.items()]
    parts += [f"{k} g{g} {link.bus_bytes_per_s / 1e9:.2f} GB/s + {link.latency_s * 1e6:.0f} µs"
              for k, t in cal.collectives.items() for g, link in t.items()]
    splits = [f"{k} g{g} +{s * 1e3:.1f} ms" for k, t in cal.layer_extra_s.items() for g, s in t.items()]
    if splits:
        parts.append("per layer split " + ", ".join(splits))
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    from loom.distributed import init_distributed, shutdown

    p = argparse.ArgumentParser(prog="python -m loom.plan_search.calibrate")
    p.add_argument("--out", required=True, help="the calibration JSON to write")
    p.add_argument("--quick", action="store_true", help="fewer repeats (tests)")
    args = p.parse_args(argv)
    device = init_distributed("auto", 300)
    if not dist.is_initialized():  # one rank: no launcher, a world of one (no collective to measure)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    try:
        cal = measure(device, args.quick)
        if dist.get_rank() == 0:
            print(f"calibration: {save_calibration(cal, args.out)}: {summary(cal)}")
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
