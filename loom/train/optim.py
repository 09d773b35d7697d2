"""AdamW with decoupled weight decay on matrices only, warmup + cosine schedule, global-norm clipping."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from loom.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]  # norms, biases and gains are not decayed
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warmup, then cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Sets the learning rate of optimizer step `step`; a pure function of the step, so resuming needs
    nothing but the step number."""
    lr = cfg.lr * lr_factor(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr


def clip_and_check(model: nn.Module, max_norm: float) -> tuple[float, bool]:
    """Global grad norm (before clipping) and whether it is finite; clips only when finite and max_norm > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0) if params else torch.tensor(0.0)
    finite = bool(torch.isfinite(norm))
    if finite and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)  # takes the parameters, scales their .grad
    return float(norm), finite
