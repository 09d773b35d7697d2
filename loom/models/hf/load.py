"""Loading Hugging Face safetensors folders into loom modules, one tensor at a time.

A folder holds `config.json` and `model.safetensors`, or shards listed by `model.safetensors.index.json`.
Pickled weights (`*.bin`, `*.pt`, ...) are refused: loading them would run code from the file.

Every read goes through `HFWeights`: it checks each name and shape against the module from the files'
headers first, then reads one tensor — or one part of a tensor, a rank's shard — at a time through
`safetensors.safe_open`, so a large model never exists twice in memory, nor whole on a rank that holds part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from loom.models.audio import AudioEncoder
from loom.models.hf.fp8 import SCALES, dequantized, weight_blocks
from loom.models.hf.mapping import HFError, config_from_hf, kind_of
from loom.models.hf.whole import encoder_of, family_of, names as family_names, placeholder_ids
from loom.models.hf.names import fused_block, hf_name, join_fused, locate, skip_reason
from loom.models.hf.stacked import expert_names, is_stacked
from loom.models.init import give_storage
from loom.models.llm import DecoderLM, LLMConfig
from loom.models.multimodal import ModelConfig, build_model
from loom.models.projector import LinearProjector, Projector
from loom.models.qwen2_vision import Qwen2VisionEncoder
from loom.models.tile_rows import TileRows
from loom.models.vision import VisionEncoder
from loom.typed_config import ConfigError

MODULES = {"language": DecoderLM, "vision": VisionEncoder, "audio": AudioEncoder}
# what a folder may fill: a whole-model folder also has a projector (Qwen2-Audio's one matmul; LLaVA-OneVision's
# image_newline), and Qwen2-VL's tower is a vision module
PARTS = {**MODULES, "projector": Projector, "linear_projector": LinearProjector,
         "qwen2_vl_vision": Qwen2VisionEncoder, "tiles": TileRows}
KINDS = {"qwen2_vl_vision": "vision", "linear_projector": "projector"}
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


@dataclass
class LoadReport:
    loaded: dict[str, str] = field(default_factory=dict)  # loom name → checkpoint name
    skipped: dict[str, str] = field(default_factory=dict)  # checkpoint name → why it is not loaded
    computed: dict[str, str] = field(default_factory=dict)  # loom name → why it starts at its computed value


# ---------------------------------------------------------------- folders


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise HFError(f"{folder}: no config.json; a Hugging Face folder holds config.json and *.safetensors")
    return json.loads(path.read_text())


def config_from_folder(folder: str | Path, expect: str | None = None):
    """The loom config (LLMConfig / VisionConfig / AudioConfig) of a Hugging Face folder; of a whole-model
    folder's `expect` module."""
    hf = read_hf_config(folder)
    if expect is not None:
        _check_kind(hf, expect, str(folder))
    family = family_of(hf)
    if family is not None:
        if expect is None:
            raise HFError(f"{folder} holds a whole {family.FAMILY} model: name the module (language or "
                          f"{encoder_of(family)})")
        return family.configs(hf, str(folder), str(folder))[("language", encoder_of(family)).index(expect)]
    return config_from_hf(hf, str(folder), str(folder))


def _check_kind(hf: dict, expect: str, where: str) -> None:
    family = family_of(hf)
    if family is not None:
        if expect not in family.PREFIXES:
            raise HFError(f"{where}: a {family.FAMILY} folder has no {expect} module")
        return
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
    for kind, cls in PARTS.items():
        if isinstance(module, cls):
            return KINDS.get(kind, kind)
    known = [c.__name__ for c in PARTS.values()]
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


