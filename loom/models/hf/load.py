"""Loading Hugging Face safetensors folders into loom modules, one tensor at a time.

A folder holds `config.json` and `model.safetensors`, or shards listed by `model.safetensors.index.json`.
Pickled weights (`*.bin`, `*.pt`, ...) are refused: loading them would run code from the file.

The only loading path reads each tensor on its own through `safetensors.safe_open`, after every name and
shape has been checked against the module; a module built on the `meta` device is materialised first, so a
large model never exists twice in memory. `select(name, tensor_slice)` lets a caller read part of a tensor
(a tensor-parallel rank its shard: `tensor_slice[start:end]`); the result must have the shape of the
module's own tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from safetensors import safe_open

from loom.models.audio import AudioEncoder
from loom.models.hf.mapping import HFError, config_from_hf, detect_prefix, hf_name, kind_of, skip_reason
from loom.models.layers import rope_inv_freq
from loom.models.llm import DecoderLM
from loom.models.vision import VisionEncoder

if TYPE_CHECKING:
    from loom.config import ModelConfig

MODULES = {"language": DecoderLM, "vision": VisionEncoder, "audio": AudioEncoder}
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
Select = Callable[[str, object], torch.Tensor]  # (loom name, safetensors slice) → the tensor to copy in


@dataclass
class LoadReport:
    loaded: dict[str, str] = field(default_factory=dict)  # loom name → checkpoint name
    skipped: dict[str, str] = field(default_factory=dict)  # checkpoint name → why it is not loaded


# ---------------------------------------------------------------- folders


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise HFError(f"{folder}: no config.json; a Hugging Face folder holds config.json and *.safetensors")
    return json.loads(path.read_text())


def config_from_folder(folder: str | Path, expect: str | None = None):
    """The loom config (LLMConfig / VisionConfig / AudioConfig) of a Hugging Face folder."""
    hf = read_hf_config(folder)
    if expect is not None:
        _check_kind(hf, expect, str(folder))
    return config_from_hf(hf, str(folder), str(folder))


def _check_kind(hf: dict, expect: str, where: str) -> None:
    kind = kind_of(hf, where)
    if kind != expect:
        raise HFError(f"{where}: holds the {kind} model {hf['model_type']!r}, not a model for the {expect} module")


def checkpoint_index(folder: str | Path) -> dict[str, Path]:
    """Every tensor name of the folder's safetensors files → the file holding it (headers only are read)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFError(f"{folder} is not a folder")
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        index = {name: folder / file for name, file in weight_map.items()}
        absent = sorted({str(p.name) for p in index.values() if not p.is_file()})
        if absent:
            raise HFError(f"{folder}: model.safetensors.index.json lists shards that are missing: {absent}")
        return index
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED_SUFFIXES)
        if pickled:
            raise HFError(
                f"{folder} holds only pickled weights {pickled}; loom loads safetensors only (unpickling can run "
                f"arbitrary code). Convert them once, e.g. with transformers: "
                f"Model.from_pretrained(folder).save_pretrained(out, safe_serialization=True)"
            )
        raise HFError(f"{folder}: no *.safetensors files")
    index: dict[str, Path] = {}
    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if name in index:
                    raise HFError(f"{folder}: tensor {name!r} is in both {index[name].name} and {path.name}")
                index[name] = path
    return index


# ---------------------------------------------------------------- modules


def module_kind(module: nn.Module) -> str:
    for kind, cls in MODULES.items():
        if isinstance(module, cls):
            return kind
    known = [c.__name__ for c in MODULES.values()]
    raise HFError(f"{type(module).__name__} has no Hugging Face mapping; loom maps {known}")


