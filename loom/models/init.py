"""Initial values of a model's tensors, each a function of (seed, its name) only.

A job builds its model on the `meta` device, applies the layout, and only then gives each rank storage for
its shards (loom/parallel/materialize.py). So no tensor can be drawn from one global random stream in
construction order — that order, and which tensors a rank holds, change with the layout. Instead each
parameter is drawn from generators seeded by (seed, its one-process name): a tensor of at most `DRAW_BLOCK`
elements in one draw, a larger one in blocks of whole rows (dim 0), block b from (seed, name, b); a rank draws
only the blocks its part overlaps (not the whole tensor: a DeepSeek-V3 stacked expert weight is 15 GB), and
every layout, and the one-process reference, start from the same weights. Given the rank's own tensor (`out`),
a block that lies wholly in its part is drawn where it goes, so a rank's start-up holds its shard plus at most one
block of rows (a block its part's edges cut: drawn whole, then copied) — not a second copy of the shard.

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


# elements one seeded draw covers at most: tensors up to this size (every one of the tiny test models') are one
# draw, as before blocks existed; a larger one is drawn in blocks of whole rows of about this size
DRAW_BLOCK = 1 << 24

Box = tuple[slice, ...]


def initial_value(name: str, owner: nn.Module, attr: str, shape: torch.Size, seed: int, device: torch.device,
                  llm_std: float | None, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The part `box` (one slice per dim; None: the whole) of the initial tensor `owner.<attr>` (one-process
    name `name`, whole shape `shape`), fp32 on `device`. `llm_std`: the LLM's init_std when the tensor belongs to
    the LLM, else None. The same (seed, name, device type) always gives the same values, whatever the box.
    `out`: a tensor of the part's shape to write the values into (returned), in place of a new one."""
    box = tuple(slice(0, n) for n in shape) if box is None else box
    part = tuple(b.stop - b.start for b in box)
    if out is None:
        out = torch.empty(part, device=device)
    # a target of another shape would be filled without complaint; one of another dtype would get other values than
    # the fp32 draw (which a block drawn apart, in fp32, holds): every layout must see the same
    elif tuple(out.shape) != part or out.dtype != torch.float32:
        raise RuntimeError(f"{name}: a part {part} of {tuple(shape)} written into a {out.dtype} tensor "
                           f"{tuple(out.shape)} (fp32 of the part's shape only)")
    if isinstance(owner, (RMSNorm, nn.LayerNorm)):
        return out.fill_(1.0) if attr == "weight" else out.zero_()
    if llm_std is not None and isinstance(owner, (nn.Linear, nn.Embedding)) and attr != "weight":
        return out.zero_()
    return _drawn(name, shape, box, seed, device, _rule(name, owner, attr, llm_std), out)


def _rule(name: str, owner: nn.Module, attr: str, llm_std: float | None):
    """How `owner`'s tensor is drawn: a function filling a tensor in place from a generator."""
    if llm_std is not None and isinstance(owner, (nn.Linear, nn.Embedding, Router, Experts)):
        return lambda t, gen: t.normal_(0.0, llm_std, generator=gen)  # Router / Experts: every tensor a weight
    if isinstance(owner, nn.Embedding):
        return lambda t, gen: t.normal_(0.0, 1.0, generator=gen)
    if attr == "image_newline":  # LLaVA-OneVision's row end (models/tile_rows.py), drawn as it draws it
        std = owner.image_newline.shape[-1] ** -0.5
        return lambda t, gen: t.normal_(0.0, std, generator=gen)
    if attr == "class_embedding":  # a CLIP tower's [CLS] row, drawn as CLIP draws it
        std = owner.class_embedding.shape[-1] ** -0.5
        return lambda t, gen: t.normal_(0.0, std, generator=gen)
    if isinstance(owner, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):  # Conv3d: Qwen2-VL's patch embedding
        bound = 1.0 / math.sqrt(math.prod(owner.weight.shape[1:]))  # fan_in: in_features × kernel size (global shape)
        return lambda t, gen: t.uniform_(-bound, bound, generator=gen)
    raise TypeError(f"{name}: no initialisation rule for a {type(owner).__name__}.{attr}; add one to "
                    f"loom/models/init.py::initial_value")


def _drawn(name: str, shape: torch.Size, box: Box, seed: int, device: torch.device, fill,
           out: torch.Tensor) -> torch.Tensor:
    """`box` of the tensor the blocks' draws make, written into `out`: only the blocks of rows the box overlaps
    are drawn; one that lies wholly in the box is drawn in place (a generator fills a contiguous view with the
    values it fills a new tensor of that shape with), one the box cuts into a block of its own, then copied."""
    row = math.prod(shape[1:])
    rows_per_block = max(1, DRAW_BLOCK // max(1, row))
    whole_rows = out.is_contiguous() and all(b.start == 0 and b.stop == n for b, n in zip(box[1:], shape[1:]))
    if not shape or shape[0] <= rows_per_block:  # one draw, the whole tensor
        if whole_rows and (not shape or (box[0].start == 0 and box[0].stop == shape[0])):
            fill(out, torch.Generator(device=device).manual_seed(name_seed(seed, name)))
            return out
        whole = torch.empty(shape, device=device)
        fill(whole, torch.Generator(device=device).manual_seed(name_seed(seed, name)))
        return out.copy_(whole[box])
    first, stop = box[0].start, box[0].stop
    for b in range(first // rows_per_block, -(-stop // rows_per_block)):
        lo, hi = b * rows_per_block, min(shape[0], (b + 1) * rows_per_block)
        gen = torch.Generator(device=device).manual_seed(name_seed(seed, f"{name}#{b}"))
        a, z = max(lo, first), min(hi, stop)  # the box's rows in this block
        if whole_rows and (a, z) == (lo, hi):
            fill(out[a - first : z - first], gen)
            continue
        block = torch.empty((hi - lo, *shape[1:]), device=device)
        fill(block, gen)
        out[a - first : z - first] = block[(slice(a - lo, z - lo), *box[1:])]
    return out


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
