"""`loom verify`: the configured layout against the one-process reference, step by step.

Both start from the same weights (every rank builds the model from the same seed and keeps an unsharded
copy as the reference), read the same global batches (the layout its dp share, the reference all of it)
and take K optimizer steps. Per step it compares the mean loss, the global grad norm, and every module's
post-step weights (max |w - w_ref| over the module / max |w_ref| over the module).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from loom.config import JobConfig
from loom.data.tokenizer import ByteTokenizer
from loom.train.build import (
    build_batches,
    build_datasets,
    build_job_model,
    collate,
    resolve_device,
    setup_parallel,
    step_batch,
    token_counters,
)
from loom.train.checkpoint import gather_full_weights
from loom.train.optim import ModuleOptimizers
from loom.train.step import StepBatch, StepComms, train_step

DEFAULT_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}


@dataclass
class StepCheck:
    step: int
    loss: float
    ref_loss: float
    grad_norm: float
    ref_grad_norm: float
    weight_diff: dict[str, float]  # module → max relative difference of its post-step weights
    tolerance: float

    @property
    def loss_diff(self) -> float:
        return abs(self.loss - self.ref_loss) / max(abs(self.ref_loss), 1e-12)

    @property
    def grad_norm_diff(self) -> float:
        return abs(self.grad_norm - self.ref_grad_norm) / max(abs(self.ref_grad_norm), 1e-12)

    @property
    def passed(self) -> bool:
        return max(self.loss_diff, self.grad_norm_diff, *self.weight_diff.values()) <= self.tolerance


def verify(cfg: JobConfig, steps: int, tolerance: float | None = None, device: torch.device | None = None,
           console: Console | None = None) -> list[StepCheck]:
    tolerance = DEFAULT_TOLERANCE[cfg.train.dtype] if tolerance is None else tolerance
    device = device or resolve_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    tok = ByteTokenizer()
    model = build_job_model(cfg, tok).to(device)
    reference = copy.deepcopy(model)  # same weights, never parallelised, fp32
    counters = token_counters(reference)
    plan = setup_parallel(model, cfg, device)
    modules = [*model.encoder_names, "language"]
    optimizer, ref_optimizer = ModuleOptimizers(model, modules, cfg.train), ModuleOptimizers(reference, modules, cfg.train)
    train_set, _ = build_datasets(cfg)
    batches = build_batches(cfg, train_set, tok, counters)
    eager = dataclasses.replace(cfg.train, compile=False)  # the reference is plain eager PyTorch
    checks = []
    for step in range(steps):
        mine = step_batch(batches, step, plan, cfg, tok, counters, device)
        full = StepBatch.of(collate(batches.shard(step), cfg, tok).to(device))
        r = train_step(model, optimizer, mine, cfg.train, step, plan.comms, plan.bridges)
        ref = train_step(reference, ref_optimizer, full, eager, step, StepComms())
        diffs = weight_differences(full_weights(model, plan.distributed), reference)
        checks.append(StepCheck(step + 1, r.loss, ref.loss, r.grad_norm, ref.grad_norm, diffs, tolerance))
    if plan.is_logger:
        (console or Console(width=170)).print(report(checks, cfg, plan))
    return checks


def full_weights(model: torch.nn.Module, distributed: bool) -> dict[str, torch.Tensor]:
    return gather_full_weights(model, to_rank0=False) if distributed else model.state_dict()


def weight_differences(weights: dict[str, torch.Tensor], reference: torch.nn.Module) -> dict[str, float]:
    """Per module: max |w - w_ref| over all its tensors, relative to the largest |w_ref| in the module.
    (Per tensor, a zero-initialised bias makes any fp32 reduction-order noise look huge after Adam's first
    normalised step; the module's scale is what a real error must be measured against.)"""
    diff: dict[str, float] = {}
    scale: dict[str, float] = {}
    for name, ref in reference.state_dict().items():
        module = name.split(".", 1)[0]
        got = weights[name].to(ref.device, ref.dtype)
        diff[module] = max(diff.get(module, 0.0), float((got - ref).abs().max()))
        scale[module] = max(scale.get(module, 0.0), float(ref.abs().max()))
    return {m: diff[m] / max(scale[m], 1e-12) for m in diff}


def report(checks: list[StepCheck], cfg: JobConfig, plan) -> Table:
    where = "one process"
    if plan.topo is not None:
        layouts = ", ".join(f"{n} {g.layout.describe().split(' on ')[0]}" for n, g in plan.topo.grids.items())
        where = f"{dist.get_world_size()} ranks: {layouts}"
    table = Table(title=f"loom verify — {where} ({cfg.train.dtype}) vs one-process fp32 reference, "
                        f"tolerance {checks[0].tolerance:g} relative")
    for col in ("step", "loss", "ref loss", "Δ loss", "grad norm", "ref norm", "Δ norm"):
        table.add_column(col, justify="right")
    modules = list(checks[0].weight_diff)
    for m in modules:
        table.add_column(f"Δ {m}", justify="right")
    table.add_column("result")
    for c in checks:
        verdict = "[green]PASS" if c.passed else "[red]FAIL"
        table.add_row(str(c.step), f"{c.loss:.6f}", f"{c.ref_loss:.6f}", f"{c.loss_diff:.1e}", f"{c.grad_norm:.5f}",
                      f"{c.ref_grad_norm:.5f}", f"{c.grad_norm_diff:.1e}",
                      *(f"{c.weight_diff[m]:.1e}" for m in modules), verdict)
    return table
