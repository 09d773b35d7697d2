"""Multimodal training throughput: loom layouts side by side with a Hugging Face + FSDP2 baseline.

    torchrun --nproc-per-node=N bench/mm_bench.py --system loom --layout homogeneous --format thd
    torchrun --nproc-per-node=N bench/mm_bench.py --system loom --layout heterogeneous --format thd
    torchrun --nproc-per-node=N bench/mm_bench.py --system loom --layout homogeneous --format bshd
    torchrun --nproc-per-node=N bench/mm_bench.py --system hf

Workload (random init, fixed seed, the same samples for every contender): a Qwen2.5-1.5B-shaped LLM, a
SigLIP-so400m-shaped ViT (patch 14), a small Whisper-shaped audio encoder; images 224–448 px, text
64–1024 tokens, audio on one sample in four; three samples per GPU per step for every 4096 tokens of
`--seq`, packed into one sequence of `--seq` tokens per GPU.
Prints one JSON line (rank 0): real LLM tokens/s per GPU, TFLOP/s per GPU and MFU (bench/flops.py, against
an 8192³ bf16 matmul measured in the same run), peak memory, step time, padding fraction, and `recompiles`:
frames torch.compile compiled after the first step (0 with fixed shapes: `--set train.compile=true --set
data.tokens_per_microbatch=SEQ`, or `--format bshd`, whose rows are fixed to the workload's longest sample);
with experts, `expert_load`: per sparse layer, the tokens each expert received over the timed steps.
`--comm-report` (or `--profile`) adds, from a trace of every rank's kernels over the measured steps, the share of
the step in which only NCCL kernels ran and each rank's compute time per step (bench/profiling.py).
`--small` shrinks everything for a CPU smoke run (CI runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from bench.flops import flops_of, peak_matmul_tflops  # noqa: F401 (flops_of: tests/test_bench.py reads it here)
from bench.overlap import comm_summary
from bench.routing import MODES, use_routing
from bench.shapes import AUDIO, LLMS, VIT
from bench.profiling import comm_report, print_sync_stacks, start_profiler, write_profile, write_timeline
from bench.layout_workloads import WORKLOADS, workload_overrides
from bench.stage_timing import StageTiming
from bench.workload import SMALL, PackedSteps, ReplicaSweep, Shape
from loom.job import load_config
from loom.distributed import init_distributed, shutdown
from loom.parallel.compile import compiled_frames
from loom.topology import Topology

SMALL_MOE = ["--model.language.num_experts=8", "--model.language.moe_intermediate_size=32"]
SMALL_MODEL = ["--model.vision.patch_size=4", "--model.audio.num_features=16"]
SAMPLES_PER_4K = 3  # samples per GPU per step for each 4096 tokens of --seq


def layout_overrides(layout: str, world: int) -> list[str]:
    if layout == "homogeneous" or world == 1:
        return []
    # the LLM split over tp 2 (sequence parallel), the encoders data parallel over every GPU: fan-in
    return ["--layout.language.tp=2", "--layout.language.sequence_parallel=true", "--data.pad_to_multiple=2"]


def padded_overrides(args, shape: Shape) -> list[str]:
    """bshd: every microbatch [rows, S] with S = data.padded_length (a later `--set data.padded_length=` wins);
    64 is a multiple of every layout's sample multiple here."""
    if args.format != "bshd" or args.pad_to == "step":
        return []
    return [f"--data.padded_length={args.seq if args.pad_to == 'seq' else -(-shape.longest // 64) * 64}"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=("loom", "hf"), default="loom")
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="",
                   help="issue 51's workloads (bench/layout_workloads.py): data and model shape; --layout names a row")
    p.add_argument("--layout", default="homogeneous",
                   help="homogeneous or heterogeneous; with --workload, one of its rows (e.g. one-cp4, loom-cp4)")
    p.add_argument("--stage-timing", action="store_true",
                   help="pipelined LLM: time each stage's forward and backward (CUDA events) and report the bubble "
                        "against (p-1)/(m+p-1) (bench/stage_timing.py)")
    p.add_argument("--format", choices=("thd", "bshd"), default="thd")
    p.add_argument("--seq", type=int, default=0, help="tokens per GPU per step (default 4096, or the workload's)")
    p.add_argument("--pad-to", choices=("longest", "step", "seq"), default="longest",
                   help="padded (bshd) rows: fixed to the workload's longest possible sample (rounded up to 64), "
                        "to each step's longest (shapes change), or fixed to --seq tokens")
    p.add_argument("--adam", choices=("auto", "foreach"), default="auto",
                   help="foreach: the multi-kernel AdamW instead of the fused one loom picks on GPU (A/B)")
    p.add_argument("--llm", choices=tuple(LLMS), default="1.5b",
                   help="the LLM's shape (bench/shapes.py; 0.5b: encoder-heavy; moe: 16 experts, 2 active; moe128: "
                        "Qwen3-30B-A3B's layer, 128 experts, 8 active)")
    p.add_argument("--images", type=int, default=1, help="images per sample")
    p.add_argument("--per-gpu", type=int, default=0, help="samples per GPU per step (0: 3 per 4096 of --seq)")
    p.add_argument("--samples-of", type=int, default=0, metavar="N",
                   help="one GPU: the samples of an N-GPU row, its groups one per step (--steps and --warmup count "
                        "the N-GPU row's steps: N times as many run), so the two rows carry the same tokens")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--small", action="store_true")
    p.add_argument("--profile", default="", help="write a torch profiler summary of the measured steps here")
    p.add_argument("--timeline", default="",
                   help="with --profile or --comm-report: write this rank's device-busy intervals here ({rank} in "
                        "the path; bench/overlap.py reads them)")
    p.add_argument("--comm-report", action="store_true",
                   help="trace every rank's device kernels over the measured steps (lighter than --profile, which "
                        "does it too) and print exposed_comm_share, compute_s_per_step and rank_skew")
    p.add_argument("--sync-debug", choices=("", "warn"), default="",
                   help="warn: print where the measured steps sync with the host, once per place (stderr)")
    p.add_argument("--busy", type=int, default=0,
                   help="loom on one GPU: after the timed steps, this many more queued behind a sleep: the GPU's busy "
                        "fraction by CUDA events (bench/busy.py)")
    p.add_argument("--routing", choices=MODES, default="uniform",
                   help="MoE LLMs: each token's experts drawn uniformly (a trained router's balance; bench/routing.py) "
                        "or the random-init router's own choice")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra loom config override, e.g. --set parallel.reshard_after_forward=false")
    args = p.parse_args()
    use_routing(args.routing)
    device = init_distributed("auto")
    world = dist.get_world_size() if dist.is_initialized() else 1
    gpu = device.type == "cuda"
    if args.workload:  # the data and model shape are the workload's; the row's layout is its overrides
        w = WORKLOADS[args.workload]
        shape = w.small_shape if args.small else w.shape
        args.seq = args.seq or (w.small_seq if args.small else w.seq)
        per_gpu = args.per_gpu or (w.small_per_gpu if args.small else w.per_gpu)
        try:
            sizes = workload_overrides(args.workload, args.layout, args.small)
        except ValueError as e:
            p.error(str(e))
    else:
        if args.layout not in ("homogeneous", "heterogeneous"):
            p.error(f"--layout {args.layout!r} without --workload: homogeneous or heterogeneous")
        args.seq = args.seq or 4096
        shape = dataclasses.replace(SMALL if args.small else Shape(), images=args.images)
        per_gpu = args.per_gpu or max(1, SAMPLES_PER_4K * args.seq // 4096)
        if args.small:
            sizes = SMALL_MODEL + (SMALL_MOE if args.llm.startswith("moe") else [])
        else:
            sizes = LLMS[args.llm] + VIT + AUDIO
        sizes += layout_overrides(args.layout, world)
    if args.samples_of > 1 and world > 1:
        p.error(f"--samples-of {args.samples_of}: a one-GPU row's option (this run has {world} ranks)")
    if args.samples_of > 1:
        workload = ReplicaSweep(shape, args.samples_of, per_gpu, args.seq)
        args.steps, args.warmup = args.steps * args.samples_of, args.warmup * args.samples_of
    else:
        workload = PackedSteps(shape, world, per_gpu, args.seq)
    cfg = load_config(None, sizes + [
        f"--data.format={args.format}", f"--train.dtype={'bf16' if gpu else 'fp32'}",
        *padded_overrides(args, shape),
        f"--train.global_batch_size={world * per_gpu}", "--data.train_size=1000000",
    ] + [f"--{kv}" for kv in args.set], world_size=world)
    if args.system == "loom":
        from bench.contender_loom import LoomContender as Contender
    else:
        from bench.contender_hf import HFContender as Contender
    contender = Contender(cfg, device, workload)
    timing = None
    if args.stage_timing:
        pp = Topology.plan(cfg, world).placement.layouts["language"].pp
        if pp < 2 or args.system != "loom":
            p.error(f"--stage-timing times a pipelined loom LLM; this row has layout.language.pp = {pp}")
        timing = StageTiming(gpu, pp, cfg.train.microbatches, cfg.parallel.pp_schedule)
    if args.adam == "foreach":
        for group in contender.optimizer.param_groups:  # before the first step: its state follows suit
            group.update(fused=None, foreach=True)
    peak = peak_matmul_tflops(device)
    total = args.warmup + args.steps
    busy_steps = args.busy if gpu and args.system == "loom" and world == 1 else 0
    inputs = [contender.inputs(step) for step in range(total + busy_steps)]  # data prepared before timing
    times, windows = [], []
    profiler = None
    load = getattr(getattr(getattr(contender, "plan", None), "comms", None), "expert_load", None)  # MoE LLM
    for step in range(total):
        if step == args.warmup and load is not None:
            load.keep_totals()  # each expert's tokens over the timed steps, summed on the device
        if step == args.warmup and (args.profile or args.comm_report):
            profiler = start_profiler(gpu, full=bool(args.profile))  # every rank: comm_report gathers from each
        if step == args.warmup and timing is not None:
            timing.measuring = True
        if step == args.warmup and args.sync_debug:
            print_sync_stacks()
            torch.cuda.set_sync_debug_mode(args.sync_debug)
        if gpu:
            torch.cuda.synchronize()
        t0, w0 = time.perf_counter(), time.time_ns()
        loss = contender.step(inputs[step], step)
        if gpu:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            windows.append((w0, time.time_ns()))
        if step == 0:
            first_frames = compiled_frames()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if profiler is not None:
        profiler.__exit__(None, None, None)
        if args.profile and (rank == 0 or "{rank}" in args.profile):  # "{rank}" in the path: every rank writes
            write_profile(profiler, args.profile.format(rank=rank), sum(times), gpu)
        if args.timeline:
            write_timeline(profiler, args.timeline.format(rank=rank), rank, windows)
    comm = comm_report(profiler, windows, device) if args.profile or args.comm_report else comm_summary([])
    step_s = sorted(times)[len(times) // 2]
    if comm.get("compute_s_per_step"):  # each GPU's idle share (non-colocated: the encoder GPUs' against the LLM's)
        comm["idle_share_per_rank"] = [round(max(0.0, 1 - c / step_s), 4) for c in comm["compute_s_per_step"]]
    busy = {}
    if busy_steps:
        from bench.busy import busy_report, queue_step
        c = contender
        busy = busy_report([lambda s=s: queue_step(c.plan, c.model, c.optimizer, inputs[s], c.cfg, s)
                            for s in range(total, total + busy_steps)], step_s)
    measured = range(args.warmup, total)
    bubble = timing.report() if timing is not None else {}  # every rank: it gathers
    real_tokens = sum(contender.llm_tokens(s) for s in measured) / len(measured)
    flops = sum(contender.flops(s) for s in measured) / len(measured)
    tflops = flops / step_s / world / 1e12
    recompiles = max_over_ranks(compiled_frames() - first_frames, device)
    peak_mib = max_over_ranks(round(torch.cuda.max_memory_allocated(device) / 2**20), device) if gpu else 0
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps({
            "bench": "mm", "system": args.system, "layout": args.layout if args.system == "loom" else "fsdp2",
            "format": args.format if args.system == "loom" else "bshd", "gpus": world, "seq": args.seq,
            "samples_per_gpu": per_gpu, "samples_of": args.samples_of or None,
            "pad_to": args.pad_to if args.format == "bshd" or args.system == "hf" else None, "adam": args.adam,
            "padded_length": cfg.data.padded_length or None,
            "workload": args.workload or None, "llm": None if args.workload else args.llm,
            "images_per_sample": shape.images, "images_per_sample_max": max(shape.images, shape.images_max),
            **placement_of(contender),
            "device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
            "step_s": round(step_s, 4), "tokens_per_s_per_gpu": round(real_tokens / step_s / world, 1),
            "tflops_per_gpu": round(tflops, 1), "peak_matmul_tflops": round(peak, 1),
            "mfu": round(tflops / peak, 4) if gpu else None,
            "peak_mem_gib": peak_mib / 1024 if gpu else None,  # the fullest GPU (non-colocated ranks differ)
            "padding_fraction": _round(contender.padding_fraction(), 4), "loss": round(float(loss), 4),
            "encoder_padding": getattr(contender, "encoder_padding", dict)(),  # filler rows under row budgets
            "params_b": round(contender.n_params / 1e9, 3), "overrides": args.set,
            "routing": args.routing,
            "recompiles": recompiles,  # frames compiled after the first step, the most on any rank
            "expert_load": expert_load_report(load),  # per MoE layer, the timed steps' tokens per expert
            **bubble,  # --stage-timing: each pipeline rank's bubble against (p-1)/(m+p-1)
            **busy,  # --busy: the GPU's busy fraction by CUDA events
            **comm,  # --comm-report or --profile: exposed communication and rank skew (bench/profiling.py)
            "step_s_min": round(min(times), 4), "step_s_max": round(max(times), 4),
            "step_times": [round(t, 4) for t in times],  # every measured step: a median hides slow ones
        }))
    shutdown()


def placement_of(contender) -> dict:
    """loom's placement and each module's layout (the HF baseline has neither)."""
    topo = getattr(getattr(contender, "plan", None), "topo", None)
    if topo is None:
        return {}
    return {"placement": topo.placement.kind, "layouts": {n: g.layout.describe() for n, g in topo.grids.items()}}


def expert_load_report(load, raw_up_to: int = 16) -> dict | None:
    """Each sparse layer's tokens per expert over the timed steps (all ranks'; a token counts once per expert
    it chose): `routed` their sum, `max_over_mean` and `min_over_mean` against a perfect balance, `busiest_share`
    the busiest expert's share of `routed`, `idle` experts with none, and `counts` when there are ≤ raw_up_to."""
    if load is None or load.totals is None:
        return None
    report = {}
    for layer, c in zip(load.layers, load.totals.cpu().tolist()):  # the one host read of the counts
        routed, mean = sum(c), sum(c) / len(c)
        report[str(layer)] = {"routed": round(routed), "max_over_mean": _round(max(c) / mean if mean else None, 3),
                              "min_over_mean": _round(min(c) / mean if mean else None, 3),
                              "busiest_share": _round(max(c) / routed if routed else None, 4),
                              "idle": sum(1 for n in c if n == 0),
                              **({"counts": [round(n) for n in c]} if len(c) <= raw_up_to else {})}
    return report


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def max_over_ranks(value: int, device: torch.device) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], device="cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # one rank's recompile stalls every rank under FSDP
    return int(t)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown after collectives (it sometimes aborts a rank at exit)
