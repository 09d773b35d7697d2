"""AdamW with decoupled weight decay on matrices only, warmup + cosine schedule, global-norm clipping."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from loom.config import TrainConfig


def build_optimizer(module: nn.Module, cfg: TrainConfig, lr_scale: float = 1.0) -> torch.optim.AdamW:
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]  # norms, biases and gains are not decayed
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "lr_scale": lr_scale},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": lr_scale},
    ]
    fused = bool(params) and all(p.is_cuda for p in params)  # one kernel per step instead of ~10 passes
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None)


class ModuleOptimizers:
    """One AdamW per trained module (keyed by module name), each on the shared schedule times the module's
    lr_scale. Frozen modules get none. Steps, zeroing and the lr go to all of them together."""

    def __init__(self, model: nn.Module, modules: list[str], cfg: TrainConfig) -> None:
        self.by_module = {
            name: build_optimizer(model.get_submodule(name), cfg, getattr(cfg, name).lr_scale)
            for name in modules
            if not getattr(cfg, name).freeze
        }

    def __iter__(self):
        return iter(self.by_module.values())

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: st for opt in self for p, st in opt.state.items()}

    def step(self) -> None:
        for opt in self:
            fused_step(opt)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, dict]:
        return {name: opt.state_dict() for name, opt in self.by_module.items()}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        if set(state) != set(self.by_module):
            raise ValueError(f"optimizer state for modules {sorted(state)}; this job trains {sorted(self.by_module)}")
        for name, opt in self.by_module.items():
            opt.load_state_dict(state[name])


class _FusedLists:
    """One fused AdamW's tensor lists, per param group, kept between steps: its parameters, moments and step
    counts (the gradients are read anew each step); a DTensor's as its local shard (AdamW is elementwise, so a
    shard's update is the whole tensor's, and the kernel runs once on plain tensors instead of through DTensor's
    dispatch). Valid while the optimizer keeps the same state and groups (a checkpoint load replaces both)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.groups = opt.param_groups
        self.lists = []
        self.first_moments = []  # per group, the optimizer's own exp_avg tensors: what valid() checks against
        for g in opt.param_groups:
            st = [opt.state[p] for p in g["params"]]
            self.first_moments.append([s["exp_avg"] for s in st])
            self.lists.append((g, [_local(p) for p in g["params"]], [_local(s["exp_avg"]) for s in st],
                               [_local(s["exp_avg_sq"]) for s in st], [s["step"] for s in st]))

    def valid(self, opt: torch.optim.Optimizer) -> bool:
        """The same groups and, per parameter, the same state tensors (a load puts new ones in place)."""
        state = opt.state
        return self.groups is opt.param_groups and all(
            len(moments) == len(g["params"]) and all(state[p]["exp_avg"] is m for p, m in zip(g["params"], moments))
            for moments, g in zip(self.first_moments, opt.param_groups))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (`to_local()` would make a new view on every call), else `t`."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _lean(opt: torch.optim.Optimizer) -> bool:
    """An AdamW this path takes: fused, fp32 parameters (or DTensor shards) of one device, no amsgrad,
    maximize, differentiable or tensor lr, every parameter's state made (after its first step)."""
    if type(opt) is not torch.optim.AdamW:
        return False
    params = [p for g in opt.param_groups for p in g["params"]]
    return bool(params) and all(
        g.get("fused") and not g.get("amsgrad") and not g.get("maximize") and not g.get("differentiable")
        and not isinstance(g["lr"], torch.Tensor) for g in opt.param_groups) and all(
        p.dtype == torch.float32 and p.device == params[0].device and len(opt.state.get(p, ())) >= 3
        for p in params)


def _global_step_hooks() -> bool:
    from torch.optim import optimizer as torch_optimizer

    return bool(torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)


def lean_everywhere(optimizer) -> bool:
    """Every AdamW of the job takes fused_step's own path: under a layout, the grad-norm's clip and skip can then
    stay on the device too (torch's AdamW over DTensors would not take them). The lists fused_step keeps answer
    once they exist; `_lean`'s walk over every parameter runs only before."""
    return all(lists.valid(opt) if (lists := getattr(opt, "_loom_fused_lists", None)) is not None else _lean(opt)
               for opt in optimizer)


