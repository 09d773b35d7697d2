"""torchtitan's tokens/s per GPU, read from its training log: the row bench/run_tt.sh sets beside loom's.

    python -m bench.titan_log LOG --gpus 4 --tokens-per-gpu 8192

torchtitan v0.2.2 (torchtitan/components/metrics.py, MetricsProcessor.log) logs at step 1 and every
`metrics.log_freq` steps one line per rank it shows (run_train.sh shows rank 0 alone), e.g. (one line)

    [rank0]:[titan] 2026-11-24 06:30:29,837 - root - INFO - step: 10  loss:  6.38482  grad_norm: 15.3294
    memory: 43.63GiB(31.21%)  tps: 36,165  tflops: 509.69  mfu: 51.54%

colored with ANSI codes unless `metrics.disable_color_printing`. Its `tps` is tokens per second per device over
the steps since the previous line. Prints one JSON line: every such `tps` from step `--from-step` on (earlier
lines hold compilation and the first kernels' tuning) and their median.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# "validate step:" lines carry a tps too, over a validation pass: not training speed
STEP_TPS = re.compile(r"(?<!validate )\bstep:\s*(\d+)\s.*?\btps:\s*([\d,]+)")


def tps_by_step(text: str) -> dict[int, int]:
    """Training step → the `tps` its log line reports, from every line torchtitan's metrics wrote."""
    found = {}
    for line in text.splitlines():
        m = STEP_TPS.search(ANSI.sub("", line))
        if m:
            found[int(m.group(1))] = int(m.group(2).replace(",", ""))
    return found


def titan_row(text: str, gpus: int, tokens_per_gpu: int, from_step: int = 10) -> dict:
    """The JSON row of one torchtitan run: its `tps` from `from_step` on and their median (None if none)."""
    tps = [v for step, v in sorted(tps_by_step(text).items()) if step >= from_step]
    return {"bench": "torchtitan", "gpus": gpus, "tokens_per_gpu": tokens_per_gpu, "from_step": from_step,
            "tps": tps, "tps_median": statistics.median(tps) if tps else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--tokens-per-gpu", type=int, required=True)
    p.add_argument("--from-step", type=int, default=10, help="the first logged step counted")
    args = p.parse_args()
    with open(args.log, errors="replace") as f:
        row = titan_row(f.read(), args.gpus, args.tokens_per_gpu, args.from_step)
    print(json.dumps(row))
    raise SystemExit(0 if row["tps"] else 1)  # no tps line: the run failed, say so to the script


if __name__ == "__main__":
    main()
