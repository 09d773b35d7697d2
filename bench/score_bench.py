"""Scoring speed and memory (`loom score`'s computation, loom/rl/score.py): one process, a text-only job on the
Qwen3-1.7B shape (152K vocabulary), `--tokens` tokens per scoring batch, statistics over chunks of `--chunk`
tokens against the whole microbatch at once (`--chunk 0`).

    python bench/score_bench.py --tokens 16384 --chunk 1024
    python bench/score_bench.py --tokens 16384 --chunk 0

Prints one JSON line: scored tokens/s, peak GPU memory (and what the fp32 logits of the whole batch would
take), every pass's time. `--small` runs on CPU (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import loom.rl.score as score
from bench.llm_bench import SMALL, TEXT_ONLY, documents
from bench.shapes import QWEN3_1_7B
from loom.distributed import init_distributed, shutdown
from loom.job import load_config
from loom.train.build import build_job


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096, help="tokens per document")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per scoring batch (a multiple of --seq)")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per statistics chunk (0: the whole batch)")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--small", action="store_true")
    args = p.parse_args()
    device = init_distributed("auto")
    gpu = device.type == "cuda"
    per_batch = args.tokens // args.seq
    cfg = load_config(None, (SMALL if args.small else QWEN3_1_7B) + TEXT_ONLY + [
        f"--train.dtype={'bf16' if gpu else 'fp32'}", f"--train.device={device.type}",
        f"--train.global_batch_size={per_batch}", f"--data.train_size={max(per_batch, 64)}",
        f"--score.top_k={args.top_k}"])
    job = build_job(cfg, device)
    score.CHUNK_TOKENS = args.chunk or args.tokens
    docs = documents(per_batch, args.seq)
    times = []
    for i in range(args.passes + 1):  # the first pass warms up
        if gpu:
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        scores = score.score_samples(job.plan, job.model, docs, job.cfg, job.tok, job.counters, device,
                                     cfg.score.top_k, cfg.score.temperature)
        if gpu:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    scored = sum(len(s.targets) for s in scores)
    pass_s = sorted(times)[len(times) // 2]
    vocab = job.cfg.model.language.vocab_size
    print(json.dumps({
        "bench": "score", "model": "small" if args.small else "qwen3-1.7b", "tokens": args.tokens,
        "chunk": args.chunk, "top_k": args.top_k, "vocab": vocab,
        "device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
        "commit": os.environ.get("LOOM_COMMIT", ""),
        "scored_tokens_per_s": round(scored / pass_s, 1),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if gpu else None,
        "whole_fp32_logits_gib": round(args.tokens * vocab * 4 / 2**30, 2),
        "pass_s": round(pass_s, 4), "pass_s_min": round(min(times), 4), "pass_s_max": round(max(times), 4),
        "pass_times": [round(t, 4) for t in times],
    }))
    shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
