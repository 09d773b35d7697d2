"""Sampling speed: loom's sampler (loom/rl/sampler.py: KV cache, prompts prefilled packed, decode batched)
against Hugging Face `generate` on the same LLM, weights and prompts, in one process.

    python bench/sample_bench.py                 # the 2B workload's LLM (Qwen2-1.5B shape), bf16, on the GPU
    python bench/sample_bench.py --small         # a tiny shape on CPU (CI)

The LLM is built by loom, exported with `loom export`'s writer and loaded by transformers, so both run the same
weights. Prompts: `--prompts` random-token prompts of 64–512 tokens, each sampled `--group` times (an RL
group), `--new` tokens each: neither stops early (no end-of-sequence), so both generate exactly the same number
of tokens. Temperature 1, top-p 1. Prints one JSON line per system: tokens/s, every repeat's seconds
(min / median / max) and peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from bench.shapes import LLM
from loom.data.sample import Sample
from loom.job import load_config
from loom.models.hf.export import export_module
from loom.models.multimodal import build_model
from loom.rl.sampler import Sampler, SamplingParams

SMALL = ["--model.language.hidden_size=64", "--model.language.num_layers=2", "--model.language.num_heads=4",
         "--model.language.num_kv_heads=2", "--model.language.intermediate_size=128",
         "--model.language.vocab_size=512", "--model.language.attention_bias=true"]


def prompts(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def timed(fn, repeats: int, device: torch.device) -> list[float]:
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true")
    args = p.parse_args()
    device = torch.device("cpu" if args.small else "cuda")
    dtype = torch.float32 if args.small else torch.bfloat16
    cfg = load_config(None, ["--model.encoders=[]", '--data.tasks=["sums"]', *(SMALL if args.small else LLM)])
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cfg.model.language, None, None, {}).to(dtype).eval()
    low, high = (8, 32) if args.small else (64, 512)
    rows = [p for p in prompts(args.prompts, low, high, cfg.model.language.vocab_size) for _ in range(args.group)]
    new = args.new if not args.small else min(args.new, 16)
    generated = len(rows) * new

    params = SamplingParams(max_new_tokens=new, temperature=1.0, top_p=1.0)
    for system, backend in (("loom", None), ("loom_compiled_decode", "aot_eager" if args.small else "inductor")):
        sampler = Sampler(model, eos_id=-1, pad_id=0, compile_backend=backend)  # no end: every row decodes `new`

        def loom_run():
            sampler.generate([Sample(r, [False] * len(r), [], []) for r in rows], params,
                             torch.Generator(device).manual_seed(0))

        loom_run()  # warm-up: lazy initialisation, the allocator's first blocks, the decode step's compile
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        report(system, timed(loom_run, args.repeats, device), generated, device, args)

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        export_module(model.language, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    longest = max(map(len, rows))
    ids = torch.zeros(len(rows), longest, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding: every row's next token at the same column
        ids[i, longest - len(r):] = torch.tensor(r, device=device)
        mask[i, longest - len(r):] = 1

    @torch.no_grad()
    def hf_run():
        hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                    max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

    hf_run()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    report("hf_generate", timed(hf_run, args.repeats, device), generated, device, args)


def report(system: str, seconds: list[float], generated: int, device: torch.device, args) -> None:
    """One JSON line; each system's warm-up call is not among `seconds`."""
    median = statistics.median(seconds)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    row = {"system": system, "prompts": args.prompts, "group": args.group,
           "new_tokens": generated // (args.prompts * args.group), "tokens_per_s": round(generated / median),
           "seconds": [round(s, 3) for s in seconds],
           "min_median_max": [round(min(seconds), 3), round(median, 3), round(max(seconds), 3)],
           "peak_gib": round(peak, 2), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    print(json.dumps(row))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
