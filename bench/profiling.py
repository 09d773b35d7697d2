"""The benchmarks' device profiles: a torch profiler over the measured steps, its summary tables, the gaps between
kernels, each rank's compute timeline (bench/overlap.py), and the exposed communication and rank skew that
bench/mm_bench.py and bench/llm_bench.py print (`--comm-report`, or with `--profile`)."""

from __future__ import annotations

import bisect
import json
import math
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.autograd import DeviceType

from bench.overlap import Interval, comm_summary, exposed_comm, merge_intervals


def print_sync_stacks() -> None:
    """Each synchronizing warning once per calling place, with the stack that led to it (stderr)."""
    seen = set()

    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        if stack not in seen:
            seen.add(stack)
            print(f"--- {message}\n{stack}", file=sys.stderr)

    warnings.simplefilter("always")
    warnings.showwarning = show


def write_profile(profiler, path: str, wall_s: float, gpu: bool) -> None:
    """Top operators by device time and by host time, and how busy the device was over the measured steps
    (kernel time / wall time: far below 1 means the host or a collective's wait holds the device idle)."""
    events = profiler.key_averages()
    with open(path, "w") as f:
        if gpu:  # kernels only, as the table's own total: user annotations would count their kernels twice
            busy = sum(e.self_device_time_total for e in events
                       if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e6
            f.write(f"wall {wall_s:.3f} s, device kernels {busy:.3f} s ({busy / wall_s:.0%} of wall)\n\n")
            rows = int(os.environ.get("PROFILE_ROWS", "40"))  # more rows to sort every kernel into a category
            f.write(events.table(sort_by="self_device_time_total", row_limit=rows) + "\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
        if gpu and os.environ.get("PROFILE_GAPS"):
            try:
                f.write(gap_report(profiler))
            except Exception as e:  # noqa: BLE001 - a diagnostic: the tables above stand without it
                f.write(f"gap report failed: {type(e).__name__}: {e}\n")


def gap_report(profiler, top: int = 40) -> str:
    """Where the device idles between kernels (PROFILE_GAPS=1): every gap between one kernel's end and the next
    one's start, summed by size and listed largest first with the kernels on either side."""
    kernels = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                     for e in profiler.profiler.kineto_results.events()
                     if e.device_type() == DeviceType.CUDA and not e.is_user_annotation())
    gaps, end, before = [], None, ""
    for start, stop, name in kernels:
        if end is not None and start > end:
            gaps.append((start - end, before, name))
        if end is None or stop > end:
            end, before = stop, name
    bins = {"<5us": 5e3, "5-20us": 20e3, "20-100us": 100e3, "100us-1ms": 1e6, ">1ms": float("inf")}
    sums = dict.fromkeys(bins, 0)
    for ns, _, _ in gaps:
        sums[next(k for k, bound in bins.items() if ns < bound)] += ns
    lines = [f"\ngaps between kernels: {len(gaps)}, {sum(g[0] for g in gaps) / 1e6:.1f} ms in all; by size (ms): "
             + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sums.items())]
    for ns, a, b, *_ in sorted(gaps, reverse=True)[:top]:
        lines.append(f"{ns / 1e3:9.1f} us  after {a[:70]}  before {b[:70]}")
    return "\n".join(lines) + "\n" + gap_causes(profiler, gaps_at(profiler))


def gaps_at(profiler) -> list[tuple[int, int, int]]:
    """(gap start, gap end, correlation id of the kernel after it) for every gap of 20 us or more."""
    kernels = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.correlation_id())
                     for e in profiler.profiler.kineto_results.events()
                     if e.device_type() == DeviceType.CUDA and not e.is_user_annotation())
    out, end = [], None
    for start, stop, corr in kernels:
        if end is not None and start - end >= 20_000:
            out.append((end, start, corr))
        end = stop if end is None else max(end, stop)
    return out


