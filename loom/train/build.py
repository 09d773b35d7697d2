"""Everything a job builds before its first step, shared by `loom train` and `loom verify`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.config import ConfigError, JobConfig
from loom.data.batch import Batch, pad_samples
from loom.data.format import TokenCounter, to_sample
from loom.data.loader import GlobalBatches
from loom.data.packing import pack_samples
from loom.data.sample import Sample
from loom.data.tasks import TaskDataset
from loom.data.tokenizer import ByteTokenizer
from loom.models.hf import make_module
from loom.models.multimodal import MultimodalModel, build_model
from loom.parallel import parallelize
from loom.topology import Topology
from loom.train.step import StepComms


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)


def build_job_model(cfg: JobConfig, tok: ByteTokenizer, pretrained: bool = True) -> MultimodalModel:
    """The job's model; a module whose `hf` folder is set loads its weights from there when `pretrained`
    (its sizes were already taken from that folder by load_config). Projectors start from random weights."""
    m = cfg.model
    return build_model(
        m.language,
        m.vision if "vision" in m.encoders else None,
        m.audio if "audio" in m.encoders else None,
        tok.placeholder_ids,
        make=functools.partial(make_module, pretrained=pretrained),
    )


def token_counters(model: MultimodalModel) -> dict[str, TokenCounter]:
    return {n: model.encoder(n).num_tokens for n in model.encoder_names}


def build_datasets(cfg: JobConfig) -> tuple[TaskDataset, TaskDataset]:
    d = cfg.data
    sizes = dict(patch_size=cfg.model.vision.patch_size, n_audio_features=cfg.model.audio.num_features)
    return (
        TaskDataset(d.tasks, "train", d.train_size, seed=d.seed, **sizes),
        TaskDataset(d.tasks, "heldout", d.heldout_size, seed=d.seed, **sizes),
    )


def build_batches(cfg: JobConfig, train_set: TaskDataset, tok: ByteTokenizer, counters) -> GlobalBatches[Sample]:
    return GlobalBatches(train_set, cfg.train.global_batch_size, cfg.data.seed, lambda ex: to_sample(ex, tok, counters))


def collate(samples: list[Sample], cfg: JobConfig, tok: ByteTokenizer) -> Batch:
    d, backend = cfg.data, cfg.model.attention
    if d.format == "thd":
        return pack_samples(samples, tok.pad_id, d.pad_to_multiple, backend=backend)
    return pad_samples(samples, tok.pad_id, d.pad_to_multiple, backend=backend)


@dataclass
class RankPlan:
    """What the layout gives this rank: its groups, its share of each global batch, its step reductions."""

    topo: Topology | None
    comms: StepComms
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.topo is not None

    @property
    def is_logger(self) -> bool:
        return not self.distributed or dist.get_rank() == 0


def setup_parallel(model: MultimodalModel, cfg: JobConfig, device: torch.device) -> RankPlan:
    """One process: nothing to do. Under torchrun: build every group, then apply each module's layout."""
    if not dist.is_initialized():
        return RankPlan(None, StepComms())
    topo = Topology.build(cfg)
    _require_one_layout(topo)
    parallelize(model, topo, cfg, device.type)
    grid = topo.grids["language"]
    lay = grid.layout
    return RankPlan(
        topo, StepComms(grid.group("dp"), loss_parallel=lay.tp > 1), grid.coord(dist.get_rank())["dp"], lay.dp
    )


def _require_one_layout(topo: Topology) -> None:
    """Until the bridge exists, every module must be split exactly like the LLM (same replicas, same samples)."""
    lang = topo.grids["language"].layout
    for name, grid in topo.grids.items():
        lay = grid.layout
        if (lay.start, lay.tp, lay.cp, lay.pp, lay.dp) != (lang.start, lang.tp, lang.cp, lang.pp, lang.dp):
            raise ConfigError(
                f"{name} is laid out {lay.describe()} but language {lang.describe()}; training currently needs "
                f"every module on the same layout (per-module layouts arrive with the bridge)"
            )
    if lang.cp > 1 or lang.pp > 1:
        raise ConfigError(f"language: cp = {lang.cp}, pp = {lang.pp}; context and pipeline parallelism are not built yet")
