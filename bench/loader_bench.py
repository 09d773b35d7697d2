"""How fast loom's loader prepares steps from a user's files, against what a GPU step consumes.

    python bench/loader_bench.py DIR [--workers 0 2 4] [--steps 30] [--global-batch 24]

Writes DIR once (when it has no data.jsonl): conversations shaped like the 2B benchmark's workload — one JPEG
of 224–448 px sides per sample (256–1024 patches of 14 px), a 2–6 s 44.1 kHz WAV in one sample of four
(decoded, resampled to 16 kHz, log-mel), 64–1024 words of text — and a byte-level BPE tokenizer with a
ChatML template. Then, for each worker count, it pulls `--steps` steps exactly as a rank of `loom train` does
(`StepPrefetcher` over `plan_step`: the global batch drawn and tokenised, microbatches planned, every image and
clip decoded — one rank holding every module with dp = 1, the most a rank ever decodes) with nothing else
running, and prints each step's wait (min / median / max) and samples/s and LLM tokens/s. The first step of
each row (workers starting) is left out. A loader faster than the GPU consumes stays off the critical path.
`--small` is the CPU form CI runs.

`--train N` (on a GPU) then trains the 2B workload's model (bench/mm_bench.py's sizes, bf16, eager, random
init, the tokenizer's vocabulary) on DIR's files for N steps with each worker count, one process: each step's
time (min / median / max, CUDA synchronised). With the loader off the critical path, workers > 0 give the
GPU's step time and workers = 0 adds the decoding to it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom.job import load_config  # noqa: E402
from loom.train.build import build_batches, build_job_model, token_counters  # noqa: E402
from loom.train.job_data import build_job_data, job_tokenizer, with_vocabulary  # noqa: E402
from loom.train.step_data import StepPrefetcher, plan_step  # noqa: E402

WORDS = ("the a cat dog red blue image shows small large three two one near far left right above below "
         "sound tone high low short long bright dark round square what is in this picture clip answer").split()
# one H200 on the 2B workload (bench/RESULTS.md, fixed-shape microbatches, 1 GPU, loom compiled)
GPU_TOKENS_PER_S = {"T = 4096": 20_096, "T = 16384": 26_180}


def make_data(out: Path, n: int, small: bool, seed: int = 0) -> None:
    """`n` conversations with a JPEG each and a WAV in one of four, and a tokenizer folder (see the docstring)."""
    import soundfile
    from PIL import Image

    spec = importlib.util.spec_from_file_location("make_tiny_vlm", ROOT / "examples" / "make_tiny_vlm.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)  # its BPE trainer and ChatML template; the corpus is its tasks' words
    tiny.write_tokenizer(out, ["digits", "shapes", "tones"])
    rng = np.random.default_rng(seed)
    (out / "media").mkdir(parents=True, exist_ok=True)
    sides, seconds, words = ((16, 32), (0.2, 0.4), (8, 32)) if small else ((224, 448), (2.0, 6.0), (64, 1024))
    lines = []
    for i in range(n):
        h, w = (int(rng.integers(sides[0], sides[1] + 1)) for _ in range(2))
        # smooth colours plus noise: JPEG decode costs what a photo of that size costs
        grid = np.stack(np.meshgrid(np.linspace(0, 1, w), np.linspace(0, 1, h)), -1)
        pixels = np.concatenate([grid, grid[..., :1] * grid[..., 1:]], -1) * 200 + rng.normal(0, 20, (h, w, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out / "media" / f"{i}.jpg", quality=90)
        content = [{"type": "image", "path": f"media/{i}.jpg"}]
        if i % 4 == 0:
            clip = rng.normal(0, 0.1, int(44_100 * rng.uniform(*seconds))).astype(np.float32)
            soundfile.write(out / "media" / f"{i}.wav", clip, 44_100)
            content.append({"type": "audio", "path": f"media/{i}.wav"})
        text = " ".join(rng.choice(WORDS, int(rng.integers(*words))))
        content.append({"type": "text", "text": "Describe it."})
        lines.append({"messages": [{"role": "user", "content": content},
                                   {"role": "assistant", "content": text}]})
    (out / "data.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def job(out: Path, global_batch: int, small: bool):
    """The config of a job on DIR's files: tiny modules (never run: only their token counts are used), the
    2B workload's patch size and image bound."""
    patch, grid = (4, 8) if small else (14, 32)
    return load_config(None, [
        f"--model.tokenizer={out / 'tokenizer'}", f'--data.sources=[{{path = "{out / "data.jsonl"}", weight = 1.0}}]',
        "--data.heldout_size=4", f"--train.global_batch_size={global_batch}", "--train.device=cpu",
        f"--model.vision.patch_size={patch}", f"--model.vision.position_grid={grid}",
        "--model.language.hidden_size=64", "--model.language.num_layers=1", "--model.language.num_heads=2",
        "--model.language.num_kv_heads=1", "--model.language.intermediate_size=64",
        "--model.vision.hidden_size=32", "--model.vision.num_layers=1", "--model.vision.num_heads=2",
        "--model.vision.intermediate_size=32", "--model.audio.hidden_size=32", "--model.audio.num_layers=1",
        "--model.audio.num_heads=2", "--model.audio.intermediate_size=32"])


