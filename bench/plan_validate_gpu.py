"""The cost model of `loom plan --search` on GPUs: predicted against measured ranking of layouts of the 2B
workload (bench/mm_bench.py: Qwen2.5-1.5B-shaped LLM, SigLIP-so400m-shaped ViT, Whisper-shaped audio) on 4 GPUs.
Target: Spearman ≥ 0.8 between predicted and measured tokens/s. NOT RUN YET (written in a CPU-only session).

    python -m loom plan --calibrate --gpus 4 --calibration /tmp/h200x4.json      # optional: H200 defaults else
    python bench/plan_validate_gpu.py --gpus 4 --calibration /tmp/h200x4.json --out OUT.jsonl

For each layout of LAYOUTS: the prediction (the cost model on mm_bench's config and its own samples), then
`torchrun --nproc-per-node=N bench/mm_bench.py --steps 6 --warmup 2 --set …` with the layout's overrides (one
process per row, as run_mm.sh does); one JSON line per layout, then the Spearman of the two rankings. Each row
takes 1–2 minutes on H200s (compile off, eager bf16): run the rows in several calls if a call is limited.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.plan_validate import spearman
from loom.plan_search.cost import ModuleLayout as L
from loom.plan_search.search import Candidate

SEQ = 8192
# vision, audio, language on 4 GPUs; M; T
LAYOUTS = [
    ({"vision": L(dp=4), "audio": L(dp=4), "language": L(dp=4)}, 1, SEQ),
    ({"vision": L(dp=4), "audio": L(dp=4), "language": L(dp=4)}, 2, SEQ),
    ({"vision": L(dp=4), "audio": L(dp=4), "language": L(tp=2, dp=2)}, 1, SEQ),
    ({"vision": L(tp=2, dp=2), "audio": L(dp=4), "language": L(dp=4)}, 1, SEQ),
    ({"vision": L(dp=4), "audio": L(dp=4), "language": L(cp=2, dp=2)}, 1, SEQ),
    ({"vision": L(dp=4), "audio": L(dp=4), "language": L(pp=2, dp=2)}, 4, SEQ),
    ({"vision": L(dp=1), "audio": L(dp=1), "language": L(dp=3, start=1)}, 2, SEQ),
    ({"vision": L(dp=2), "audio": L(dp=2), "language": L(dp=2, start=2)}, 2, SEQ),
]


def mm_config_overrides(world: int, per_gpu: int) -> list[str]:
    """mm_bench.py's config for `--llm 1.5b` on GPUs (its LLM, VIT, AUDIO sizes; bf16; its global batch)."""
    from bench.mm_bench import AUDIO, LLM, VIT

    return [*LLM, *VIT, *AUDIO, "--data.format=thd", "--train.dtype=bf16",
            f"--train.global_batch_size={world * per_gpu}", "--data.train_size=1000000"]


def predict(world: int, calibration: str | None, per_gpu: int) -> list[dict]:
    from bench.workload import PackedSteps, Shape
    from loom.job import load_config
    from loom.plan_search.calibration import load_calibration
    from loom.plan_search.cost import Workload, estimate
    from loom.plan_search.search import settings_of
    from loom.plan_search.workload import module_sizes
    from loom.train.job_data import job_tokenizer, with_vocabulary
    from loom.train.job_model import build_job_model, token_counters

    cal = load_calibration(calibration)
    out = []
    for layouts, m, t in LAYOUTS:
        c = Candidate(world, layouts, m, t)
        cfg = load_config(None, [*mm_config_overrides(world, per_gpu), *c.overrides()], world)  # loom accepts it
        tok = job_tokenizer(cfg)
        model = build_job_model(with_vocabulary(cfg, tok), tok)
        counters = token_counters(model)
        samples = PackedSteps(Shape(), world, per_gpu, SEQ).global_batch(0)  # mm_bench's own samples
        work = Workload(tuple(len(s) for s in samples),
                        {n: tuple(cnt(i) for s in samples for i in s.items(n)) for n, cnt in counters.items()})
        e = estimate(module_sizes(model), c.layouts, settings_of(cfg, c), work, cal)
        out.append({"candidate": c, "predicted_step_s": e.step_s,
                    "predicted_tokens_per_s_per_gpu": e.tokens_per_s / world,
                    "predicted_memory_gib": e.memory_bytes / 2**30})
    return out


def measure(c: Candidate, per_gpu: int, steps: int) -> dict:
    sets = [o[2:] for o in c.overrides()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={c.world_size}",
           "bench/mm_bench.py", "--seq", str(SEQ), "--per-gpu", str(per_gpu), "--steps", str(steps), "--warmup", "2"]
    for kv in sets:
        cmd += ["--set", kv]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off on the lent machines
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith('{"bench": "mm"')]
    if run.returncode or not lines:
        return {"error": (run.stderr or run.stdout)[-2000:]}
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--calibration", default=None, help="default: the H200 figures in plan_search/calibration.py")
    p.add_argument("--per-gpu", type=int, default=6, help="samples per GPU per step (mm_bench's --per-gpu)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rows", default="", help="indices of LAYOUTS to run, e.g. 0,1,2 (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = predict(args.gpus, args.calibration, args.per_gpu)
    chosen = [int(i) for i in args.rows.split(",")] if args.rows else range(len(rows))
    done = []
    for i in chosen:
        r = rows[i]
        c = r.pop("candidate")
        got = measure(c, args.per_gpu, args.steps)
        row = {"bench": "plan_validate_gpu", "index": i, "overrides": c.overrides(), **r,
               "measured_tokens_per_s_per_gpu": got.get("tokens_per_s_per_gpu"), "measured_step_s": got.get("step_s"),
               "measured_peak_gib": got.get("peak_mem_gib"), "error": got.get("error")}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        if row["measured_tokens_per_s_per_gpu"]:
            done.append(row)
    if len(done) >= 3:
        rho = spearman([r["predicted_tokens_per_s_per_gpu"] for r in done],
                       [r["measured_tokens_per_s_per_gpu"] for r in done])
        print(f"Spearman (predicted vs measured tokens/s per GPU, {len(done)} layouts): {rho:.3f} (target ≥ 0.8)")


if __name__ == "__main__":
    main()
