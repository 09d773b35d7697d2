"""Single-process checkpoint: weights and optimizer state as safetensors, progress as JSON (nothing pickled).

Layout of a checkpoint folder:
  model.safetensors      parameters and persistent buffers, tied weights stored once
  optimizer.safetensors  AdamW moments keyed by parameter name ("<name>.exp_avg", ...)
  state.json             step and config (the lr is a function of the step)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from loom.checkpoint.sharded import optimizer_list
from loom.train.optim import GradNormShare

OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "step")


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without the second name of a shared (tied) tensor; safetensors refuses aliases."""
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():  # the tensors themselves: a tie is one object
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t.detach().contiguous()
    return out


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, extra: dict):
    """One-process model: writes the folder directly."""
    write_checkpoint(path, unique_state_dict(model), _optimizer_tensors(model, optimizer), step, extra)


def write_checkpoint(path: str | Path, weights: dict, optimizer_tensors: dict, step: int, extra: dict) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, path / "model.safetensors")
    save_file(optimizer_tensors, path / "optimizer.safetensors")
    (path / "state.json").write_text(json.dumps({"step": step, **extra}, indent=2, default=str))


def gather_full_weights(model: nn.Module, to_rank0: bool, spread: GradNormShare | None = None
                        ) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of an FSDP/TP model — collective: every rank calls it. `to_rank0`: only
    rank 0 receives them, on the CPU; otherwise every rank does, on its device. `spread`: when no rank holds
    every module whole (a pipelined LLM, non-colocated modules), which modules this rank reports for; they
    are then gathered on rank 0 (to_rank0 only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if spread is None:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=to_rank0))
    mine = {k: v.cpu() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}
    return gather_reported(mine, spread)


def gather_reported(tensors: dict, spread: GradNormShare) -> dict:
    """Rank 0 gets the entries of the modules each rank reports for (one rank per module stage; keys start
    with the module's name); an in-memory object collective, so nothing is unpickled from a file."""
    import torch.distributed as dist

    mine = {k: v for k, v in tensors.items() if k.split(".", 1)[0] in spread.adds}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if dist.get_rank() != 0:
        return {}
    return {k: v for part in parts for k, v in part.items()}


def save_sharded_as_full(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, names: set[str], step: int, extra: dict,
    spread: GradNormShare | None = None,
) -> None:
    """FSDP/TP model: gathers full tensors to rank 0 (collective: every rank calls it), which writes the same
    folder a one-process run writes, so export, evaluation and one-process resume read it unchanged.
    `names`: the model's unique state-dict names (tied aliases dropped), taken before parallelisation;
    `spread`: as in `gather_full_weights`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    weights = gather_full_weights(model, to_rank0=True, spread=spread)
    optim = get_optimizer_state_dict(
        model, optimizer_list(optimizer), options=StateDictOptions(full_state_dict=True, cpu_offload=spread is None)
    )
    moments = {
        f"{fqn}.{key}": torch.as_tensor(value).cpu().contiguous()
        for fqn, state in optim.get("state", {}).items()  # cpu_offload: empty off rank 0
        for key, value in state.items()
    }
    if spread is not None:
        moments = gather_reported(moments, spread)
    if dist.get_rank() == 0:
        # `names` keeps a tied weight once: a pipelined LLM's head copy of the embedding (equal to it) is dropped
        weights = {k: v.contiguous() for k, v in weights.items() if k in names}
        moments = {k: v for k, v in moments.items() if k.rsplit(".", 1)[0] in names}
        write_checkpoint(path, weights, moments, step, extra)
    dist.barrier()


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Loads weights (and optimizer moments) in place; returns state.json. Every missing or unexpected
    tensor is an error that names it."""
    path = Path(path)
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path} is not a loom checkpoint (no model.safetensors)")
    weights = load_file(path / "model.safetensors")
    expected = set(unique_state_dict(model))
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    model.load_state_dict(weights, strict=False)  # tied aliases are filled through their first name
    if optimizer is not None:
        _load_optimizer_tensors(model, optimizer, load_file(path / "optimizer.safetensors"))
    return json.loads((path / "state.json").read_text())


def _optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            out[f"{name}.{key}"] = torch.as_tensor(value).detach().contiguous()
    return out


def _load_optimizer_tensors(model: nn.Module, optimizer, tensors: dict) -> None:
    """`optimizer`: a torch optimizer or a ModuleOptimizers; each parameter's moments go to the one owning it."""
    owners = {id(p): opt for opt in optimizer_list(optimizer) for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        state = {k: tensors[f"{name}.{k}"].to(p.device) for k in OPTIMIZER_KEYS if f"{name}.{k}" in tensors}
        if state and id(p) in owners:
            owners[id(p)].state[p] = state