def expected_tensors(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """name → shape of every tensor a checkpoint must provide: parameters (a tied one under its first name)
    and persistent buffers. Works on `meta` modules (no data_ptr needed)."""
    names = {n: tuple(p.shape) for n, p in module.named_parameters()}  # first name of each shared parameter
    aliases = {n for n, _ in module.named_parameters(remove_duplicate=False)} - set(names)
    for n, t in module.state_dict(keep_vars=True).items():
        if n not in names and n not in aliases:
            names[n] = tuple(t.shape)
    return names


def load_module(folder: str | Path, module: nn.Module, select: Select | None = None,
                device: torch.device | str | None = None) -> LoadReport:
    """Fills `module` (DecoderLM, VisionEncoder or AudioEncoder; may live on `meta`) from a Hugging Face
    folder. Missing, unexpected or mis-shaped tensors are errors naming every one of them; the tensors that
    are deliberately not loaded (SigLIP's head, Whisper's decoder, ...) are listed in the returned report."""
    where = str(folder)
    kind = module_kind(module)
    hf = read_hf_config(folder)
    _check_kind(hf, kind, where)
    index = checkpoint_index(folder)
    expected = expected_tensors(module)
    prefix = detect_prefix(kind, index, where)
    names = {n: hf_name(kind, n, prefix) for n in expected}
    report = LoadReport(loaded=names)
    for name in index:
        reason = skip_reason(kind, name, prefix, hf)
        if reason and name not in names.values():
            report.skipped[name] = reason
    missing = [f"{h} (for {n})" for n, h in names.items() if h not in index]
    unexpected = sorted(set(index) - set(names.values()) - set(report.skipped))
    if missing or unexpected:
        raise HFError(f"{where} does not match loom's {kind} module: missing tensors {missing}; "
                      f"unexpected tensors {unexpected}")
    with _open_files() as open_file:
        if select is None:
            shapes = {n: tuple(open_file(index[h]).get_slice(h).get_shape()) for n, h in names.items()}
            _check_shapes(where, names, shapes, expected)
        materialize(module, device)
        targets = module.state_dict(keep_vars=True)
        got = {}
        with torch.no_grad():
            for n, h in names.items():
                f = open_file(index[h])
                value = f.get_tensor(h) if select is None else select(n, f.get_slice(h))
                got[n] = tuple(value.shape)
                if got[n] == expected[n]:
                    targets[n].copy_(value)
        _check_shapes(where, names, got, expected)
    return report


def _check_shapes(where: str, names: dict, shapes: dict, expected: dict) -> None:
    bad = [f"{names[n]}: checkpoint {list(shapes[n])} vs loom {n} {list(expected[n])}"
           for n in names if shapes[n] != expected[n]]
    if bad:
        raise HFError(f"{where}: shape mismatch for {bad}")


@contextlib.contextmanager
def _open_files():
    """A function path → open safetensors handle; each shard is opened once and closed at the end."""
    handles, stack = {}, contextlib.ExitStack()

    def open_file(path: Path):
        if path not in handles:
            handles[path] = stack.enter_context(safe_open(path, "pt"))
        return handles[path]

    with stack:
        yield open_file


def materialize(module: nn.Module, device: torch.device | str | None = None) -> None:
    """Gives a `meta` module real (uninitialised) storage, keeping tied parameters tied and recomputing the
    buffers a checkpoint does not hold. No-op for a module that already has storage."""
    tensors = [*module.parameters(), *module.buffers()]
    if not any(t.is_meta for t in tensors):
        return
    first: dict[int, str] = {}
    ties = []  # (alias name, first name)
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((n, first[id(p)]))
        first.setdefault(id(p), n)
    module.to_empty(device=device or "cpu")  # gives every alias its own storage: re-tie below
    for alias, name in ties:
        owner, _, attr = alias.rpartition(".")
        setattr(module.get_submodule(owner), attr, module.get_parameter(name))
    _rebuild_buffers(module)


def _rebuild_buffers(module: nn.Module) -> None:
    persistent = set(module.state_dict(keep_vars=True))
    rebuilt = set()
    if isinstance(module, DecoderLM):
        c = module.cfg
        with torch.device(module.rotary.inv_freq.device):
            module.rotary.inv_freq = rope_inv_freq(c.dim_per_head, c.rope_theta, c.rope_scaling)
        rebuilt.add("rotary.inv_freq")
    unknown = [n for n, _ in module.named_buffers() if n not in persistent and n not in rebuilt]
    if unknown:
        raise RuntimeError(f"{type(module).__name__}: no rule to recompute non-persistent buffers {unknown} "
                           f"after materialising from meta; add one to loom/models/hf/load.py::_rebuild_buffers")


def build_pretrained(folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                     select: Select | None = None) -> nn.Module:
    """The loom module of a Hugging Face folder: built on `meta`, then filled tensor by tensor on `device`."""
    hf = read_hf_config(folder)
    cfg = config_from_hf(hf, str(folder), str(folder))
    with torch.device("meta"):
        module = MODULES[kind_of(hf, str(folder))](cfg)
    if dtype is not None:
        module.to(dtype)
    load_module(folder, module, select, device)
    return module


def make_module(cls: type[nn.Module], cfg, pretrained: bool = True) -> nn.Module:
    """`cls(cfg)`, loaded from the Hugging Face folder `cfg.hf` when that is set and `pretrained` (built on
    `meta` first: no random initialisation, no second copy); the `make` of loom.models.multimodal.build_model."""
    if not (pretrained and cfg.hf):
        return cls(cfg)
    with torch.device("meta"):
        module = cls(cfg)
    load_module(cfg.hf, module)
    return module


# ---------------------------------------------------------------- job configs


def resolve_pretrained_configs(m: ModelConfig) -> ModelConfig:
    """`m` with each module whose `hf` is set (the language model and the encoders in use) sized by its
    folder's config.json. Sizes written in the job config for such a module are replaced, not compared."""
    changes = {}
    for name in ("language", *m.encoders):
        cfg = getattr(m, name, None)  # an unknown encoder name is validate()'s to report
        if getattr(cfg, "hf", ""):
            try:
                new = config_from_folder(cfg.hf, expect=name)
            except HFError as e:
                raise HFError(f"model.{name}.hf = {cfg.hf!r}: {e}") from None
            if name == "language":
                new.init_std = cfg.init_std  # not an architecture field
            changes[name] = new
    return dataclasses.replace(m, **changes)
