"""Host work per step and per microbatch on CPU (issue 33): wall time of a step's phases on rank 0, under gloo.

    PYTHONPATH=. OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 bench/host_work.py --steps=12 \
        --layout.language.cp=2
    ... --nproc-per-node=2 bench/host_work.py --steps=12 --layout.language.pp=2 --train.microbatches=4 \
        --data.tokens_per_microbatch=256
    ... --nproc-per-node=3 bench/host_work.py --steps=12 --layout.vision.ranks=0-0 --layout.audio.ranks=0-0 \
        --layout.language.ranks=1-2 --data.tokens_per_microbatch=256

The model is loom/default.toml's tiny one; other `--a.b=value` overrides go to the config. Each phase is a
function wrapped with a timer (inclusive wall time, summed per step); the first `--warmup` steps (the
pipeline's build, first-call costs) are left out. `--profile=N` also prints rank 0's N functions of most own
time (cProfile, over the measured steps). `--rank=R` reports rank R instead of 0 (e.g. an LLM rank when rank 0
is an encoder rank).

CP's sharding alone, at GPU-sized microbatches, one process (cp rank 0 of 2; no group is touched):

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/host_work.py --tables

`shard_for_context` has the same signature on earlier commits: PYTHONPATH=<another checkout> times that one.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from loom.bridge import p2p
from loom.distributed import init_distributed, launched_world_size, shutdown
from loom.job import load_config
from loom.parallel import context, pipeline
from loom.train import encoder_ranks, runners, step, step_data, trainer

# (label, owner, attribute): the phases, each the inclusive time of one function; nested ones are parts of
# the ones above them (plan ⊂ inputs, cp tables ⊂ cp share)
PHASES = [
    ("step", trainer.Trainer, "train_step"),
    ("inputs", trainer, "step_inputs"),  # planned on the host, bad samples agreed on, moved to the device
    ("plan", step_data, "plan_step"),  # draw + plan_inputs: bins, collation, media decoded
    ("rows.begin+finish", None, None),  # filled below: whichever row source the rank's plan holds
    ("llm runner", None, None),
    ("cp share", runners.RunContext, "context_share"),  # per microbatch: zigzag sharding + selectors
    ("cp tables", context, "_context"),  # per microbatch: the ContextShard's q/k rows and spans
    ("pipeline run", pipeline.Pipeline, "run"),  # the schedule, model included
    ("p2p routes", p2p.P2PBridge, "_chunks"),  # per message: the step's chunks from host counts
    ("p2p receive rows", p2p.P2PBridge, "receive_rows"),  # includes waiting for the encoder rank
    ("p2p send grads", p2p.P2PBridge, "send_grads"),
    ("encoder ranks run", encoder_ranks.EncoderRanks, "run"),
    ("finish_step", step, "finish_step"),  # grad norm all-reduce, clip, AdamW
]


class Timers:
    def __init__(self) -> None:
        self.step = defaultdict(float)  # label → seconds in the current step
        self.calls = defaultdict(int)
        self.steps: list[dict[str, float]] = []

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[label] += time.perf_counter() - t0
                self.calls[label] += 1
        return timed

    def install(self, label: str, owner, name: str) -> None:
        setattr(owner, name, self.wrap(label, getattr(owner, name)))

    def end_step(self, keep: bool) -> None:
        if keep:
            self.steps.append(dict(self.step))
        self.step.clear()
        if not keep:
            self.calls.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--config", default="loom/default.toml")
    ap.add_argument("--tables", action="store_true", help="time CP's sharding of one microbatch, then exit")
    args, overrides = ap.parse_known_args()
    if args.tables:
        return time_context_share(args.steps)
    world = launched_world_size()
    overrides = [f"--layout.world_size={world}", "--run.out_dir=/tmp/loom-host-work", "--run.progress=false",
                 f"--train.steps={args.steps + args.warmup}", *overrides]
    cfg = load_config(args.config, overrides, world)
    device = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s, None, cfg.train.device) \
        if world > 1 else torch.device("cpu")
    timers = Timers()
    for label, owner, name in PHASES:
        if owner is not None:
            timers.install(label, owner, name)
    t = trainer.Trainer(cfg, device)
    rows, runner = t.plan.rows, t.plan.runner
    for obj, names, label in ((rows, ("begin", "finish"), "rows.begin+finish"), (runner, ("run",), "llm runner")):
        for name in names:
            if obj is not None:
                setattr(obj, name, timers.wrap(label, getattr(obj, name)))
    me = dist.get_rank() if dist.is_initialized() else 0
    prof = cProfile.Profile() if args.profile and me == args.rank else None
    for s in range(args.steps + args.warmup):
        keep = s >= args.warmup
        if prof is not None and keep:
            prof.enable()
        t.train_step()
        if prof is not None and keep:
            prof.disable()
        timers.end_step(keep)
    if me == args.rank:
        report(timers, cfg.train.microbatches, type(rows).__name__, type(runner).__name__ if runner else "-")
        if prof is not None:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
            print(out.getvalue())
    shutdown()


class _TwoRanks:
    """Stands in for torch.distributed in loom.parallel.context: cp rank 0 of 2, and nothing sent."""

    ProcessGroup = dist.ProcessGroup
    get_rank = staticmethod(lambda group=None: 0)
    get_world_size = staticmethod(lambda group=None: 2)


def time_context_share(repeats: int) -> None:
    """shard_for_context of one packed microbatch of T tokens (samples of 2048 tokens, two with image rows)."""
    from loom.data.batch import Batch
    from loom.data.spans import TokenSpans

    context.dist = _TwoRanks
    print(f"shard_for_context, cp rank 0 of 2, {repeats} repeats (torch {torch.__version__})")
    for tokens, per_sample in ((512, 32), (8192, 512), (32768, 2048)):
        lengths = [per_sample] * (tokens // per_sample)
        ids = torch.randint(0, 256, (tokens,))
        ids[:64] = 300  # a placeholder id's rows
        positions = torch.cat([torch.arange(n) for n in lengths])
        batch = Batch(ids, ids.clone(), positions, TokenSpans.from_lengths(lengths))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            context.shard_for_context(batch, None, [300])
            times.append(1e3 * (time.perf_counter() - t0))
        print(f"T = {tokens:6d}: min {min(times):6.2f}  median {statistics.median(times):6.2f}  "
              f"max {max(times):6.2f} ms")


def report(timers: Timers, microbatches: int, rows: str, runner: str) -> None:
    n = len(timers.steps)
    print(f"rank report: {n} steps, {microbatches} microbatches; rows {rows}, runner {runner}")
    print(f"{'phase':22s} {'calls/step':>10s} {'min ms':>8s} {'median ms':>10s} {'max ms':>8s} {'ms/microbatch':>14s}")
    for label, _, _ in PHASES:
        values = [1e3 * st.get(label, 0.0) for st in timers.steps]
        if not timers.calls.get(label):
            continue
        med = statistics.median(values)
        print(f"{label:22s} {timers.calls[label] / n:10.1f} {min(values):8.2f} {med:10.2f} {max(values):8.2f} "
              f"{med / microbatches:14.2f}")


if __name__ == "__main__":
    main()
