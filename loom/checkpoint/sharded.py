"""Sharded checkpoints: every rank writes only its own shards, and any layout reads them back (reshard).

torch.distributed.checkpoint (DCP) plans and reshards; its Hugging Face storage format is safetensors files (each
shard's offsets in the file's JSON header), so loading runs no code from the file — DCP's default
FileSystemReader unpickles its metadata file. loom writes them with its own StreamingHFWriter
(writer.py: the same files, streamed, a rank's shards split over WRITE_THREADS files written at once) and reads
them with torch's HuggingFaceStorageReader, one thread per file up to READ_THREADS.
The state is tensors only, keyed as on one process:
  model.<name>                 parameters and persistent buffers (a tied weight under its first name)
  optim.<name>.exp_avg|exp_avg_sq|step   AdamW's moments and step count
Progress (step, config, world) goes to state.json, each rank's RNG state to rng-rank-R.safetensors.

A copy of a tied weight (a pipelined LLM's head copy of the embedding, parallel/tied.py) is saved and loaded
under the tied weight's name: its values equal it, DCP writes a shard held by several ranks once, and a
layout without the copy (or with it) reads the same file.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from loom.checkpoint.staging import AlreadyStaged, HostCopyPlanner, HostStaging
from loom.checkpoint.writer import StreamingHFWriter

MODEL, OPTIM = "model.", "optim."
STATE_FILE = "state.json"
WRITE_THREADS = READ_THREADS = 4  # files per rank, each written (read) by its own thread: bench/RESULTS.md, issue 50


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model: raised before any weight is overwritten."""


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """The second (third, …) state-dict name of a shared tensor → its first name, on the unsplit model (by
    identity: on `meta` every tensor has the same data_ptr)."""
    first, aliases = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = id(t)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def optimizer_list(optimizer) -> list[torch.optim.Optimizer]:
    """A torch optimizer, a ModuleOptimizers (one per module) or None (weights only)."""
    if optimizer is None:
        return []
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


class ShardedState:
    """This rank's part of the checkpointed state, keyed as above. `aliases`: tied names (tied_aliases of the
    unsplit model); when one rank holds both halves of a tie, the entry is saved once."""

    def __init__(self, model: nn.Module, optimizer, aliases: dict[str, str], saving: bool = False) -> None:
        self.model, self.optimizers, self.aliases = model, optimizer_list(optimizer), aliases
        if saving:  # an optimizer that has not stepped yet saves nothing: torch would step it with zero grads
            self.optimizers = [opt for opt in self.optimizers if opt.state]
        self.model_state = get_model_state_dict(model)
        # on a fresh optimizer this creates zero moments (torch's _init_optim_state), the shapes a load fills
        self.optim_state = get_optimizer_state_dict(model, self.optimizers) if self.optimizers else {"state": {}}
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in self.model_state.items():
            self._add(MODEL, name, "", t)
        for name, state in self.optim_state["state"].items():
            for field, t in state.items():
                self._add(OPTIM, name, "." + field, torch.as_tensor(t))

    def _add(self, prefix: str, name: str, suffix: str, t: torch.Tensor) -> None:
        self.tensors.setdefault(prefix + self.aliases.get(name, name) + suffix, t)  # a tie's second half: once

    def forget_optimizer_state_not_in(self, saved: dict) -> None:
        """Parameters with no optimizer state at all in the checkpoint: AdamW had not stepped them yet (they had
        no gradient so far, e.g. an encoder whose inputs have not occurred), so they get none after the load
        either (the optimizers' state is replaced by what `apply` sets, not merged with the fresh zeros).
        A parameter with some of its fields saved is left to the coverage check."""
        for name, state in list(self.optim_state["state"].items()):
            keys = [OPTIM + self.aliases.get(name, name) + "." + field for field in state]
            if keys and not any(k in saved for k in keys):
                del self.optim_state["state"][name]
                for k in keys:
                    self.tensors.pop(k, None)

    def apply(self) -> None:
        """After a load into `tensors`: back into the model and the optimizers (DCP loads DTensors in place;
        the setters make it hold for every kind of state). Both halves of a tie on one rank get the value
        saved under the tie's name, each its own tensor (AdamW updates its state in place)."""
        used: set[int] = set()

        def value(key: str) -> torch.Tensor:
            t = self.tensors[key]
            if id(t) in used:
                return t.clone()
            used.add(id(t))
            return t

        weights = {name: value(MODEL + self.aliases.get(name, name)) for name in self.model_state}
        set_model_state_dict(self.model, weights)
        if self.optimizers:
            for name, state in self.optim_state["state"].items():
                for field in state:
                    state[field] = value(OPTIM + self.aliases.get(name, name) + "." + field)
            # not strict: a parameter AdamW has not stepped has no entry (forget_optimizer_state_not_in)
            set_optimizer_state_dict(self.model, self.optimizers, self.optim_state,
                                     options=StateDictOptions(strict=False))


