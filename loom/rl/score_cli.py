"""`loom score CONFIG --data FILE --out DIR [--checkpoint CKPT]`: every conversation of FILE scored under the
config's layout (one process, or each rank of a torchrun launch), written by rank 0 to DIR/scores.jsonl in
FILE's order: per sample its target token ids, their logprobs, the entropy at each, and the top-k
(`[score] top_k`, `temperature`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from loom.checkpoint.read import CheckpointWeights
from loom.config import ConfigError, JobConfig
from loom.rl.score import score_samples
from loom.train.build import build_job


def run_score(cfg: JobConfig, out_dir: str, checkpoint: str | None, device: torch.device | None) -> Path:
    """Scores cfg.data.heldout's conversations (the CLI sets it to --data); returns the file written."""
    if not cfg.data.sources:
        raise ConfigError("loom score reads conversations (the JSONL format of data.sources): this config trains "
                          "on built-in tasks; set data.sources to the training files")
    weights = CheckpointWeights(checkpoint) if checkpoint else None
    job = build_job(cfg, device, weights=weights)
    samples = job.data.heldout
    scores = score_samples(job.plan, job.model, samples, job.cfg, job.tok, job.counters, job.device,
                           cfg.score.top_k, cfg.score.temperature)
    path = Path(out_dir) / "scores.jsonl"
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for i, (sample, s) in enumerate(zip(samples, scores)):
                f.write(json.dumps({"index": i, "where": sample.where, "targets": s.targets, "logprobs": s.logprobs,
                                    "entropy": s.entropy, "top_k_ids": s.top_k_ids,
                                    "top_k_logits": s.top_k_logits}) + "\n")
        print(f"loom score: {len(scores)} samples → {path}")
    return path
