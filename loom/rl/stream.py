"""Weight streaming: the policy's weights out in Hugging Face names, one whole tensor at a time, for an
inference engine (a sampler after each update).

`stream_weights(model, cfg)` returns the manifest first — every tensor's Hugging Face module, name, shape and
dtype, the same on every rank, so a receiver can allocate once — and then yields (module, HF name, tensor)
in manifest order on every rank. Each tensor is put together by the ranks that hold it (`full_tensor()` over
its module's tp × fsdp mesh, on its pipeline stage only) and broadcast from the lowest of them to the world;
no rank ever holds more than its shards and the one tensor in flight. The names and the set of tensors are
`loom export`'s (models/hf/export.py): projectors have no Hugging Face counterpart and are not streamed. One
exception: a sparse layer's routed experts stream as loom's stacked [E, …] tensors (`….mlp.experts.gate_proj`,
Mixtral's renames not applied), which export writes one per expert; a receiver slices expert e as row e.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from loom.models.hf.load import MODULES, expected_tensors
from loom.models.hf.names import EXPORT_PREFIXES, hf_name, names_family
from loom.models.multimodal import ModelConfig
from loom.parallel.tied import tied_copy_names


@dataclass(frozen=True)
class StreamedTensor:
    module: str  # language, vision, audio: the Hugging Face folder it belongs to
    name: str  # its Hugging Face name in that folder
    shape: tuple[int, ...]
    dtype: torch.dtype
    loom_name: str  # the one-process name in the loom model
    owner: int  # the rank that broadcasts it (0 on one process)


def stream_manifest(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, projectors: bool = False
                    ) -> list[StreamedTensor]:
    """What the stream will carry, in order; collective under torchrun (every rank says what it holds). With
    `projectors`, each encoder's projector follows, in loom's names (module "<encoder>.projector"): loom's own
    sampler needs them, and they have no Hugging Face counterpart."""
    twins = tied_copy_names(model)
    held = {n: tuple(t.shape) for n, t in sorted(model.state_dict().items()) if n not in twins}
    holders = [held]
    if dist.is_initialized():
        holders = [None] * dist.get_world_size()
        dist.all_gather_object(holders, held)
    owner, shapes = {}, {}
    for rank, names in reversed(list(enumerate(holders))):  # the lowest rank that holds a tensor sends it
        owner.update(dict.fromkeys(names, rank))
        shapes.update(names)
    out = []
    for kind in ["language", *cfg.encoders]:
        prefix = "language." if kind == "language" else f"{kind}.encoder."
        with torch.device("meta"):
            expected = expected_tensors(MODULES[kind](getattr(cfg, kind)))
        family = names_family(kind, getattr(cfg, kind))
        for name, shape in expected.items():
            out.append(StreamedTensor(kind, hf_name(kind, name, EXPORT_PREFIXES[kind], family), shape, dtype,
                                      prefix + name, owner[prefix + name]))
    for kind in cfg.encoders if projectors else ():
        prefix = f"{kind}.projector."
        out += [StreamedTensor(prefix[:-1], name[len(prefix):], shapes[name], dtype, name, owner[name])
                for name in sorted(shapes) if name.startswith(prefix)]
    return out


def stream_weights(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, projectors: bool = False
                   ) -> tuple[list[StreamedTensor], Iterator[tuple[StreamedTensor, torch.Tensor]]]:
    """(the manifest, then each of its tensors whole, cast to `dtype`, on every rank, one at a time)."""
    manifest = stream_manifest(model, cfg, dtype, projectors)
    return manifest, _tensors(model, manifest)


def _tensors(model: nn.Module, manifest: list[StreamedTensor]) -> Iterator[tuple[StreamedTensor, torch.Tensor]]:
    mine = model.state_dict()
    device = next(model.parameters()).device
    for entry in manifest:
        t = mine.get(entry.loom_name)
        if t is not None:  # every holder takes part in putting it together (a collective over its mesh)
            t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().to(entry.dtype, copy=True)
        if dist.is_initialized():
            if t is None:
                t = torch.empty(entry.shape, dtype=entry.dtype, device=device)
            dist.broadcast(t, src=entry.owner)
        yield entry, t