class PendingSave:
    """A save whose shards may still be being written (`run.async_save`): `finish` waits for this rank's
    files, then (collective) writes state.json on rank 0 — the mark of a complete folder."""

    def __init__(self, path: Path, future, step: int, extra: dict) -> None:
        self.path, self.future, self.step, self.extra = path, future, step, extra

    def finish(self) -> Path:
        if self.future is not None:
            self.future.result()
        if _distributed():
            dist.barrier()  # every rank's files are written before the folder is declared complete
        if not _distributed() or dist.get_rank() == 0:
            world = dist.get_world_size() if _distributed() else 1
            info = {"step": self.step, "world_size": world, **self.extra}
            (self.path / STATE_FILE).write_text(json.dumps(info, indent=2, default=str))
        return self.path


def begin_save(path: str | Path, model: nn.Module, optimizer, aliases: dict[str, str], step: int, extra: dict,
               async_group: dist.ProcessGroup | None = None, run_async: bool = False,
               threads: int = WRITE_THREADS, staging: HostStaging | None = None) -> PendingSave:
    """Collective: every rank writes its shards (and its RNG state) into `path`; `PendingSave.finish`
    completes the folder. `run_async`: the shards are copied to host memory now (`staging`'s buffers, reused
    from save to save; a fresh HostStaging when none is given) and written from there by a background thread
    while training goes on (dcp.async_save), its collectives on `async_group` (a gloo group of every rank: the
    training's own groups stay the main thread's). `threads`: files per rank, written at once."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if _distributed() else 0
    save_file(_rng_state(), path / f"rng-rank-{rank}.safetensors")
    state = ShardedState(model, optimizer, aliases, saving=True)
    writer = StreamingHFWriter(str(path), save_distributed=_distributed(), threads=threads)
    with _quiet_single_process():
        if run_async:
            staging = staging if staging is not None else HostStaging()
            host = staging.stage(state.tensors)  # the only blocking part: one copy of each shard
            future = dcp.async_save(state.tensors, storage_writer=writer, planner=HostCopyPlanner(host),
                                    process_group=async_group, async_stager=AlreadyStaged(),
                                    no_dist=not _distributed())
            staging.in_flight = future
        else:
            dcp.save(state.tensors, storage_writer=writer, no_dist=not _distributed())
            future = None
    return PendingSave(path, future, step, extra)


def load_sharded(path: str | Path, model: nn.Module, optimizer, aliases: dict[str, str]) -> dict:
    """Loads `path` into this rank's shards of the model (and optimizer, when given), whatever the layout it
    was saved under; returns state.json. Names, shapes and complete coverage are checked on every rank
    before anything is read into the model."""
    path = Path(path)
    info = read_state(path)
    state = ShardedState(model, optimizer, aliases)
    saved = saved_metadata(path)
    state.forget_optimizer_state_not_in(saved)
    check_against(path, saved, state.tensors)
    with _quiet_single_process():
        dcp.load(state.tensors, storage_reader=_reader(path), no_dist=not _distributed())
    state.apply()
    rng = path / f"rng-rank-{dist.get_rank() if _distributed() else 0}.safetensors"
    world = dist.get_world_size() if _distributed() else 1
    if info.get("world_size") == world and rng.is_file():  # another world size: ranks do not map one to one
        _set_rng_state(load_file(rng))
    return info


def _reader(path: Path) -> HuggingFaceStorageReader:
    """torch's reader, one thread per file (up to READ_THREADS) where this torch's reader takes a thread count."""
    if "thread_count" in inspect.signature(HuggingFaceStorageReader.__init__).parameters:
        return HuggingFaceStorageReader(str(path), thread_count=READ_THREADS)
    return HuggingFaceStorageReader(str(path))


def read_state(path: Path) -> dict:
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{path} is not a complete loom checkpoint: no {STATE_FILE} (an interrupted save "
                              f"leaves a .tmp folder; a complete one has {STATE_FILE})")
    return json.loads((path / STATE_FILE).read_text())


def saved_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    """Every saved tensor's global shape, dtype and chunks, read from the safetensors headers."""
    try:
        return dict(HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata)
    except Exception as e:  # a truncated or foreign file: safetensors names the problem, we name the folder
        raise CheckpointError(f"{path}: cannot read the shard files' headers: {e}") from None


def check_against(path: Path, saved: dict[str, TensorStorageMetadata], wanted: dict[str, torch.Tensor]) -> None:
    """Every wanted tensor is saved with the same global shape, and its saved chunks cover it (a missing
    shard file leaves a hole)."""
    missing = sorted(set(wanted) - set(saved))
    if missing:
        raise CheckpointError(f"{path} does not hold {len(missing)} tensor(s) of this model, e.g. {missing[:5]} "
                              f"(a checkpoint of another model, or a missing shard file)")
    for key, t in wanted.items():
        meta = saved[key]
        if tuple(meta.size) != tuple(t.shape):
            raise CheckpointError(f"{path}: {key} is saved as {tuple(meta.size)}, the model has {tuple(t.shape)}")
        covered = sum(math.prod(c.sizes) for c in meta.chunks)
        if covered < math.prod(meta.size):
            raise CheckpointError(f"{path}: the shard files hold {covered} of {key}'s {math.prod(meta.size)} "
                                  f"elements (a missing shard file?)")


def read_one(path: Path, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
    """One saved tensor whole, on one process (DCP reads only that tensor's chunks)."""
    tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
    with _quiet_single_process():
        dcp.load({key: tensor}, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    return tensor


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process whenever no process group exists, which is what we asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(saved: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])
