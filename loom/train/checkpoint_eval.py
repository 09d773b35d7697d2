"""`loom eval CHECKPOINT`: the held-out metrics of a saved checkpoint, on one process, after training.

Generation (exact match) runs here rather than under the training layout: the model is built on `meta` from
the checkpoint's own config, given storage on one device and filled tensor by tensor from the checkpoint's
sharded files (`step-N`), so no training rank ever holds a second whole model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loom.checkpoint.read import CheckpointWeights
from loom.checkpoint.sharded import CheckpointError, tied_aliases
from loom.config import JobConfig, from_dict
from loom.models.init import give_storage
from loom.train.build import build_job_model, resolve_device, token_counters
from loom.train.job_data import build_job_data, job_tokenizer
from loom.train.evaluate import evaluate


def checkpoint_config(weights: CheckpointWeights) -> JobConfig:
    if "config" not in weights.state:
        raise CheckpointError(f"{weights.path}/state.json has no config: the model it holds is unknown")
    return from_dict(JobConfig, weights.state["config"], "")


def load_for_eval(path: str | Path, device: torch.device) -> tuple[torch.nn.Module, JobConfig]:
    """The checkpoint's model, whole, on `device`; every tensor it needs must be in the checkpoint."""
    weights = CheckpointWeights(path)
    cfg = checkpoint_config(weights)
    model = build_job_model(cfg, job_tokenizer(cfg))
    aliases = tied_aliases(model)
    targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in aliases}
    missing = sorted(set(targets) - set(weights.names))
    if missing:
        raise CheckpointError(f"{path}: holds no {missing[:5]}{' …' if len(missing) > 5 else ''} "
                              f"({len(missing)} of the {len(targets)} tensors its config's model has)")
    give_storage(model, device)
    targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in aliases}
    with torch.no_grad():
        for name, t in targets.items():
            t.copy_(weights.get(name))
    return model, cfg


def evaluate_checkpoint(path: str | Path, device: torch.device | None = None) -> tuple[dict[str, float], int]:
    """Held-out token accuracy and exact match of the checkpoint at `path`, and the step it was saved at."""
    device = device or resolve_device("auto")
    model, cfg = load_for_eval(path, device)
    tok = job_tokenizer(cfg)
    data = build_job_data(cfg, tok, token_counters(model))
    metrics = evaluate(model, data.heldout, tok, device, cfg.train.eval_max_new_tokens, cfg.model.attention)
    return metrics, int(CheckpointWeights(path).state.get("step", 0))
