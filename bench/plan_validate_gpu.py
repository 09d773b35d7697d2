"""The cost model of `loom plan --search` on GPUs: the layouts the search proposes for the 2B workload
(bench/mm_bench.py: Qwen2.5-1.5B-shaped LLM, SigLIP-so400m-shaped ViT, Whisper-shaped audio), predicted against
measured step time, and the Spearman rank correlation of the two (issue 34's target: ≥ 0.8 over the top 5).

    python -m loom plan --calibrate --gpus 1 --calibration $OUT/cal.json     # optional: H200 defaults else
    PYTHONPATH=. python bench/plan_validate_gpu.py --gpus 1 --top 5 --gpu-memory 78 --calibration $OUT/cal.json \
        --out $OUT/plan-gpu.jsonl
    PYTHONPATH=. python bench/plan_validate_gpu.py --gpus 1 --top 5 --predict-only   # the proposed rows, no GPU
    PYTHONPATH=. python bench/plan_validate_gpu.py --summarise ROWS.jsonl --calibration CAL.json  # recorded rows,
                                                                 # predicted again by today's model, no GPU

The search runs as `loom plan --search` does (search.py: priced, then accepted by loom's own checks, best first),
on mm_bench's config and on the samples mm_bench trains on at the measured steps. On one GPU only M and T vary
(no placement, no split; activation checkpointing searched, compile the config's). Each proposed
layout is then one `torchrun --nproc-per-node=N bench/mm_bench.py --set …` with the layout's overrides (a
process per row, as run_mm.sh does): one JSON line per layout, then the Spearman. Eager bf16 (compile off, as
mm_bench's default config); each row is a start-up plus `--warmup` + `--steps` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.plan_validate import spearman

SEQ = 8192  # tokens per GPU per step that mm_bench packs each replica's samples into
WARMUP = 2


def mm_config_overrides(world: int, per_gpu: int) -> list[str]:
    """mm_bench.py's config for `--llm 1.5b` on GPUs (its LLM, VIT, AUDIO sizes; bf16; its global batch)."""
    from bench.shapes import AUDIO, LLM, VIT

    return [*LLM, *VIT, *AUDIO, "--data.format=thd", "--train.dtype=bf16",
            f"--train.global_batch_size={world * per_gpu}", "--data.train_size=1000000"]


def workload_job(name: str, world: int) -> tuple[list[str], object, int, int]:
    """An issue-51 workload (bench/layout_workloads.py) as the search sees it: its model in mm_bench's config, its
    samples' shape, per_gpu and seq."""
    from bench.layout_workloads import WORKLOADS

    w = WORKLOADS[name]
    return ([*w.model, "--data.format=thd", "--train.dtype=bf16", f"--train.global_batch_size={world * w.per_gpu}",
             "--data.train_size=1000000"], w.shape, w.per_gpu, w.seq)


def bench_facts(world: int, per_gpu: int, steps: int, workload: str = "") -> tuple[list[str], object, object]:
    """mm_bench's job (or `workload`'s) on `world` GPUs as the search sees it: its overrides, config, and facts —
    the model's sizes and the samples mm_bench trains on at the measured steps, each step in its batch order."""
    from bench.workload import PackedSteps, Shape
    from loom.job import load_config
    from loom.plan_search.workload import JobFacts, module_sizes, step_workload
    from loom.train.job_data import job_tokenizer, with_vocabulary
    from loom.train.job_model import build_job_model, token_counters

    overrides, shape, seq = mm_config_overrides(world, per_gpu), Shape(), SEQ
    if workload:
        overrides, shape, per_gpu, seq = workload_job(workload, world)
    cfg = load_config(None, overrides, world)
    tok = job_tokenizer(cfg)
    model = build_job_model(with_vocabulary(cfg, tok), tok)  # on meta: sizes only
    counters = token_counters(model)
    packed = PackedSteps(shape, world, per_gpu, seq)  # mm_bench's own samples, step by step
    drawn = tuple(step_workload(packed.global_batch(step), counters) for step in range(WARMUP, WARMUP + steps))
    return overrides, cfg, JobFacts(module_sizes(model), drawn, {"mm_bench samples": shape.longest})


