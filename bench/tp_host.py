"""The host's cost of tensor parallelism per encoder layer: loom's ViT layer under its TP plan (DTensor,
parallel/tensor.py `apply_encoder_tp`) against the same layer whole, with a fake process group (no communication,
one process) and tiny widths (the host's work per op does not depend on them), so what is timed is the host alone.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/tp_host.py [--tp 2 4]

Why: the ViT at tp2·dp2 and tp4 measured ~0.5 s a step more than at dp4 on 4 H200s (eager, bench/RESULTS.md
2026-11-28), not scaling with rows or bytes; the cost model priced it at ~0.12 s. One JSON line per tp: host ms
per layer, forward and forward + backward (median of 15, 9 layers a run).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from loom.data.spans import TokenSpans
from loom.models.encoder_layer import EncoderLayer
from loom.parallel.tensor import apply_encoder_tp

LAYERS, ROWS, ITEMS = 9, 16, 4


class _Layers(nn.Module):
    """What apply_encoder_tp reads of an encoder: `encoder.layers` and a `projector` (none here)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(64, 16, 128, 1e-6, "tanh") for _ in range(LAYERS))
        self.projector = None


def host_ms(tp: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = _Layers()
    if tp > 1:
        apply_encoder_tp(model, init_device_mesh("cpu", (tp,)))
    x = torch.randn(ROWS * ITEMS, 64, requires_grad=True)
    spans = TokenSpans.from_lengths([ROWS] * ITEMS)

    def step(backward: bool) -> None:
        h = x
        for layer in model.encoder.layers:
            h = layer(h, spans)
        if backward:
            h.sum().backward()

    for _ in range(3):
        step(True)
    out = {}
    for name, backward in (("forward_ms", False), ("forward_backward_ms", True)):
        times = []
        for _ in range(15):
            start = time.perf_counter()
            step(backward)
            times.append(time.perf_counter() - start)
        out[name] = round(sorted(times)[len(times) // 2] / LAYERS * 1e3, 3)
    return out


def main() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=max(args.tp))
    whole = host_ms(1)
    for tp in args.tp:
        row = host_ms(tp)
        print(json.dumps({"bench": "tp_host", "tp": tp, **row, "whole_layer": whole,
                          "tp_over_whole": round(row["forward_backward_ms"] / whole["forward_backward_ms"], 2)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