def fused_step(opt: torch.optim.Optimizer) -> None:
    """`opt.step()`, the same kernels and arguments, without AdamW.step's per-parameter Python on every step.

    On one GPU the step's tail is host-bound: the device finishes the backward before the host has walked
    AdamW's setup over ~1,000 parameters (about 2 ms per module's optimizer, bench/RESULTS.md round 7), and it
    idles until the fused kernel is queued. Here the lists of parameters, moments and step counts are built once
    and only the gradients are read each step; then, as torch's fused AdamW does for one device and dtype:
    step counts + 1, one `_fused_adamw_` per group with the optimizer's `grad_scale` / `found_inf` (the clip and
    skip of `clip_in_optimizer`), the counts taken back where `found_inf` is set; DTensors through their local
    shards. Anything else (the first step, which makes the state; a missing gradient; non-fused): `opt.step()`."""
    lists = getattr(opt, "_loom_fused_lists", None)
    if lists is None or not lists.valid(opt):
        _make_state(opt)
        seen = (id(opt.state), len(opt.state))  # checked once per state: not every step of a layout's optimizer
        if getattr(opt, "_loom_not_lean", None) == seen or not _lean(opt):
            opt._loom_not_lean = seen
            opt.step()
            return
        lists = opt._loom_fused_lists = _FusedLists(opt)
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or _global_step_hooks():
        opt.step()  # hooks: torch's own step runs them
        return
    grad_scale, found_inf = getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None)
    todo = []
    for g, params, exp_avgs, exp_avg_sqs, steps in lists.lists:
        grads = [p.grad for p in g["params"]]
        if any(x is None for x in grads):  # torch skips a parameter without a gradient: so does this step
            keep = [i for i, x in enumerate(grads) if x is not None]
            params, grads, exp_avgs, exp_avg_sqs, steps = ([xs[i] for i in keep] for xs in
                                                           (params, grads, exp_avgs, exp_avg_sqs, steps))
        todo.append((g, params, [_local(x) for x in grads], exp_avgs, exp_avg_sqs, steps))
    with torch.autograd.profiler.record_function("loom.fused_step"):
        for g, params, grads, exp_avgs, exp_avg_sqs, steps in todo:
            if not params:
                continue
            beta1, beta2 = g["betas"]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=g["lr"],
                                beta1=beta1, beta2=beta2, weight_decay=g["weight_decay"], eps=g["eps"],
                                maximize=False, grad_scale=grad_scale, found_inf=found_inf)
            if found_inf is not None:
                torch._foreach_sub_(steps, [found_inf] * len(steps))


def _make_state(opt: torch.optim.Optimizer) -> None:
    """A fused AdamW's state for each parameter that has none, as torch's first step makes it (a step count on the
    parameter's device, zero moments): its first step can then take fused_step's own path too. torch's step
    would also do, but not over one group mixing DTensors and plain tensors (a replicated module under TP holds
    both: TP splits the matrices only), which its fused kernel refuses."""
    if type(opt) is not torch.optim.AdamW or not all(g.get("fused") for g in opt.param_groups):
        return
    for g in opt.param_groups:
        for p in g["params"]:
            if not opt.state.get(p):
                opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=_local(p).device),
                                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def freeze_modules(model: nn.Module, modules: list[str], cfg: TrainConfig) -> None:
    for name in modules:
        if getattr(cfg, name).freeze:
            model.get_submodule(name).requires_grad_(False)


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


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients as one vector, over every shard and replica: DTensor gradients are grouped by
    mesh and reduced by DTensor (sharded dims summed, replicated dims counted once); plain ones are local."""
    device = params[0].device if params else torch.device("cpu")
    return _grad_norm_sq(params, device).sqrt().cpu()


def _grads_by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Gradients grouped so that one foreach call (or DTensor op) can take each group."""
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p.grad)
    return list(by_mesh.values())


@dataclass(frozen=True)
class GradNormShare:
    """This rank's part of the one global grad norm. A module's squared norm is complete on every rank of one
    of its pipeline stages (DTensor reduces it over the stage's dp, cp and tp), so exactly one rank per stage
    adds it to a single world sum — colocated or not, pipelined or not, each module counted once."""

    modules: tuple[str, ...]  # every module of the job, in one order: the positions of the summed vector
    hosted: frozenset[str]  # the modules this rank holds (it takes part in their norm's reductions)
    adds: frozenset[str]  # the hosted modules whose squared norm this rank adds (dp = cp = tp = 0)


