"""Everything a job builds before its first step, shared by `loom train` and `loom verify`."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loom.bridge.colocated import ColocatedBridge
from loom.config import ConfigError, JobConfig
from loom.data.batch import Batch, pad_samples, round_up
from loom.data.format import TokenCounter, to_sample
from loom.data.loader import GlobalBatches
from loom.data.packing import pack_samples, packed_length
from loom.data.sample import Sample
from loom.data.tasks import TaskDataset
from loom.data.tokenizer import ByteTokenizer
from loom.models.hf import make_module
from loom.models.multimodal import MultimodalModel, build_model
from loom.parallel import parallelize
from loom.parallel.compile import compile_blocks
from loom.topology import Topology
from loom.train.optim import freeze_modules
from loom.train.step import StepBatch, StepComms


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
    model = build_model(
        m.language,
        m.vision if "vision" in m.encoders else None,
        m.audio if "audio" in m.encoders else None,
        tok.placeholder_ids,
        make=functools.partial(make_module, pretrained=pretrained),
    )
    freeze_modules(model, [*model.encoder_names, "language"], cfg.train)
    return model


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


COMPILED_TOKEN_MULTIPLE = 64


def collate(samples: list[Sample], cfg: JobConfig, tok: ByteTokenizer) -> Batch:
    d, backend = cfg.data, cfg.model.attention
    # compiled blocks specialise on the token count's alignment and size range, and under FSDP one rank's
    # recompile stalls them all: rounding the count up to a multiple of 64 keeps the variants few
    step = math.lcm(d.pad_to_multiple, COMPILED_TOKEN_MULTIPLE) if cfg.train.compile else d.pad_to_multiple
    if d.format == "thd":
        pack_len = round_up(packed_length(samples, d.pad_to_multiple), step)
        return pack_samples(samples, tok.pad_id, d.pad_to_multiple, pack_len, backend=backend)
    return pad_samples(samples, tok.pad_id, step, backend=backend)


@dataclass
class RankPlan:
    """What the layouts give this rank: its groups, each module's share of every global batch (its dp
    coordinate and degree), the bridges from each encoder to the LLM, and the step's reductions."""

    topo: Topology | None
    comms: StepComms
    shares: dict[str, tuple[int, int]]  # module → (dp rank, dp size)
    bridges: dict[str, ColocatedBridge] = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        return self.topo is not None

    @property
    def is_logger(self) -> bool:
        return not self.distributed or dist.get_rank() == 0

    def autocast(self, dtype: str, device: torch.device):
        """The context factory a step's forward runs in: bf16 autocast on one process; under a layout bf16
        comes from FSDP's mixed-precision policy, so nothing."""
        if dtype == "bf16" and not self.distributed:
            return functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext


def setup_parallel(model: MultimodalModel, cfg: JobConfig, device: torch.device) -> RankPlan:
    """One process: nothing to do. Under torchrun: build every group, apply each module's layout, and build
    the bridges."""
    modules = [*model.encoder_names, "language"]
    if cfg.train.compile:  # traced lazily at the first step, so the layout below is what it sees
        compile_blocks(model, modules)
    if not dist.is_initialized():
        return RankPlan(None, StepComms(), {m: (0, 1) for m in modules})
    topo = Topology.build(cfg)
    _require_supported(topo)
    parallelize(model, topo, cfg, device.type)
    me = dist.get_rank()
    lang = topo.grids["language"]
    shares = {m: (topo.grids[m].coord(me)["dp"], topo.grids[m].layout.dp) for m in modules}
    bridges = {
        m: ColocatedBridge(topo.grids[m], lang, cfg.train.global_batch_size, cfg.parallel.debug_checks)
        for m in model.encoder_names
    }
    lay = lang.layout
    comms = StepComms(lang.group("dp", "cp"), loss_parallel=lay.tp > 1, cp_group=lang.group("cp") if lay.cp > 1 else None)
    return RankPlan(topo, comms, shares, bridges)


def step_batch(batches: GlobalBatches[Sample], step: int, plan: RankPlan, cfg: JobConfig, tok: ByteTokenizer,
               counters: dict[str, TokenCounter], device: torch.device) -> StepBatch:
    """This rank's inputs of global batch `step`: the LLM's share as tokens, each encoder's share as items."""
    llm_samples = batches.shard(step, *plan.shares["language"])
    items, rows, llm_rows = {}, {}, {}
    for name, counter in counters.items():
        per_sample = lambda ss: [sum(counter(item) for item in s.items(name)) for s in ss]  # noqa: E731
        same = plan.shares[name] == plan.shares["language"]
        samples = llm_samples if same else batches.shard(step, *plan.shares[name])
        items[name] = [item.to(device) for s in samples for item in s.items(name)]
        rows[name] = per_sample(samples)
        llm_rows[name] = rows[name] if same else per_sample(llm_samples)
    batch = collate(llm_samples, cfg, tok).to(device)
    return StepBatch(batch, items, rows, llm_rows, sum(len(s) for s in llm_samples))


def _require_supported(topo: Topology) -> None:
    if not topo.placement.colocated:
        raise ConfigError("non-colocated placement validates and plans, but training it is not built yet")
    for name, grid in topo.grids.items():
        if grid.layout.pp > 1:
            raise ConfigError(f"{name}: pp = {grid.layout.pp}; pipeline parallelism is not built yet")
