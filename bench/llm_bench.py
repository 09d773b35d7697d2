"""The LLM alone: a text-only loom job (`model.encoders = []`) on the Qwen3-1.7B shape, the row to set beside
torchtitan's (../shared/anchors/torchtitan-qwen3.md).

    python bench/llm_bench.py --tokens 8192 --set train.compile=true

Every sample is one document of `--seq` tokens (random byte ids: speed does not depend on them); a step holds
`--tokens` of them, packed into one microbatch of exactly that many tokens (`data.tokens_per_microbatch`), so
compiled code sees one shape. Built through `build_job`, as `loom train` builds, then timed on this workload.
On one GPU (no torchrun) loom runs as torchtitan does there: no FSDP, bf16 autocast over fp32 weights.
Prints one JSON line: tokens/s, MFU (loom/train/flops.py over an 8192³ bf16 matmul measured in the same
run), peak memory, every step's time and the recompiles after the first step; with `--comm-report` (or
`--profile`) exposed communication and rank skew, as bench/mm_bench.py. `--small` runs on CPU (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.busy import busy_report, queue_step
from bench.flash_impl import activate
from bench.overlap import comm_summary
from bench.routing import MODES, use_routing
from bench.shapes import LLMS
from bench.profiling import comm_report, print_sync_stacks, start_profiler, write_profile
from loom.data.loader import GlobalBatches
from loom.data.sample import Sample
from loom.distributed import init_distributed, shutdown
from loom.job import load_config
from loom.parallel.compile import compiled_frames
from loom.train.build import build_job
from loom.train.flops import peak_matmul_tflops
from loom.train.step_data import step_inputs

SMALL = ["--model.language.hidden_size=64", "--model.language.num_layers=2", "--model.language.num_heads=4",
         "--model.language.num_kv_heads=2", "--model.language.intermediate_size=128",
         "--model.language.vocab_size=512", "--model.language.qk_norm=true"]
TEXT_ONLY = ["--model.encoders=[]", '--data.tasks=["sums"]']


def documents(n: int, seq: int, seed: int = 0) -> list[Sample]:
    """`n` documents of `seq` tokens each: <bos> then random bytes, every token after <bos> a target."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        ids = [1] + torch.randint(0, 256, (seq - 1,), generator=g).tolist()
        docs.append(Sample(ids, [False] + [True] * (seq - 1), [], []))
    return docs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=8192, help="tokens per document")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (a multiple of --seq)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--llm", choices=tuple(LLMS), default="qwen3-1.7b", help="the LLM's shape (bench/shapes.py)")
    p.add_argument("--small", action="store_true")
    p.add_argument("--profile", default="", help="write a torch profiler summary of the measured steps here")
    p.add_argument("--comm-report", action="store_true",
                   help="trace every rank's device kernels over the measured steps (lighter than --profile, which "
                        "does it too) and print exposed_comm_share, compute_s_per_step and rank_skew")
    p.add_argument("--sync-debug", choices=("", "warn", "error"), default="",
                   help="run the measured steps under torch.cuda.set_sync_debug_mode: a host sync raises (error) or "
                        "prints where it happened, once per place (warn)")
    p.add_argument("--busy", type=int, default=0,
                   help="after the timed steps, this many more queued behind a sleep: the GPU's busy fraction by "
                        "CUDA events (bench/busy.py)")
    p.add_argument("--flash-impl", default="",
                   help="activate this flash attention implementation first (torch.nn.attention."
                        "activate_flash_attention_impl, e.g. FA4): aten's flash ops, so varlen and SDPA's flash "
                        "backend, run it")
    p.add_argument("--routing", choices=MODES, default="uniform",
                   help="MoE LLMs: each token's experts drawn uniformly (a trained router's balance; bench/routing.py) "
                        "or the random-init router's own choice")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra loom config override")
    args = p.parse_args()
    use_routing(args.routing)
    device = init_distributed("auto")
    if args.flash_impl:
        activate(args.flash_impl)
    gpu = device.type == "cuda"
    per_step = args.tokens // args.seq
    total = args.warmup + args.steps
    cfg = load_config(None, (SMALL if args.small else LLMS[args.llm]) + TEXT_ONLY + [
        f"--train.dtype={'bf16' if gpu else 'fp32'}", f"--train.device={device.type}",
        f"--train.global_batch_size={per_step}", f"--data.tokens_per_microbatch={args.tokens}",
        f"--data.train_size={max(per_step, 64)}"] + [f"--{kv}" for kv in args.set])
    job = build_job(cfg, device)
    batches = GlobalBatches(documents(per_step * (total + args.busy), args.seq), per_step, cfg.data.seed)
    inputs = [step_inputs(batches, s, job.plan, job.cfg, job.tok, job.counters, device)
              for s in range(total + args.busy)]
    peak = peak_matmul_tflops(device)
    times, windows, profiler, first_frames = [], [], None, 0
    for s in range(total):
        if s == args.warmup and (args.profile or args.comm_report):
            profiler = start_profiler(gpu, full=bool(args.profile))  # every rank: comm_report gathers from each
        if s == args.warmup and args.sync_debug:
            print_sync_stacks()
            torch.cuda.set_sync_debug_mode(args.sync_debug)
        if gpu:
            torch.cuda.synchronize()
        t0, w0 = time.perf_counter(), time.time_ns()
        result = job.plan.train_step(job.model, job.optimizer, inputs[s], job.cfg, s)
        if gpu:
            torch.cuda.synchronize()
        if s >= args.warmup:
            times.append(time.perf_counter() - t0)
            windows.append((w0, time.time_ns()))  # the kernels' clock: comm_report clips them to the steps
        if s == 0:
            first_frames = compiled_frames()
    if args.sync_debug:
        torch.cuda.set_sync_debug_mode(0)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        if args.profile:
            write_profile(profiler, args.profile, sum(times), gpu)
    comm = comm_report(profiler, windows, device) if args.profile or args.comm_report else comm_summary([])
    step_s = sorted(times)[len(times) // 2]
    busy = {}
    if args.busy and gpu:
        busy = busy_report([lambda s=s: queue_step(job.plan, job.model, job.optimizer, inputs[s], job.cfg, s)
                            for s in range(total, total + args.busy)], step_s)
    flops = job.flops.step([args.seq] * per_step, {})
    tflops = flops / step_s / 1e12
    print(json.dumps({
        "bench": "llm", "model": "small" if args.small else args.llm, "seq": args.seq,
        "tokens_per_step": args.tokens,
        "device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
        "commit": os.environ.get("LOOM_COMMIT", ""), "overrides": args.set, "flash_impl": args.flash_impl,
        "sync_debug": args.sync_debug,
        "tokens_per_s": round(args.tokens / step_s, 1), "tflops": round(tflops, 1),
        "peak_matmul_tflops": round(peak, 1), "mfu": round(tflops / peak, 4) if gpu else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if gpu else None,
        "loss": round(result.loss, 4), "params_b": round(job.n_params / 1e9, 3),
        "routing": args.routing, "recompiles": compiled_frames() - first_frames, **busy,
        **comm,  # --comm-report or --profile: exposed communication and rank skew (bench/profiling.py)
        "step_s": round(step_s, 4), "step_s_min": round(min(times), 4), "step_s_max": round(max(times), 4),
        "step_times": [round(t, 4) for t in times],
    }))
    shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