def clip_and_check(model: nn.Module, max_norm: float, share: GradNormShare | None = None) -> tuple[float, bool]:
    """Global grad norm (before clipping) and whether it is finite; clips only when finite and max_norm > 0.
    `share` (under a layout): one world all-reduce of the per-module squared norms and of a not-finite count,
    so every rank takes the same decision even where copies of a gradient differ (a module's tp ranks each
    reduce their own copy of the gradients of weights TP does not split: a NaN in one copy would split the
    ranks) and across disjoint module grids (the lr stays in lockstep)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if share is None:
        norm = float(global_grad_norm(params))
        finite = math.isfinite(norm)
    else:
        sq = dict.fromkeys(share.modules, 0.0)
        for name in share.modules:
            if name in share.hosted:  # every rank of the module: the norm's reduction is a collective
                sq[name] = float(global_grad_norm(counted_once(model.get_submodule(name)))) ** 2
        not_finite = float(not all(math.isfinite(v) for v in sq.values()))
        summed = reduce_values([v if n in share.adds else 0.0 for n, v in sq.items()] + [not_finite],
                               dist.ReduceOp.SUM, None)
        norm = math.sqrt(sum(summed[:-1])) if math.isfinite(sum(summed[:-1])) else math.inf
        finite = summed[-1] == 0 and math.isfinite(norm)
    if finite and max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for grads in _grads_by_mesh(params):
            torch._foreach_mul_(grads, coef)  # a few launches, not one per parameter
    return norm, finite


def clip_in_optimizer(model: nn.Module, optimizer, max_norm: float,
                      share: GradNormShare | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused AdamW: the global grad norm, the clip and the skip stay on the device, so nothing waits for the host
    before the optimizer step. The clip coefficient reaches AdamW as `grad_scale` (its one pass divides each
    gradient by 1/coef: no separate multiply over every gradient) and a non-finite norm as `found_inf` (AdamW then
    changes nothing, its step count included). Under a layout (`share`) the per-module squared norms and the
    not-finite count are summed over the world on the device, as clip_and_check sums them on the host. Returns
    (norm, finite), on the device."""
    params = [p for p in model.parameters() if p.grad is not None]
    device = next(iter(model.parameters())).device  # a DTensor's: its local shard's
    if share is None:
        norm = _grad_norm_sq(params, device).sqrt()
        finite = torch.isfinite(norm)
    else:
        sq = {n: _grad_norm_sq(counted_once(model.get_submodule(n)), device)
              for n in share.modules if n in share.hosted}
        zero = torch.zeros((), dtype=torch.float64, device=device)
        not_finite = sum(((~torch.isfinite(v)).double() for v in sq.values()), zero)
        summed = torch.stack([sq[n] if n in share.adds else zero for n in share.modules] + [not_finite])
        dist.all_reduce(summed)  # the default group: the world
        norm = summed[:-1].sum().sqrt()
        finite = (summed[-1] == 0) & torch.isfinite(norm)
    clip = finite & (norm > max_norm) if max_norm > 0 else torch.zeros_like(finite)
    scale = torch.where(clip, (norm + 1e-6) / max_norm, 1.0).float()  # = 1 / clip_and_check's coef
    for opt in optimizer:
        opt.grad_scale, opt.found_inf = scale, (~finite).float()
    return norm, finite


def _grad_norm_sq(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """global_grad_norm's square on the device (float64): DTensor norms reduced over their meshes, no host sync."""
    total = None
    for grads in _grads_by_mesh(params):
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2
        total = norm if total is None else total + norm
    return total if total is not None else torch.zeros((), dtype=torch.float64, device=device)


def fused_everywhere(optimizer) -> bool:
    """Every AdamW of the job is the fused one (all its parameters on CUDA): it takes grad_scale and found_inf."""
    return all(g.get("fused") for opt in optimizer for g in opt.param_groups)


def counted_once(module: nn.Module) -> list[nn.Parameter]:
    """`module`'s parameters with gradients, less its copies of a weight held elsewhere too (a pipelined LLM's
    head copy of the tied embedding, parallel/tied.py: the same gradient as the embedding on stage 0)."""
    copies = {id(module.get_parameter(name)) for name in getattr(module, "tied_copies", {})}
    return [p for p in module.parameters() if p.grad is not None and id(p) not in copies]


def reduce_values(values: list[float], op, group: dist.ProcessGroup | None) -> list[float]:
    """Host numbers reduced elementwise over `group` (None: the world), in float64."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"  # NCCL reduces only device tensors
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()
