"""Everything a job builds before its first step, shared by `loom train` and `loom verify`."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loom.bridge.colocated import ColocatedBridge
from loom.bridge.first_stage import FirstStageBridge
from loom.bridge.p2p import P2PBridge
from loom.config import JobConfig
from loom.data.format import TokenCounter
from loom.data.loader import GlobalBatches
from loom.data.sample import Sample
from loom.data.tokenizer import Vocabulary
from loom.models.hf import HFWeights
from loom.models.multimodal import MultimodalModel, build_model
from loom.parallel import parallelize
from loom.parallel.compile import compile_blocks
from loom.parallel.materialize import InitialWeights, materialize
from loom.parallel.pipeline import Pipeline
from loom.parallel.tied import TiedEmbedding, tied_copy_names, tied_embedding_group
from loom.topology import Topology
from loom.topology.checks import sample_multiple
from loom.train.inputs import StepInputs, check_longest
from loom.train.job_data import JobData
from loom.train.optim import GradNormShare, freeze_modules
from loom.train.noncolocated_step import (
    encoder_train_step,
    llm_train_step,
    pipelined_llm_train_step,
    stage0_order,
)
from loom.train.pipeline_step import pipelined_train_step
from loom.train.step import StepComms, StepResult, train_step


DATA_GROUP = "data: samples found bad when decoding (gloo)"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)


def build_job_model(cfg: JobConfig, tok: Vocabulary) -> MultimodalModel:
    """The job's model on the `meta` device: shapes only. Storage and values come after the layout is
    applied (`setup_parallel` → parallel/materialize.py), so no rank ever holds the whole model."""
    m = cfg.model
    with torch.device("meta"):
        model = build_model(m.language, m.vision if "vision" in m.encoders else None,
                            m.audio if "audio" in m.encoders else None, tok.placeholder_ids)
    freeze_modules(model, [*model.encoder_names, "language"], cfg.train)
    return model


def initial_weights(model: MultimodalModel, cfg: JobConfig, pretrained: bool = True) -> InitialWeights:
    """Where each weight's first value comes from: the folder of a module whose `hf` is set (when
    `pretrained`; every name and shape is checked now, from the files' headers, before anything is read),
    else a draw seeded by its name. Projectors always start from draws."""
    folders = {}
    for name in (*model.encoder_names, "language") if pretrained else ():
        folder = getattr(cfg.model, name).hf
        if folder:
            module = model.language if name == "language" else model.encoder(name).encoder
            prefix = "language." if name == "language" else f"{name}.encoder."
            grown = ("embed_tokens.weight", "lm_head.weight") if name == "language" else ()  # job_data.with_vocabulary
            folders[prefix] = HFWeights(folder, module, grown)
    return InitialWeights(cfg.train.seed, cfg.model.language.init_std, folders)


def token_counters(model: MultimodalModel) -> dict[str, TokenCounter]:
    return {n: model.encoder(n).num_tokens for n in model.encoder_names}


def build_batches(cfg: JobConfig, data: JobData) -> GlobalBatches[Sample]:
    """Global batches of the job's training samples (a sample found bad when drawn: train/step_data.py)."""
    return GlobalBatches(data.train, cfg.train.global_batch_size, cfg.data.seed)


@dataclass
class RankPlan:
    """What the layouts give this rank: its groups, each module's share of every global batch (its dp
    coordinate and degree), the bridges from each encoder to the LLM, and the step's reductions."""

    topo: Topology | None
    comms: StepComms
    shares: dict[str, tuple[int, int]]  # module → (dp rank, dp size)
    sample_multiple: int  # every sample's tokens are padded to a multiple of this (2·cp, ·tp under SP)
    bridges: dict[str, ColocatedBridge | FirstStageBridge | P2PBridge] = field(default_factory=dict)
    pipeline: Pipeline | None = None  # the LLM's schedule over this rank's stages, when pp > 1
    hosted: tuple[str, ...] = ()  # the modules this rank holds (all of them unless non-colocated)
    rows_like: torch.Tensor | None = None  # non-colocated: the dtype, device and width of the bridged rows
    stage0_order: list[tuple[str, int]] = field(default_factory=list)  # non-colocated: the LLM stage 0's F/B order
    data_group: dist.ProcessGroup | None = None  # a user's data: the gloo world group agreeing on undecodable files

    @property
    def distributed(self) -> bool:
        return self.topo is not None

    @property
    def spread(self) -> GradNormShare | None:
        """When no rank holds every module whole (a pipelined LLM, non-colocated modules): which modules this
        rank reports for, one rank per module stage (checkpoints and evaluation gather them); else None."""
        if self.topo is None or (self.topo.placement.colocated and self.pipeline is None):
            return None
        return self.comms.norm_share

    @property
    def is_logger(self) -> bool:
        return not self.distributed or dist.get_rank() == 0

    def train_step(self, model: MultimodalModel, optimizer, inputs: StepInputs, cfg: JobConfig, step: int,
                   device: torch.device, inspect_grads=None) -> StepResult:
        """One optimizer step of this rank's layout: microbatch after microbatch, or the three-phase step
        around the LLM's pipeline schedule."""
        if self.topo is not None and not self.topo.placement.colocated:
            if "language" not in self.hosted:
                return encoder_train_step(model, optimizer, inputs, cfg.train, step, self.comms, self.bridges,
                                          list(self.hosted), self.stage0_order, self.rows_like, inspect_grads)
            if self.pipeline is not None:
                return pipelined_llm_train_step(model, optimizer, inputs, cfg.train, step, self.comms, self.bridges,
                                                self.pipeline, self.rows_like, inspect_grads)
            return llm_train_step(model, optimizer, inputs, cfg.train, step, self.comms, self.bridges,
                                  self.rows_like, inspect_grads)
        if self.pipeline is not None:
            return pipelined_train_step(model, optimizer, inputs, cfg.train, step, self.comms, self.pipeline,
                                        self.bridges, inspect_grads)
        return train_step(model, optimizer, inputs, cfg.train, step, self.comms, self.bridges,
                          self.autocast(cfg.train.dtype, device), inspect_grads)

    def autocast(self, dtype: str, device: torch.device):
        """The context factory a step's forward runs in: bf16 autocast on one process; under a layout bf16
        comes from FSDP's mixed-precision policy, so nothing."""
        if dtype == "bf16" and not self.distributed:
            return functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext


def setup_parallel(model: MultimodalModel, cfg: JobConfig, device: torch.device,
                   weights: InitialWeights | None = None) -> RankPlan:
    """Every run: compile and checkpoint the blocks as configured. Under torchrun also: build every group,
    apply each module's layout, and build the bridges. Then the model (on `meta` until now) gets storage on
    `device` for what this rank holds, filled from `weights` (default: the job's `initial_weights`)."""
    modules = [*model.encoder_names, "language"]
    if dist.is_initialized():
        plan = _rank_plan(model, cfg, device, modules)
    else:
        parallelize(model, None, cfg, device.type, compile_blocks)  # no layout: compile and checkpoint only
        plan = RankPlan(None, StepComms(), {m: (0, 1) for m in modules}, cfg.data.pad_to_multiple, hosted=tuple(modules))
    own = weights is None
    weights = initial_weights(model, cfg) if own else weights
    try:
        materialize(model, device, weights, tied_copy_names(model))
    finally:
        if own:
            weights.close()
    return plan


def _rank_plan(model: MultimodalModel, cfg: JobConfig, device: torch.device, modules: list[str]) -> RankPlan:
    """The layouts applied to this rank's part of `model` (still on `meta`), and what its steps need."""
    topo = Topology.build(cfg)
    tied_group = tied_embedding_group(topo, cfg)  # on every rank: creating groups is a world collective
    me = topo.role()
    for name in modules:  # non-colocated: a rank keeps only the modules it hosts
        if not me.hosts(name):
            delattr(model, name)
    parallelize(model, topo, cfg, device.type, compile_blocks)
    lang = topo.grids["language"]
    lay, hosts_llm = lang.layout, me.hosts("language")
    shares = {m: (topo.grids[m].coord(me.rank)["dp"] if me.hosts(m) else None, topo.grids[m].layout.dp)
              for m in modules}
    hidden_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32  # FSDP's param dtype
    pipeline = None
    if lay.pp > 1 and hosts_llm:
        tied = TiedEmbedding(model.language, tied_group) if cfg.model.language.tie_embeddings else None
        pipeline = Pipeline(model.language, cfg.parallel.pp_schedule, cfg.train.microbatches, lang.group("pp"),
                            device, hidden_dtype, lay.tp if lay.sequence_parallel else 1, cfg.parallel.pp_grad_reduce,
                            tied)
    comms = StepComms(norm_share(topo, modules), adds_loss=hosts_llm and lang.coord(me.rank)["tp"] == 0,
                      loss_parallel=lay.tp > 1, cp_group=lang.group("cp") if hosts_llm and lay.cp > 1 else None,
                      stage_group=lang.group("pp") if hosts_llm and lay.pp > 1 else None)
    plan = RankPlan(topo, comms, shares, sample_multiple(lay, cfg), _bridges(topo, model, cfg), pipeline,
                    me.modules)
    if cfg.data.sources:
        topo.registry.add(DATA_GROUP, [tuple(range(topo.placement.world_size))], backend="gloo")
        plan.data_group = topo.registry.named(DATA_GROUP)
    if not topo.placement.colocated:
        plan.rows_like = torch.empty((0, cfg.model.language.hidden_size), dtype=hidden_dtype, device=device)
        plan.stage0_order = stage0_order(cfg.parallel.pp_schedule, lay.pp * cfg.parallel.pp_virtual_stages,
                                         cfg.train.microbatches)
    return plan


def _bridges(topo: Topology, model: MultimodalModel, cfg: JobConfig) -> dict:
    """Each encoder's bridge to the LLM: point-to-point between disjoint grids, or, colocated, into the
    LLM's first pipeline stage (pp > 1) or into its replicas (pp = 1). Built on every rank, in one order."""
    lang, names = topo.grids["language"], model.encoder_names
    if not topo.placement.colocated:
        # the row gradients travel on a second group over the world (bridge/p2p.py says why)
        topo.registry.add("bridge: row gradients", [tuple(range(topo.placement.world_size))])
        grads_group = topo.registry.named("bridge: row gradients")
        return {m: P2PBridge(topo.grids[m], lang, dist.group.WORLD, grads_group, i, len(names))
                for i, m in enumerate(names)}
    if lang.layout.pp > 1:
        return {m: FirstStageBridge(topo.grids[m], lang) for m in names}
    return {m: ColocatedBridge(topo.grids[m], lang, cfg.parallel.debug_checks) for m in names}


def norm_share(topo: Topology, modules: list[str]) -> GradNormShare:
    """This rank's part of the global grad norm: each module's squared norm is added by the rank at dp = cp =
    tp = 0 of each of its pipeline stages."""
    me = topo.role()
    first = {m for m in me.modules if all(v == 0 for d, v in topo.grids[m].coord(me.rank).items() if d != "pp")}
    return GradNormShare(tuple(modules), frozenset(me.modules), frozenset(first))


def check_data(cfg: JobConfig, plan: RankPlan, data: JobData) -> None:
    """Data problems found before the first step, on every rank alike."""
    check_longest(cfg, data.longest, plan.sample_multiple)