def measure(cfg, workers: int, steps: int) -> dict:
    tok = job_tokenizer(cfg)
    cfg = with_vocabulary(cfg, tok)
    counters = token_counters(build_job_model(cfg, tok))  # on meta: shapes only
    data = build_job_data(cfg, tok, counters)
    batches = build_batches(cfg, data)
    shares = {name: (0, 1) for name in ("language", *counters)}
    plan = lambda s: plan_step(batches, s, cfg, tok, counters, shares, 1)  # noqa: E731
    ahead = StepPrefetcher(batches, plan, steps + 1, workers, cfg.data.prefetch_steps, pin=False)
    waits, samples, tokens = [], 0, 0
    try:
        for step in range(steps + 1):
            t0 = time.perf_counter()
            inputs = ahead.get(step) or plan(step)
            if step:  # the first: workers starting
                waits.append(time.perf_counter() - t0)
                samples, tokens = samples + len(inputs.indices), tokens + inputs.global_tokens
    finally:
        ahead.close()
    total = sum(waits)
    return {"workers": workers, "steps": steps, "samples_per_s": samples / total, "tokens_per_s": tokens / total,
            "tokens_per_sample": tokens / samples, "wait_s": [min(waits), statistics.median(waits), max(waits)]}


def train(cfg, workers: int, steps: int) -> dict:
    import dataclasses

    import torch

    from bench.shapes import AUDIO, LLM, VIT
    from loom.job import load_config as load
    from loom.train.trainer import Trainer

    sizes = [x for x in LLM if "vocab_size" not in x] + VIT + AUDIO  # the vocabulary: the tokenizer's
    base = dataclasses.asdict(cfg)
    cfg = load(None, [*sizes, f"--model.tokenizer={cfg.model.tokenizer}", "--train.device=cuda", "--train.dtype=bf16",
                      f'--data.sources=[{{path = "{base["data"]["sources"][0]["path"]}", weight = 1.0}}]',
                      "--data.heldout_size=4", f"--train.global_batch_size={cfg.train.global_batch_size}",
                      f"--data.workers={workers}", f"--train.steps={steps + 2}", "--run.tensorboard=false"])
    t = Trainer(cfg)
    times = []
    try:
        for step in range(steps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t.train_step()
            torch.cuda.synchronize()
            if step >= 2:  # the first two: workers starting, kernels warming up
                times.append(time.perf_counter() - t0)
    finally:
        t.prefetch.close()
    return {"train_workers": workers, "steps": steps, "step_s": [min(times), statistics.median(times), max(times)],
            "params_b": round(t.n_params / 1e9, 3)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--conversations", type=int, default=400)
    p.add_argument("--small", action="store_true", help="tiny images and clips (CI)")
    p.add_argument("--train", type=int, default=0, help="then train this many steps on a GPU per worker count")
    args = p.parse_args(argv)
    if not (args.dir / "data.jsonl").is_file():
        make_data(args.dir, args.conversations, args.small)
    cfg = job(args.dir, args.global_batch, args.small)
    rows = [measure(cfg, w, args.steps) for w in args.workers]
    print(f"loader: {args.steps} steps of {args.global_batch} samples after a warm-up step, one rank decoding all")
    print("| workers | samples/s | LLM tokens/s | tokens/sample | wait per step s (min / median / max) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workers']} | {r['samples_per_s']:,.1f} | {r['tokens_per_s']:,.0f} "
              f"| {r['tokens_per_sample']:,.0f} "
              f"| {' / '.join(f'{x:.3f}' for x in r['wait_s'])} |")
    for name, rate in GPU_TOKENS_PER_S.items() if not args.small else ():
        print(f"one H200, 2B workload, {name}: {rate:,} tokens/s; best row here: "
              f"{max(r['tokens_per_s'] for r in rows) / rate:.1f}× that")
    if args.train:
        trained = [train(cfg, w, args.train) for w in args.workers]
        print(f"training the 2B workload's model on these files, {args.global_batch} samples per step:")
        for r in trained:
            print(f"  workers {r['train_workers']}: step s {' / '.join(f'{x:.3f}' for x in r['step_s'])}")
        rows += trained
    for r in rows:
        print(json.dumps(r))
    return rows


if __name__ == "__main__":
    main()