def proposed(world: int, calibration: str | None, per_gpu: int, steps: int, top: int,
             gpu_memory_gib: float | None = None, workload: str = "") -> tuple[list, object]:
    """The search's `top` layouts for mm_bench's job (or `workload`'s) on `world` GPUs, priced on the measured
    steps' samples."""
    from loom.plan_search.calibration import load_calibration
    from loom.plan_search.search import search

    overrides, cfg, facts = bench_facts(world, per_gpu, steps, workload)
    result = search(None, overrides, cfg, facts, world, load_calibration(calibration), gpu_memory_gib, top)
    return result.ranked, result


def recorded_candidate(row: dict):
    """A recorded row's layout as a search Candidate, read back from its overrides."""
    from loom.plan_search.cost import ModuleLayout
    from loom.plan_search.search import Candidate

    keys = dict(o[2:].split("=", 1) for o in row["overrides"])
    modules = [k.split(".")[1] for k in keys if k.startswith("layout.") and k.endswith(".tp")]
    layouts = {}
    for n in sorted(modules, key=lambda n: n == "language"):  # language last, as the search orders them
        start = int(keys[f"layout.{n}.ranks"].strip('"').split("-")[0])
        dims = {d: int(keys.get(f"layout.{n}.{d}", 1)) for d in ("tp", "cp", "pp", "dp", "ep")}
        layouts[n] = ModuleLayout(**dims, start=start)
    return Candidate(int(keys["layout.world_size"]), layouts, int(keys["train.microbatches"]),
                     int(keys["data.tokens_per_microbatch"]), keys.get("train.activation_checkpointing", ""))


def summarise(path: str, calibration: str | None, per_gpu: int, attention_of_defaults: bool = False) -> list[dict]:
    """The recorded rows of `path` predicted again by today's cost model (on the same samples: the row's workload,
    its measured steps' count) beside their measured step times; prints them with the ratios and the Spearman.
    `attention_of_defaults`: where the calibration has no attention rate (a file written before it was measured),
    H200_DEFAULTS' (the recorded H200 probes: calibration.py)."""
    from dataclasses import replace

    from loom.plan_search.calibration import H200_DEFAULTS, load_calibration
    from loom.plan_search.estimate import estimate_steps
    from loom.plan_search.search import settings_of

    rows = [json.loads(line) for line in open(path) if line.strip()]
    cal = load_calibration(calibration)
    if attention_of_defaults:
        layers = {kind: replace(cal.layer(kind), attention_flops_per_s=facts.attention_flops_per_s)
                  for kind, facts in H200_DEFAULTS.layers.items() if not cal.layer(kind).attention_flops_per_s}
        cal = replace(cal, layers={**cal.layers, **layers})
    print(f"calibration: {calibration or 'H200 defaults'}; attention (TFLOP/s) "
          + ", ".join(f"{k} {cal.attention_rate(k) / 1e12:.0f}" for k in ("decoder", "encoder")))
    out = []
    for row in rows:
        c = recorded_candidate(row)
        steps = len(row.get("measured_step_times") or []) or 6
        workload = "" if row.get("workload", "2b") == "2b" else row["workload"]
        overrides, cfg, facts = bench_facts(c.world_size, per_gpu, steps, workload)
        e = estimate_steps(facts.sizes, c.layouts, settings_of(cfg, c), facts.steps, cal)
        out.append({**row, "predicted_again_s": e.step_s, "predicted_again_memory_gib": e.memory_bytes / 2**30,
                    "predicted_again_terms_ms": {k: round(v * 1e3, 1) for k, v in e.seconds.items() if v}})
    done = [r for r in out if r.get("measured_step_s")]
    for r in out:
        m = r.get("measured_step_s")
        print(f"{r['rank_predicted']:>2} {r['layout']:<72} recorded {r['predicted_step_s']:.3f} s, again "
              f"{r['predicted_again_s']:.3f} s, measured " + (f"{m:.3f} s ({m / r['predicted_again_s']:.2f}×)"
                                                               if m else "—") + f"  {r['predicted_again_terms_ms']}")
        peak = r.get("measured_peak_gib")
        print(f"   memory GiB: recorded {r['predicted_memory_gib']:.1f}, again {r['predicted_again_memory_gib']:.1f}, "
              f"measured peak " + (f"{peak:.1f} ({peak / r['predicted_again_memory_gib']:.2f}×)" if peak else "—"))
    if len(done) >= 3:
        for key in ("predicted_step_s", "predicted_again_s"):
            rho = spearman([r[key] for r in done], [r["measured_step_s"] for r in done])
            print(f"Spearman over {len(done)} measured rows, {key}: {rho:.3f}")
    return out


