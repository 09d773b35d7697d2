"""`loom eval CHECKPOINT`: the held-out metrics of a saved checkpoint, on one process, after training.

Generation (exact match) runs here rather than under the training layout. The job is built by `build_job`, as
for training, from the checkpoint's own config, with the checkpoint as its weight source: the model is built
on `meta`, given storage on one device and filled tensor by tensor from the checkpoint's sharded files
(`step-N`), so no training rank ever holds a second whole model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from loom.checkpoint.read import CheckpointWeights
from loom.checkpoint.sharded import CheckpointError
from loom.config import JobConfig, from_dict
from loom.train.build import build_job
from loom.train.evaluate import evaluate


def checkpoint_config(weights: CheckpointWeights) -> JobConfig:
    if "config" not in weights.state:
        raise CheckpointError(f"{weights.path}/state.json has no config: the model it holds is unknown")
    return from_dict(JobConfig, weights.state["config"], "")


def eval_config(cfg: JobConfig) -> JobConfig:
    """The checkpoint's job, eager: generation's shapes change every token, which compile would retrace."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))


def evaluate_checkpoint(path: str | Path, device: torch.device | None = None) -> tuple[dict[str, float], int]:
    """Held-out token accuracy and exact match of the checkpoint at `path`, and the step it was saved at."""
    weights = CheckpointWeights(path)
    job = build_job(eval_config(checkpoint_config(weights)), device, weights=weights)
    metrics = evaluate(job.model, job.data.heldout, job.tok, job.device, job.cfg.train.eval_max_new_tokens,
                       job.cfg.model.attention)
    return metrics, int(weights.state.get("step", 0))