class HFWeights:
    """One module's tensors in a Hugging Face folder, checked against the module and then read box by box.

    Construction reads only the safetensors headers: every name the module needs must be there with its
    shape (missing, unexpected or mis-shaped tensors are one error naming each), so a wrong folder fails
    before any weight is read. `read(name, box)` then reads just that part of a tensor — a rank its shard."""

    def __init__(self, folder: str | Path, module: nn.Module, grown: tuple[str, ...] = ()) -> None:
        """`grown`: names whose first dim may be longer in the module than in the folder (a vocabulary grown
        for added tokens): `rows(name)` says how many the folder has."""
        self.where = where = str(folder)
        self.kind = kind = module_kind(module)
        hf = read_hf_config(folder)
        _check_kind(hf, kind, where)
        self.index = index = checkpoint_index(folder)
        self.blocks = weight_blocks(hf, where)  # block-quantized fp8 weights are read dequantized
        expected = expected_tensors(module)
        self.part = part = locate(kind, hf, index, where)
        prefix, family = part.prefix, part.hf.get("model_type", "")
        names = {n: hf_name(kind, n, prefix, family, part.head_prefix) for n in expected}
        # a router's selection bias the folder lacks (Qwen3-MoE has none; the job turned balancing on) starts at 0
        computed = {n: "a selection bias this folder's routers lack: starts at zero" for n, h in names.items()
                    if n.endswith(".gate.e_score_correction_bias") and h not in index}
        self.names = names = {n: h for n, h in names.items() if n not in computed}
        # stacked experts: one loom tensor [E, …] from E per-expert tensors (models/hf/stacked.py)
        self.stacked = {n: [hf_name(kind, e, prefix, family) for e in expert_names(n, expected[n][0])]
                        for n in expected if is_stacked(n)}
        # row blocks of one fused folder tensor (Qwen2-VL's qkv): several loom names share its name
        self.family = family
        self.fused = {n: b for n in names if (b := fused_block(n, family)) is not None}
        on_disk = {h for n, h in names.items() if n not in self.stacked}
        on_disk |= {h for parts in self.stacked.values() for h in parts}
        self.report = LoadReport(loaded=names, computed=computed)
        for name in index:
            reason = skip_reason(kind, name, part, len(getattr(module, "layers", ())))
            if self.blocks and name.endswith(SCALES) and name.removesuffix(SCALES) in index:
                reason = "fp8 block factors, applied when their weight is read"
            if reason and name not in on_disk:
                self.report.skipped[name] = reason
        missing = [f"{h} (for {n})" for n in names for h in self.stacked.get(n, [names[n]]) if h not in index]
        unexpected = sorted(set(index) - on_disk - set(self.report.skipped))
        if missing or unexpected:
            raise HFError(f"{where} does not match loom's {kind} module: missing tensors {missing}; "
                          f"unexpected tensors {unexpected}")
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}
        shapes = {n: self._shape(n) for n in names}
        self.shapes = shapes
        bad = [f"{names[n]}: checkpoint {list(shapes[n])} vs loom {n} {list(expected[n])}"
               for n in names if shapes[n] != expected[n] and not _grows(n in grown, shapes[n], expected[n])]
        if bad:
            self.close()
            raise HFError(f"{where}: shape mismatch for {bad}")

    def _shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in the folder; a stacked one's is (experts, *each expert's), all experts alike; a fused
        one's block's is its rows / blocks."""
        if name not in self.stacked:
            h = self.names[name]
            shape = tuple(self._open(self.index[h]).get_slice(h).get_shape())
            if name not in self.fused:
                return shape
            rows, rest = divmod(shape[0], self.fused[name][1])
            if rest:
                raise HFError(f"{self.where}: {h} {list(shape)} does not split into {self.fused[name][1]} equal row "
                              f"blocks, one of them loom's {name}")
            return (rows, *shape[1:])
        each = {tuple(self._open(self.index[h]).get_slice(h).get_shape()) for h in self.stacked[name]}
        if len(each) > 1:
            raise HFError(f"{self.where}: the experts of {name} differ in shape: {sorted(each)}")
        return (len(self.stacked[name]), *each.pop())

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def rows(self, name: str) -> int:
        return self.shapes[name][0]

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name` (the module's own name), or only its part `box` (one slice per dim)."""
        box = box or tuple(slice(0, n) for n in self.shapes[name])
        if name in self.stacked:  # the experts box[0] selects, each read only in its box
            return torch.stack([self._read(h, box[1:]) for h in self.stacked[name][box[0]]])
        if name in self.fused:  # the box within this block's rows of the fused tensor
            start = self.fused[name][0] * self.shapes[name][0]
            box = (slice(box[0].start + start, box[0].stop + start), *box[1:])
        return self._read(self.names[name], box)

    def folder_tensors(self, get) -> dict[str, torch.Tensor]:
        """The folder's tensors this module fills, by checkpoint name, from `get(loom name)`: a fused one (Qwen2-VL's
        qkv) its blocks joined in order."""
        return join_fused({n: (h, get(n)) for n, h in self.names.items()}, self.family)

    def read_stored(self, h: str) -> torch.Tensor:
        """The folder's tensor `h` (its checkpoint name) whole, whether or not the module loads it."""
        return self._read(h, ())

    def _read(self, h: str, box: tuple[slice, ...]) -> torch.Tensor:
        part = self._open(self.index[h]).get_slice(h)
        if self.blocks and h + SCALES in self.index:
            return dequantized(part, self._open(self.index[h + SCALES]).get_slice(h + SCALES), box, self.blocks)
        return part[box] if box else part[:]

    def _open(self, path: Path):
        if path not in self._handles:  # each shard file opened once
            self._handles[path] = self._stack.enter_context(safe_open(path, "pt"))
        return self._handles[path]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


