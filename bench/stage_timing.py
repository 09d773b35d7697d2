"""The pipeline bubble, measured (bench only, off unless `bench/mm_bench.py --stage-timing`): a timer around each
stage's forward and backward chunk (CUDA events on a GPU, the host clock on CPU, where the numbers mean nothing but
the accounting runs) and around the whole schedule of each step. A rank's bubble is the share of its schedule's span
in which none of its stages computed; 1F1B's ideal is (p−1)/(m+p−1) on every rank.

Wraps loom's stage class and Pipeline.run from outside, so loom's own code carries no timing.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from loom.parallel import pipeline as loom_pipeline

CHUNKS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class _Clock:
    """A point in time: a CUDA event recorded on the current stream, or the host clock."""

    def __init__(self, gpu: bool) -> None:
        if gpu:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.event, self.t = None, time.perf_counter()

    def seconds_since(self, start: _Clock) -> float:
        if self.event is not None:
            return start.event.elapsed_time(self.event) / 1e3
        return self.t - start.t


class StageTiming:
    """Per measured step: this rank's (start, end) of each stage chunk, and of its schedule."""

    def __init__(self, gpu: bool, stages: int, microbatches: int, schedule: str) -> None:
        self.gpu, self.p, self.m, self.schedule = gpu, stages, microbatches, schedule
        self.measuring = False
        self.steps: list[dict] = []  # {"run": (start, end), "chunks": [(kind, start, end)]}
        self._install()

    def ideal_bubble(self) -> float:
        return (self.p - 1) / (self.m + self.p - 1)

    def _install(self) -> None:
        timing = self
        for name in CHUNKS:
            original = getattr(loom_pipeline.RowsAwareStage, name)

            def timed(stage, *args, _original=original, _name=name, **kwargs):
                if not timing.measuring or not timing.steps:
                    return _original(stage, *args, **kwargs)
                start = _Clock(timing.gpu)
                out = _original(stage, *args, **kwargs)
                timing.steps[-1]["chunks"].append((_name, start, _Clock(timing.gpu)))
                return out

            setattr(loom_pipeline.RowsAwareStage, name, timed)
        run = loom_pipeline.Pipeline.run

        def timed_run(pipeline, *args, **kwargs):
            if not timing.measuring:
                return run(pipeline, *args, **kwargs)
            record = {"chunks": []}
            timing.steps.append(record)
            start = _Clock(timing.gpu)
            out = run(pipeline, *args, **kwargs)
            record["run"] = (start, _Clock(timing.gpu))
            return out

        loom_pipeline.Pipeline.run = timed_run

    def rank_summary(self) -> dict | None:
        """This rank's busy and span seconds per measured step (None: it ran no pipeline stage)."""
        steps = [s for s in self.steps if "run" in s]
        if not steps:
            return None
        if self.gpu:
            torch.cuda.synchronize()
        busy = [sum(end.seconds_since(start) for _, start, end in s["chunks"]) for s in steps]
        span = [s["run"][1].seconds_since(s["run"][0]) for s in steps]
        kinds = {k: sum(1 for s in steps for c in s["chunks"] if c[0] == k) // len(steps) for k in CHUNKS}
        return {"busy_s": busy, "span_s": span, "chunks_per_step": kinds}

    def report(self) -> dict:
        """Every rank's bubble (1 − busy / span, its median step) against the ideal; gathered to every rank."""
        mine = self.rank_summary()
        ranks = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        bubbles = {}
        for r, s in enumerate(ranks):
            if s is None:
                continue
            shares = sorted(1 - b / t if t > 0 else 0.0 for b, t in zip(s["busy_s"], s["span_s"]))
            bubbles[r] = round(shares[len(shares) // 2], 4)
        if not bubbles:
            return {"stage_timing": None}
        ideal = self.ideal_bubble()
        mean = sum(bubbles.values()) / len(bubbles)
        return {"stage_timing": {
            "pp": self.p, "microbatches": self.m, "schedule": self.schedule, "ideal_bubble": round(ideal, 4),
            "bubble_per_rank": bubbles, "bubble_mean": round(mean, 4), "bubble_max": max(bubbles.values()),
            "bubble_over_ideal": round(mean / ideal, 3) if ideal else None,
            "chunks_per_step": {r: s["chunks_per_step"] for r, s in enumerate(ranks) if s is not None},
            "device_timed": self.gpu,  # False: host clocks on CPU, the accounting only
        }}
