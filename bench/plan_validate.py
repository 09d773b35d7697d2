"""The cost model of `loom plan --search` against measured step times: predicted and measured ranking of a
handful of layouts of one job, and their Spearman rank correlation. CPU (gloo), the tiny default job:

    python -m loom plan --calibrate --gpus 4 --calibration /tmp/cpu4.json
    torchrun --standalone --nproc-per-node=4 bench/plan_validate.py --calibration /tmp/cpu4.json \
        --layouts 0-3 --out /tmp/plan-validate.jsonl          # then --layouts 4-7 ... (each call ≤ 2 minutes)
    python bench/plan_validate.py --summarise A.jsonl [B.jsonl …] [--calibration C.json: predict again]

Every layout is built as `loom train` builds it (Trainer on this launch's ranks, one after another: process
groups are shared), trained `--warmup` steps, then `--steps` steps timed between barriers (median). The predicted
step time is the cost model's for the same config and the same drawn data (plan_search/workload.py). One JSON line
per layout: predicted and measured step seconds, tokens/s, the layout's overrides.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time

from loom.plan_search.cost import ModuleLayout
from loom.plan_search.search import Candidate

L = ModuleLayout
# The tiny default job's layouts on 4 ranks: vision, audio, language; M; T (0: shares as they come).
LAYOUTS = [
    ({"vision": L(1, dp=4), "audio": L(1, dp=4), "language": L(1, dp=4)}, 1, 0),
    ({"vision": L(2, dp=2), "audio": L(1, dp=4), "language": L(1, dp=4)}, 1, 0),
    ({"vision": L(1, dp=4), "audio": L(1, dp=4), "language": L(2, dp=2)}, 1, 0),
    ({"vision": L(1, dp=4), "audio": L(1, dp=4), "language": L(4, dp=1)}, 1, 0),
    ({"vision": L(1, dp=4), "audio": L(1, dp=4), "language": L(1, dp=4)}, 4, 0),
    ({"vision": L(1, dp=4), "audio": L(1, dp=4), "language": L(1, cp=2, dp=2)}, 1, 0),
    ({"vision": L(1, dp=4), "audio": L(1, dp=4), "language": L(1, pp=2, dp=2)}, 2, 1024),
    ({"vision": L(1, dp=1), "audio": L(1, dp=1), "language": L(1, dp=3, start=1)}, 1, 1024),
    # 8-12: measured only after the cost model was revised on 0-7 (a holdout, see bench/RESULTS.md)
    ({"vision": L(2, dp=2), "audio": L(1, dp=4), "language": L(2, dp=2)}, 1, 0),
    ({"vision": L(1, dp=4), "audio": L(1, dp=4), "language": L(1, dp=4)}, 2, 0),
    ({"vision": L(1, dp=4), "audio": L(1, dp=4), "language": L(1, cp=2, dp=2)}, 2, 0),
    ({"vision": L(2, dp=1), "audio": L(1, dp=2), "language": L(1, dp=2, start=2)}, 1, 0),
    ({"vision": L(1, dp=4), "audio": L(1, dp=4), "language": L(1, pp=2, dp=2)}, 4, 512),
]
COMMON = ["--data.workers=0", "--run.tensorboard=false", "--run.progress=false", "--train.log_every=1000"]


def candidate(i: int, world: int = 4) -> Candidate:
    layouts, m, t = LAYOUTS[i]
    return Candidate(world, layouts, m, t)


def predict(config: str | None, calibration: str | None, indices: list[int]) -> dict[int, dict]:
    from loom.job import load_config
    from loom.plan_search.calibration import load_calibration
    from loom.plan_search.estimate import estimate_steps
    from loom.plan_search.search import settings_of, validate
    from loom.plan_search.workload import job_facts

    cal = load_calibration(calibration)
    base = load_config(config, COMMON)
    facts = job_facts(base)
    out = {}
    for i in indices:
        c = candidate(i)
        cfg = validate(config, COMMON, c, facts)  # loom accepts it, or this raises
        e = estimate_steps(facts.sizes, c.layouts, settings_of(cfg, c), facts.steps, cal)
        out[i] = {"predicted_step_s": e.step_s, "predicted_tokens_per_s": e.tokens_per_s,
                  "predicted_terms_ms": {k: round(v * 1e3, 2) for k, v in e.seconds.items()}}
    return out


def measure(config: str | None, i: int, warmup: int, steps: int, device) -> float:
    import torch.distributed as dist

    from loom.job import load_config
    from loom.train.trainer import Trainer

    c = candidate(i, dist.get_world_size())
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(config, [*COMMON, f"--run.out_dir={out}", *c.overrides()], dist.get_world_size())
        trainer = Trainer(cfg, device)
        times = []
        for step in range(warmup + steps):
            dist.barrier()
            t0 = time.perf_counter()
            trainer.train_step()
            dist.barrier()
            if step >= warmup:
                times.append(time.perf_counter() - t0)
        trainer.prefetch.close()
        del trainer
        gc.collect()
    return statistics.median(times)


def _ranks(x: list[float]) -> list[float]:
    """1 for the smallest; tied values share their average rank."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (average ranks for ties): the Pearson correlation of the two rankings."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def summarise(paths: list[str], config: str | None = None, calibration: str | None = None) -> None:
    """The files' rows, with each layout's rank by predicted and by measured step time (1: fastest), and the
    Spearman of all rows (and of each file, when there are several); with `calibration`, the predictions are
    made again from it by today's cost model (the measured times kept)."""
    per_file = [[json.loads(line) for line in open(path) if line.strip()] for path in paths]
    if calibration:
        again = predict(config, calibration, [r["index"] for rows in per_file for r in rows])
        per_file = [[{**r, **again[r["index"]]} for r in rows] for rows in per_file]
    rows = [r for rows in per_file for r in rows]
    rank_p = _ranks([r["predicted_step_s"] for r in rows])
    rank_m = _ranks([r["measured_step_s"] for r in rows])
    print(f"{'#':>2} {'layout':<62} {'predicted ms':>13} {'measured ms':>12} {'rank p':>6} {'rank m':>6}")
    for r, a, b in zip(rows, rank_p, rank_m):
        print(f"{r['index']:>2} {r['layout']:<62} {r['predicted_step_s'] * 1e3:>13.1f} "
              f"{r['measured_step_s'] * 1e3:>12.1f} {a:>6g} {b:>6g}")
    for path, part in ([("all", rows)] + (list(zip(paths, per_file)) if len(paths) > 1 else [])):
        rho = spearman([r["predicted_step_s"] for r in part], [r["measured_step_s"] for r in part])
        print(f"Spearman (predicted vs measured step time, {len(part)} layouts, {path}): {rho:.3f}")