def _grows(allowed: bool, have: tuple[int, ...], want: tuple[int, ...]) -> bool:
    return allowed and len(have) == len(want) and have[1:] == want[1:] and have[0] <= want[0]


def load_module(folder: str | Path, module: nn.Module, device: torch.device | str | None = None) -> LoadReport:
    """Fills `module` (DecoderLM, VisionEncoder or AudioEncoder; may live on `meta`) from a Hugging Face folder,
    one tensor at a time. The tensors deliberately not loaded (SigLIP's head, Whisper's decoder, ...) are
    listed in the returned report."""
    weights = HFWeights(folder, module)
    try:
        give_storage(module, device or "cpu")
        targets = module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name in weights.names:
                targets[name].copy_(weights.read(name))
    finally:
        weights.close()
    return weights.report


def build_pretrained(folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
                     ) -> nn.Module:
    """The loom module of a Hugging Face folder: built on `meta`, then filled tensor by tensor on `device`; of a
    whole-model folder (LLaVA, Qwen2-Audio), the MultimodalModel, its placeholder the folder's image or audio
    token."""
    hf = read_hf_config(folder)
    if family_of(hf) is not None:
        return _build_whole(folder, hf, device, dtype)
    cfg = config_from_hf(hf, str(folder), str(folder))
    with torch.device("meta"):
        module = MODULES[kind_of(hf, str(folder))](cfg)
    if dtype is not None:
        module.to(dtype)
    load_module(folder, module, device)
    return module


def _build_whole(folder: str | Path, hf: dict, device, dtype) -> nn.Module:
    family = family_of(hf)
    name = encoder_of(family)
    lm, encoder = family.configs(hf, str(folder), str(folder))
    with torch.device("meta"):
        model = build_model(lm, *((encoder, None) if name == "vision" else (None, encoder)),
                            placeholder_ids(family, hf))
    if dtype is not None:
        model.to(dtype)
    part = model.encoder(name)
    for module in (model.language, part.encoder, part.projector, part.tiles):
        if module is not None:  # tiles: only an anyres model's
            load_module(folder, module, device)
    return model


# ---------------------------------------------------------------- job configs


def resolve_pretrained_configs(m: ModelConfig) -> ModelConfig:
    """`m` with each module whose `hf` is set (the language model and the encoders in use) sized by its
    folder's config.json. Sizes written in the job config for such a module are replaced, not compared; the
    LLM's training keys (`LLMConfig.TRAINING_KEYS`: init, expert kernel, router balancing and losses) are kept."""
    if m.hf:
        m = _whole_model(m)
    changes = {}
    for name in ("language", *m.encoders):
        cfg = getattr(m, name, None)  # an unknown encoder name is config.check_values()'s to report
        if getattr(cfg, "hf", ""):
            try:
                new = config_from_folder(cfg.hf, expect=name)
            except HFError as e:
                raise HFError(f"model.{name}.hf = {cfg.hf!r}: {e}") from None
            if name == "language":
                new = dataclasses.replace(new, **{k: getattr(cfg, k) for k in LLMConfig.TRAINING_KEYS})
            changes[name] = new
    return dataclasses.replace(m, **changes)


def _whole_model(m: ModelConfig) -> ModelConfig:
    """`m` with its encoders and each module's `hf` set from `model.hf`, a folder holding the whole model."""
    hf = read_hf_config(m.hf)
    if family_of(hf) is None:
        raise HFError(f"model.hf = {m.hf!r}: model_type {hf.get('model_type')!r} is one module, not a whole model "
                      f"(loom loads {family_names()} there); set model.language.hf or model.<encoder>.hf instead")
    encoder = encoder_of(family_of(hf))
    both = [f"model.{name}.hf" for name in ("language", encoder) if getattr(m, name).hf not in ("", m.hf)]
    if both:
        raise HFError(f"model.hf = {m.hf!r} sets every module's folder, and {both} names another: remove one")
    return dataclasses.replace(m, encoders=[encoder], language=dataclasses.replace(m.language, hf=m.hf),
                               **{encoder: dataclasses.replace(getattr(m, encoder), hf=m.hf)})


def with_pretrained_sizes(m: ModelConfig) -> ModelConfig:
    """A job's [model] with each module whose `hf` folder is set sized by that folder's config.json; a folder
    that cannot be read is a ConfigError, reported before any rank builds a model."""
    if not m.hf and not any(getattr(getattr(m, name, None), "hf", "") for name in ("language", *m.encoders)):
        return m
    try:
        return resolve_pretrained_configs(m)
    except HFError as e:
        raise ConfigError(str(e)) from None
