"""Initial values of a model's tensors, each a function of (seed, its name) only.

A job builds its model on the `meta` device, applies the layout, and only then gives each rank storage for
its shards (loom/parallel/materialize.py). So no tensor can be drawn from one global random stream in
construction order — that order, and which tensors a rank holds, change with the layout. Instead each
parameter is drawn whole from a generator seeded by (seed, its one-process name), and a rank keeps its part:
every layout, and the one-process reference, start from the same weights.

The rules are torch's own defaults (nn.Linear / Conv: U(±1/√fan_in); nn.Embedding: N(0, 1); norms: ones and
zeros), except that the LLM's linear and embedding weights are N(0, init_std) with zero biases, as Llama and
Qwen initialise them.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn

from loom.models.experts import Experts
from loom.models.layers import RMSNorm
from loom.models.router import Router


def name_seed(seed: int, name: str) -> int:
    """A generator seed from (seed, name); stable across processes and Python runs (unlike hash())."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_value(name: str, owner: nn.Module, attr: str, shape: torch.Size, seed: int, device: torch.device,
                  llm_std: float | None) -> torch.Tensor:
    """The whole initial tensor `owner.<attr>` (one-process name `name`), fp32 on `device`. `llm_std`: the
    LLM's init_std when the tensor belongs to the LLM, else None. The same (seed, name, device type) always
    gives the same values."""
    if isinstance(owner, (RMSNorm, nn.LayerNorm)):
        return torch.ones(shape, device=device) if attr == "weight" else torch.zeros(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(name_seed(seed, name))
    out = torch.empty(shape, device=device)
    if llm_std is not None and isinstance(owner, (nn.Linear, nn.Embedding)):
        return out.normal_(0.0, llm_std, generator=gen) if attr == "weight" else out.zero_()
    if llm_std is not None and isinstance(owner, (Router, Experts)):  # every tensor a weight (gate_proj, …)
        return out.normal_(0.0, llm_std, generator=gen)
    if isinstance(owner, nn.Embedding):
        return out.normal_(0.0, 1.0, generator=gen)
    if isinstance(owner, (nn.Linear, nn.Conv1d, nn.Conv2d)):
        bound = 1.0 / math.sqrt(math.prod(owner.weight.shape[1:]))  # fan_in: in_features × kernel size (global shape)
        return out.uniform_(-bound, bound, generator=gen)
    raise TypeError(f"{name}: no initialisation rule for a {type(owner).__name__}.{attr}; add one to "
                    f"loom/models/init.py::initial_value")


def give_storage(module: nn.Module, device: torch.device | str) -> None:
    """Real (uninitialised) storage for a `meta` module on `device`, its tied parameters still tied and its
    computed buffers (rotary frequencies, sinusoid tables) rebuilt. No-op for a module that has storage."""
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return
    first: dict[int, str] = {}
    ties = []  # (alias name, first name)
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((n, first[id(p)]))
        first.setdefault(id(p), n)
    # a plain parameter gets a new object per alias: re-tie (DTensors are swapped in place)
    module.to_empty(device=device)
    for alias, name in ties:
        owner, _, attr = alias.rpartition(".")
        if module.get_parameter(alias) is not module.get_parameter(name):
            setattr(module.get_submodule(owner), attr, module.get_parameter(name))
    reset_buffers(module)


def reset_buffers(module: nn.Module) -> None:
    """Recomputes every computed buffer: each module that holds one says how (`reset_buffers`)."""
    with torch.no_grad():
        for m in module.modules():
            if hasattr(m, "reset_buffers"):
                m.reset_buffers()