def _indices(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None, help="TOML job (default: loom/default.toml)")
    p.add_argument("--calibration", default=None)
    p.add_argument("--layouts", default=f"0-{len(LAYOUTS) - 1}", help="which of LAYOUTS, e.g. 0-3")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    p.add_argument("--summarise", nargs="+", default=None, metavar="JSONL",
                   help="print the table, ranks and Spearman of these files' rows (--calibration: predicted again)")
    args = p.parse_args()
    import os

    from loom.cli import DEFAULT_CONFIG

    if args.summarise:
        return summarise(args.summarise, args.config or str(DEFAULT_CONFIG), args.calibration)
    from loom.distributed import init_distributed, shutdown

    config = args.config or str(DEFAULT_CONFIG)
    device = init_distributed("gloo")
    import torch.distributed as dist

    indices = _indices(args.layouts)
    predicted = predict(config, args.calibration, indices) if dist.get_rank() == 0 else {}
    try:
        for i in indices:
            measured = measure(config, i, args.warmup, args.steps, device)
            if dist.get_rank() == 0:
                c = candidate(i)
                row = {"bench": "plan_validate", "index": i, "config": os.path.basename(config),
                       "layout": " | ".join(f"{n} {c.describe(n)}" for n in c.layouts) + f" M{c.microbatches}"
                                 + (f" T{c.tokens_per_microbatch}" if c.tokens_per_microbatch else ""),
                       "measured_step_s": measured, **predicted[i], "overrides": c.overrides()}
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
