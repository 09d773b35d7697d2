"""How busy the GPU is over a step, by CUDA events (no profiler): the step's device time with the host ahead,
over its wall time as measured.

The stream is first held by a sleep kernel; the whole step (forward, backward, clip and fused AdamW, the same
calls as `train_step` on one process, without reading the loss) is queued behind it, between two events. If
the host has queued everything before the sleep ends (the first event has not fired yet: checked), the GPU
then runs the step with no host gap, and the events' interval is its device time alone. Busy = that time over
the median wall step: 1.0 means the GPU never waits for the host.
"""

from __future__ import annotations

import time

import torch

from loom.train.optim import clip_in_optimizer, set_lr
from loom.train.step import run_microbatches


def queue_step(plan, model, optimizer, inputs, cfg, step: int) -> None:
    """One optimizer step queued on the device, nothing read back (one process, fused AdamW)."""
    set_lr(optimizer, step, cfg.train)
    run_microbatches(plan, model, inputs, plan.objective(cfg), train=True)
    clip_in_optimizer(model, optimizer, cfg.train.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def device_step_ms(enqueue, sleep_ms: float = 2000.0) -> tuple[float, float, bool]:
    """(device ms of what `enqueue()` queues, host ms it took to queue, whether the host stayed ahead)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(sleep_ms * 1.0e6))  # cycles: at least sleep_ms at clocks up to 1 GHz, longer above
    start.record()
    t0 = time.perf_counter()
    enqueue()
    host_ms = (time.perf_counter() - t0) * 1e3
    ahead = not start.query()  # the sleep still runs: nothing queued so far has started
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host_ms, ahead


def busy_report(enqueues, wall_step_s: float) -> dict:
    """Over `enqueues` (one callable per step): the median device ms and busy = device time / wall step."""
    runs = [device_step_ms(e) for e in enqueues]
    device = sorted(r[0] for r in runs)[len(runs) // 2]
    return {"device_step_ms": round(device, 2), "busy": round(device / 1e3 / wall_step_s, 4),
            "host_queue_ms": round(sorted(r[1] for r in runs)[len(runs) // 2], 2),
            "host_ahead": all(r[2] for r in runs)}