def measure(overrides: list[str], world: int, per_gpu: int, steps: int, workload: str = "") -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "bench/mm_bench.py", "--steps", str(steps), "--warmup", str(WARMUP)]
    # a workload brings its samples and model; its `custom` row takes the layout from --set alone
    job = ["--workload", workload, "--layout", "custom"] if workload else ["--seq", str(SEQ), "--per-gpu", str(per_gpu)]
    cmd += job
    for o in overrides:
        cmd += ["--set", o[2:]]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off on the lent machines
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith('{"bench": "mm"')]
    if run.returncode or not lines:
        return {"error": f"exit {run.returncode}: " + (run.stderr or run.stdout)[-2000:]}
    return json.loads(lines[-1])


def main() -> None:
    from loom.plan_search.report import summary_line

    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--top", type=int, default=5, help="how many of the search's layouts to measure")
    p.add_argument("--calibration", default=None, help="default: the H200 figures in plan_search/calibration.py")
    p.add_argument("--per-gpu", type=int, default=6, help="samples per GPU per step (mm_bench's --per-gpu)")
    p.add_argument("--steps", type=int, default=6, help="measured steps per row (median), after 2 warm-up steps")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                   help="leave out layouts predicted to need more per GPU (as loom plan --search)")
    p.add_argument("--predict-only", action="store_true", help="print the proposed layouts; measure nothing")
    p.add_argument("--workload", default="", help="an issue-51 workload (bench/layout_workloads.py) in place of the "
                                                  "2B job (its own samples per GPU and seq)")
    p.add_argument("--out", default=None, help="append JSON lines here")
    p.add_argument("--summarise", default=None, metavar="JSONL",
                   help="predict this file's recorded rows again with today's cost model (--calibration, "
                        "--per-gpu as measured); measure nothing")
    p.add_argument("--attention-of-defaults", action="store_true",
                   help="--summarise: where the calibration has no attention rate (older files), the H200 defaults'")
    args = p.parse_args()
    if args.summarise:
        summarise(args.summarise, args.calibration, args.per_gpu, args.attention_of_defaults)
        return
    ranked, result = proposed(args.gpus, args.calibration, args.per_gpu, args.steps, args.top, args.gpu_memory,
                              args.workload)
    print(summary_line(result), flush=True)
    if len(ranked) < args.top:
        print(f"the search proposes {len(ranked)} layouts on {args.gpus} GPUs, fewer than --top {args.top}")
    done = []
    for i, r in enumerate(ranked):
        c, e = r.candidate, r.estimate
        row = {"bench": "plan_validate_gpu", "workload": args.workload or "2b", "gpus": args.gpus,
               "rank_predicted": i + 1,
               "layout": " | ".join(f"{n} {c.describe(n)}" for n in c.layouts) + f" M{c.microbatches}"
                         + (f" T{c.tokens_per_microbatch}" if c.tokens_per_microbatch else "")
                         + (f" AC {c.activation_checkpointing}" if c.activation_checkpointing not in ("", "none")
                            else ""),
               "calibration": args.calibration or "H200 defaults", "predicted_step_s": e.step_s,
               "predicted_tokens_per_s_per_gpu": e.tokens_per_s / args.gpus,
               "predicted_memory_gib": e.memory_bytes / 2**30,
               "predicted_terms_ms": {k: round(v * 1e3, 2) for k, v in e.seconds.items()}, "overrides": c.overrides()}
        if not args.predict_only:
            got = measure(c.overrides(), args.gpus, args.per_gpu, args.steps, args.workload)
            row.update({"measured_step_s": got.get("step_s"), "measured_step_times": got.get("step_times"),
                        "measured_tokens_per_s_per_gpu": got.get("tokens_per_s_per_gpu"),
                        "measured_peak_gib": got.get("peak_mem_gib"), "device": got.get("device"),
                        "torch": got.get("torch"), "error": got.get("error")})
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        if row.get("measured_step_s"):
            done.append(row)
    if len(done) >= 3:
        rho = spearman([r["predicted_step_s"] for r in done], [r["measured_step_s"] for r in done])
        print(f"Spearman (predicted vs measured step time, {len(done)} layouts on {args.gpus} GPUs): {rho:.3f} "
              f"(target ≥ 0.8)")


if __name__ == "__main__":
    main()
