"""parallel.stream_priority = "compute": the step's kernels go to a high-priority CUDA stream, so the GPU's block
scheduler hands free SMs to the matmuls and attention before the NCCL kernels of the gradient sums that run beside
the backward (on 4 GPUs those kernels slowed the compute beside them by 10-70%, docs/multi-gpu.md)."""

from __future__ import annotations

import contextlib

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}  # one per device, made on first use and kept for the process


@contextlib.contextmanager
def step_stream(priority: str):
    """Run the body on this device's high-priority stream when `priority` is "compute" and CUDA is here; else a
    no-op. The stream waits for the work queued before (the step's inputs, copied in on the outer stream), and
    the outer stream waits for the step, so what follows (the next inputs, a checkpoint's copies) sees it done."""
    if priority != "compute" or not torch.cuda.is_available():
        yield
        return
    device = torch.cuda.current_device()
    if device not in _STREAMS:  # -100: mapped to the device's highest priority (torch clamps to its range)
        _STREAMS[device] = torch.cuda.Stream(device, priority=-100)
    stream, outer = _STREAMS[device], torch.cuda.current_stream(device)
    stream.wait_stream(outer)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        outer.wait_stream(stream)
