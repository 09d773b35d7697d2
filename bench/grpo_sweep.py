"""One GRPO run of issue 31's learning sweeps, through `loom rl`'s own loop, from an SFT checkpoint resumed with its
AdamW moments; held-out exact match every `--every` iterations, one JSON line each (bench/RESULTS.md, round 5).

    python bench/grpo_sweep.py --name grpo --start /tmp/sft40/step-40 --iterations 40 --lr 3e-4 \
        [--negative-scale 1] [--control] [-- --rl.prompts_per_iteration=256 ...]

`--negative-scale s` multiplies negative advantages by s (0: the correct rollouts alone): an experiment on the
loop, not a loom option. `--control` trains the same prompts' *true* answers (advantage 1) through the same
training path instead of sampling: SFT's reach in the same steps, the ceiling a GRPO run is compared with.
The base flags are round 5's: G = 8, temperature 0.5 (sampler and scoring), 128 prompts per iteration, one step
each, a constant lr after 2 warmup steps; the overrides after `--` come last and win.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


import loom.rl.loop as rl_loop
from loom.job import load_config
from loom.rl.pairs import completion_sample
from loom.rl.rollouts import Rollout
from loom.rl.sampler import Completion

BASE = ["--train.objective=grpo", "--train.device=cpu", "--rl.group_size=8", "--rl.temperature=0.5",
        "--train.grpo.temperature=0.5", "--train.min_lr_ratio=1.0", "--train.warmup_steps=2",
        "--rl.prompts_per_iteration=128", "--rl.iterations=100000", "--run.tensorboard=false", "--run.progress=false"]


def true_answers(loop: rl_loop.RLLoop) -> list:
    """The iteration's prompts with their dataset answers (and <eos>) as completions of advantage 1."""
    items, tok = [], loop.trainer.tok
    for p in (loop.prompts[i] for i in loop.order.indices(loop.iteration)):
        answer = tok.encode(p.record["answer"]) + [tok.eos_id]
        ro = Rollout(0, Completion(answer, [0.0] * len(answer)), 1.0, 1.0)
        items.append([completion_sample(p.sample, ro, {"advantage": [1.0] * (len(p.sample) + len(answer))})])
    return items


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--start", required=True, help="an SFT run's step-N checkpoint, resumed (moments included)")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--lr", default="3e-4")
    ap.add_argument("--negative-scale", type=float, default=1.0)
    ap.add_argument("--control", action="store_true", help="train the true answers instead (SFT's reach)")
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", default="/tmp/grpo_sweep")
    ap.add_argument("--config", default="configs/tiny.toml")
    args, overrides = ap.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    scale = args.negative_scale
    plain = rl_loop.group_advantages
    rl_loop.group_advantages = lambda rewards, kind: [a if a > 0 else a * scale for a in plain(rewards, kind)]
    cfg = load_config(args.config, [*BASE, f"--run.resume={args.start}", f"--train.lr={args.lr}",
                                    f"--run.out_dir={args.out}/{args.name}", *overrides])
    loop = rl_loop.RLLoop(cfg)
    start = time.time()

    def report(iteration: int, metrics: dict) -> None:
        held = {k.split("/")[-1]: round(v, 4) for k, v in loop.evaluate().items() if k.startswith("exact_match")}
        print(json.dumps({"name": args.name, "it": iteration, "s": round(time.time() - start),
                          "reward": round(metrics.get("rl/reward_mean", -1), 4),
                          "len": round(metrics.get("rl/response_length", -1), 2), **held}), flush=True)

    report(0, {})
    for iteration in range(1, args.iterations + 1):
        if args.control:
            metrics = loop._train(true_answers(loop))
            loop.iteration += 1
        else:
            metrics = loop.iterate()
        if iteration % args.every == 0:
            report(iteration, metrics)


if __name__ == "__main__":
    main(sys.argv[1:])