def gap_causes(profiler, gaps: list[tuple[int, int, int]], top: int = 25) -> str:
    """What the host was doing while the device idled: for each gap, the innermost host operator (with its
    Python stack under PROFILE_GAPS=stack) around the launch of the kernel after the gap, when that launch came
    after the gap began (the host was late); gap time summed by that operator and by the loom frame."""
    events = list(profiler.profiler.kineto_results.events())
    host = [e for e in events if e.device_type() == DeviceType.CPU]
    launch = {e.correlation_id(): e for e in host if e.correlation_id()}
    ops = sorted((e for e in host if not e.name().startswith("cuda") and e.duration_ns() > 0),
                 key=lambda e: e.start_ns())
    starts = [e.start_ns() for e in ops]
    by_op, by_frame, late, rows = {}, {}, 0, []
    for g0, g1, corr in sorted(gaps, key=lambda g: g[0] - g[1])[:400]:  # the largest
        rt = launch.get(corr)
        if rt is None or rt.start_ns() <= g0:
            continue  # launched before the gap began: the device waited on something else (an event, a copy)
        late += g1 - g0
        t = rt.start_ns()
        window = ops[bisect.bisect_left(starts, t - 200_000_000):bisect.bisect_right(starts, t)]
        thread = rt.start_thread_id()
        around = [e for e in window if t <= e.start_ns() + e.duration_ns() and e.start_thread_id() == thread]
        inner = min(around, key=lambda e: e.duration_ns()) if around else None
        name = inner.name() if inner is not None else rt.name()
        frames = [f for e in around for f in (e.stack() or []) if "loom/" in f or "bench/" in f]
        frame = frames[0] if frames else "?"
        by_op[name] = by_op.get(name, 0) + g1 - g0
        by_frame[frame] = by_frame.get(frame, 0) + g1 - g0
        outer = [e.name()[:40] for e in sorted(around, key=lambda e: -e.duration_ns())[:4]]
        rows.append((g1 - g0, name, rt.name(), frame, outer))
    lines = [f"\nof the 400 largest device gaps, those whose next kernel was launched late: {late / 1e6:.1f} ms"]
    lines += ["by innermost host operator at the launch (ms):"]
    lines += [f"  {v / 1e6:8.2f}  {k[:100]}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]]
    lines += ["by first loom/bench frame (ms):"]
    lines += [f"  {v / 1e6:8.2f}  {k[:150]}" for k, v in sorted(by_frame.items(), key=lambda kv: -kv[1])[:top]]
    lines += ["largest:"]
    lines += [f"  {ns / 1e3:8.1f} us  {op[:50]} via {rt}  {fr[:110]}  {outer}" for ns, op, rt, fr, outer in
              sorted(rows, key=lambda r: -r[0])[:top]]
    return "\n".join(lines) + "\n"


def kernel_intervals(profiler) -> tuple[list[Interval], list[Interval]]:
    """(compute, communication) device activities as (start, end) in the host's wall-clock ns (kineto maps kernel
    times onto it, so the ranks of one host line up and time.time_ns() windows fit). Communication: NCCL's kernels
    (ncclDevKernel_… since NCCL 2.19, ncclKernel_… before); compute: every other kernel, copy and memset."""
    compute, comm = [], []
    for e in profiler.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CUDA and not e.is_user_annotation():  # annotations would count twice
            (comm if e.name().startswith("nccl") else compute).append((e.start_ns(), e.start_ns() + e.duration_ns()))
    return compute, comm


def write_timeline(profiler, path: str, rank: int, windows: list[Interval]) -> None:
    """This rank's compute kernels over the measured steps as merged busy intervals and each step's window
    (bench/overlap.py reads them). NCCL kernels are left out: a receive's kernel runs while it waits for its
    sender, which is not work."""
    with open(path, "w") as f:
        json.dump({"rank": rank, "steps": windows, "busy": merge_intervals(kernel_intervals(profiler)[0])}, f)


def comm_report(profiler, windows: list[Interval], device: torch.device) -> dict:
    """Exposed communication and rank skew over the measured steps (bench/overlap.py's comm_summary), this rank's
    figures gathered from every rank: a collective, so every rank calls it with a profiler of its own. Null keys
    where a rank saw no device kernel (a CPU run)."""
    mine = [math.nan, math.nan]
    if profiler is not None:
        compute, comm = kernel_intervals(profiler)
        if compute or comm:
            share, busy_ns = exposed_comm(compute, comm, windows)
            mine = [share, busy_ns / 1e9]
    rows = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        on = device if "nccl" in dist.get_backend() else torch.device("cpu")  # gloo gathers host tensors
        t = torch.tensor(mine, dtype=torch.float64, device=on)
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, t)
        rows = [g.tolist() for g in gathered]
    return comm_summary([None if math.isnan(r[0]) else (r[0], r[1]) for r in rows])


def start_profiler(gpu: bool, full: bool):
    """A started profiler for the measured steps: with `full` host operators too (write_profile's tables), else
    device activity alone, the lightest kineto trace that gives comm_report its kernels (None on CPU)."""
    activities = ([torch.profiler.ProfilerActivity.CPU] if full else []) + (
        [torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    if not activities:
        return None
    stack = full and os.environ.get("PROFILE_GAPS") == "stack"  # Python stacks for gap_causes: a heavy trace
    profiler = torch.profiler.profile(activities=activities, with_stack=stack)
    profiler.__enter__()
    return profiler
