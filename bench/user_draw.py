"""A rank's `draw` (train/step_draw.py) of a step of a user's data, with the shape table against without it (the whole
batch's shapes looked up line by line each step), at the 2B job's 2 items per LLM replica: 64, 1,024 and 8,192
replicas (global batches of 128 … 16,384 items), as LLM replica 0 beside its vision (dp / 2) and audio replicas.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/user_draw.py [--dps 64 1024 8192] [--steps 9] [--pairs]

The dataset is a real `ConversationSamples` over stand-in files whose lines' shapes are drawn as a prescan would
have measured them (text of 100–3,000 tokens, 0–2 images of 64–729 rows, a clip of 50–750 frames on some): the draw
reads only those shapes, so what is timed is the draw itself; bench/scale_sim.py has no user-data job (its fake
backend answers the prescan's gather with nothing). `table_s`: filling the table at load (`known_table`, once per
run, on every rank). Each row: the median of --steps steps after step 0 (untimed: the table's per-sequence numbers
are built at its first draw), each step drawn by both paths.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time

ENCODERS = ["vision", "audio"]


class StandInFile:
    """A source of n lines: only its length and its lines' names (messages) are read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def where(self, k: int) -> str:
        return f"data.jsonl:{k + 1}"


def user_samples(lines: int, pairs: bool, seed: int = 0):
    """A weighted mixture of two stand-in files (the second weighted twice: its lines repeat) with drawn shapes."""
    from loom.data.shapes import SampleShape
    from loom.data.source import ConversationSamples

    rng = random.Random(seed)

    def shape() -> SampleShape:
        rows = {}
        if rng.random() < 0.6:
            rows["vision"] = tuple(rng.choice([64, 256, 729]) for _ in range(rng.randint(1, 2)))
        if rng.random() < 0.2:
            rows["audio"] = (rng.randint(50, 750),)
        tokens = rng.randint(100, 3000) + sum(sum(r) for r in rows.values())
        return SampleShape(tokens, rng.randint(10, 300), rows)

    files = [StandInFile(lines * 3 // 4), StandInFile(lines // 4)]
    samples = ConversationSamples.mixture(files, [1.0, 2.0], None, {e: None for e in ENCODERS}, None)
    # the prescan's shapes by file and line (set after: the stand-in files' names are not unique across them)
    samples.measured = [[tuple(shape() for _ in range(2 if pairs else 1)) for _ in range(len(f))] for f in files]
    return samples


def row(dp: int, steps: int, pairs: bool) -> dict:
    from loom.data.loader import GlobalBatches
    from loom.data.shape_table import known_table
    from loom.job import load_config
    from loom.train.step_draw import draw

    items = 2 * dp  # the 2B job's 2 samples per LLM replica (a DPO pair: 2 sequences each)
    per_item = 2 if pairs else 1
    cfg = load_config("configs/tiny.toml", [f"--train.global_batch_size={items * per_item}", "--train.microbatches=1",
                                            "--data.tokens_per_microbatch=8192", "--data.too_long=skip"]
                      + (["--train.objective=dpo", "--train.reference=initial"] if pairs else []))
    samples = user_samples(4 * items, pairs)
    t0 = time.perf_counter()
    table = known_table(len(samples), per_item, ENCODERS, samples.shape)
    table_s = time.perf_counter() - t0
    counters = {e: None for e in ENCODERS}
    shares = {"language": (0, dp), "vision": (0, dp // 2), "audio": (0, dp)}
    measured = copy.copy(samples)  # the same lines without the table: the whole batch looked up line by line
    samples.table, measured.table = table, None
    paths = {"whole_batch_s": GlobalBatches(measured, items, 0), "table_s": GlobalBatches(samples, items, 0)}
    timings = {"whole_batch_s": [], "table_s": []}
    for batches in paths.values():  # step 0 pays first-call costs (the table's per-sequence numbers): untimed
        draw(batches, 0, cfg, counters, 8, shares)
    for s in range(1, steps + 1):
        for key, batches in paths.items():
            t0 = time.perf_counter()
            drawn = draw(batches, s, cfg, counters, 8, shares)
            timings[key].append(time.perf_counter() - t0)
    return {"bench": "user_draw", "dp": dp, "items": items, "pairs": pairs, "lines": len(samples),
            "cells": f"{len(drawn.batch.planned)} of {len(drawn.batch.cells)}",
            "draw_whole_batch_ms": round(1e3 * statistics.median(timings["whole_batch_s"]), 3),
            "draw_table_ms": round(1e3 * statistics.median(timings["table_s"]), 3),
            "fill_table_s": round(table_s, 3)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dps", type=int, nargs="+", default=[64, 1024, 8192])
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--pairs", action="store_true", help="DPO pairs: two sequences an item")
    args = p.parse_args()
    for dp in args.dps:
        print(json.dumps(row(dp, args.steps, args.pairs)), flush=True)


if __name__ == "__main__":
    main()
