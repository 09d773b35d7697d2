"""What the layouts give one rank, decided once at start-up: its groups, each module's share of every global
batch, the step's seams (where rows come from, how the LLM runs) and where the step's reductions go."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loom.bridge.colocated import ColocatedBridge
from loom.bridge.first_stage import FirstStageBridge
from loom.bridge.p2p import P2PBridge
from loom.config import JobConfig
from loom.models.llm import LLMConfig
from loom.models.multimodal import MultimodalModel
from loom.parallel import parallelize
from loom.parallel.compile import compile_backend, compile_blocks
from loom.parallel.experts import add_expert_groups
from loom.parallel.hsdp import add_shard_groups
from loom.parallel.fsdp import mixed_precision
from loom.parallel.materialize import WeightSource, materialize
from loom.parallel.replicate import attach_gradient_sums
from loom.parallel.pipeline import Pipeline
from loom.parallel.stage_link import StageLink
from loom.parallel.tied import TiedEmbedding, tied_copy_names, tied_embedding_group
from loom.topology import Placement, Topology
from loom.topology.checks import sample_multiple
from loom.train.encoder_ranks import EncoderRanks, stage0_order
from loom.train.expert_load import expert_load
from loom.train.inputs import Share, StepInputs
from loom.train.job_model import initial_weights
from loom.train.objective import Objective, make_objective
from loom.train.optim import GradNormShare
from loom.train.rows import LocalRows, ReceivedRows, RowSource, WholeStepRows
from loom.train.runners import LLMRunner, MicrobatchLoop, RunContext, ScheduleRunner
from loom.train.step import ReferenceScores, StepComms, StepResult, train_step

DATA_GROUP = "data: samples found bad when decoding (gloo)"
# non-colocated: the rows' gradients (bridge/p2p.py) and a pipelined encoder's stage gradients (stage_link.py)
P2P_GRADIENTS = "bridge: row gradients"


@dataclass
class RankPlan:
    """This rank's part of every step. `rows` and `runner` are the step's two seams (None on an encoder rank
    of a non-colocated job, which runs `encoder_ranks` instead)."""

    topo: Topology | None
    comms: StepComms
    shares: dict[str, Share]  # module → this rank's replica of its data (train/inputs.py)
    sample_multiple: int  # every sample's tokens are padded to a multiple of this (2·cp, ·tp under SP)
    rows: RowSource | None
    runner: LLMRunner | None
    run_context: RunContext = field(default_factory=RunContext)
    encoder_ranks: EncoderRanks | None = None
    pipeline: Pipeline | None = None  # the LLM's schedule over this rank's stages, when pp > 1
    hosted: tuple[str, ...] = ()  # the modules this rank holds (all of them unless non-colocated)
    data_group: dist.ProcessGroup | None = None  # a user's data: the gloo world group agreeing on undecodable files
    # train.reference: the frozen policy whose logprobs each step scores first (train/reference.py), else None
    reference: ReferenceScores | None = None

    @property
    def distributed(self) -> bool:
        return self.topo is not None

    @property
    def is_logger(self) -> bool:
        return not self.distributed or dist.get_rank() == 0

    def objective(self, cfg: JobConfig) -> Objective:
        """The objective `train.objective` names, on this rank's logits."""
        how = self.run_context
        return make_objective(cfg.train, compile_backend(cfg.train), how.vocab_sharded, how.cp_group)

    def train_step(self, model: MultimodalModel, optimizer, inputs: StepInputs, cfg: JobConfig, step: int,
                   inspect_grads=None, objective: Objective | None = None) -> StepResult:
        return train_step(self, model, optimizer, inputs, cfg.train, step, objective or self.objective(cfg),
                          inspect_grads)


def one_process_plan(modules: list[str], multiple: int, dtype: str, device: torch.device,
                     lm: LLMConfig | None = None) -> RankPlan:
    """The plan of a run on one process (the reference of `loom verify` too): every module here, no bridge, the
    microbatch loop, bf16 by autocast when asked (under a layout FSDP's policy casts instead); `lm`: the LLM's
    config, whose experts (if any) get their per-step load work."""
    autocast = (functools.partial(torch.autocast, device.type, dtype=torch.bfloat16) if dtype == "bf16"
                else RunContext().autocast)
    comms = StepComms(expert_load=None if lm is None else expert_load(lm))
    return RankPlan(None, comms, {m: (0, 1) for m in modules}, multiple, LocalRows(), MicrobatchLoop(),
                    RunContext(autocast=autocast), hosted=tuple(modules))


def setup_parallel(model: MultimodalModel, cfg: JobConfig, device: torch.device,
                   weights: WeightSource | None = None, placement: Placement | None = None) -> RankPlan:
    """Every run: compile and checkpoint the blocks as configured. Under torchrun also: build every group,
    apply each module's layout, and build the seams. Then the model (on `meta` until now) gets storage on
    `device` for what this rank holds, filled from `weights` (default: the job's `initial_weights`);
    `placement`: the job's, resolved once by `build_job` (else here)."""
    modules = [*model.encoder_names, "language"]
    if dist.is_initialized():
        plan = _rank_plan(model, cfg, device, modules, placement)
    else:
        parallelize(model, None, cfg, device.type, compile_blocks)  # no layout: compile and checkpoint only
        plan = one_process_plan(modules, cfg.data.pad_to_multiple, cfg.train.dtype, device, cfg.model.language)
    own = weights is None
    weights = initial_weights(model, cfg) if own else weights
    try:
        materialize(model, device, weights, tied_copy_names(model))
    finally:
        if own:
            weights.close()
    # on the parameters materialize made: the replicated modules' gradient sums, in FSDP2's reduce dtype
    attach_gradient_sums(model, mixed_precision(cfg.train.dtype, cfg.parallel.reduce_dtype).reduce_dtype,
                         int(cfg.parallel.replica_bucket_mb * 2**20))
    return plan


def _rank_plan(model: MultimodalModel, cfg: JobConfig, device: torch.device, modules: list[str],
               placement: Placement | None) -> RankPlan:
    """The layouts applied to this rank's part of `model` (still on `meta`), and the step's seams chosen once."""
    topo = Topology.build(cfg, placement)
    tied_group = tied_embedding_group(topo, cfg)  # on every rank: creating groups is a world collective
    add_expert_groups(topo)  # likewise (layout.language.ep > 1)
    add_shard_groups(topo)  # likewise (HSDP: a module's layout.<module>.shard)
    me = topo.role()
    for name in modules:  # non-colocated: a rank keeps only the modules it hosts
        if not me.hosts(name):
            delattr(model, name)
    parallelize(model, topo, cfg, device.type, compile_blocks)
    lang = topo.grids["language"]
    lay, hosts_llm = lang.layout, me.hosts("language")
    shares = {m: Share(topo.grids[m].coord(me.rank)["dp"], topo.grids[m].layout.dp, me.stage(m).is_first)
              if me.hosts(m) else Share(None, topo.grids[m].layout.dp) for m in modules}
    hidden_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32  # FSDP's param dtype
    pipeline = None
    if lay.pp > 1 and hosts_llm:
        tied = TiedEmbedding(model.language, tied_group) if cfg.model.language.tie_embeddings else None
        pipeline = Pipeline(model.language, cfg.parallel.pp_schedule, cfg.train.microbatches, lang.group("pp"),
                            device, hidden_dtype, lay.tp if lay.sequence_parallel else 1, cfg.parallel.pp_grad_reduce,
                            tied.sum_grads if tied is not None else None)
    # expert counts sum over the LLM's dp×cp ranks (tp ranks count the same tokens; each stage its own layers)
    counts_group = lang.group("dp", "cp") if hosts_llm and lang.size("dp", "cp") > 1 else None  # one rank: no sum
    comms = StepComms(norm_share(topo, modules), adds_loss=hosts_llm and lang.coord(me.rank)["tp"] == 0,
                      expert_load=expert_load(cfg.model.language, counts_group, world=True))
    run_context = RunContext(lang.group("cp") if hosts_llm and lay.cp > 1 else None, vocab_sharded=lay.tp > 1,
                             head_on_targets=not (lay.tp > 1 and lay.sequence_parallel))
    bridges = _bridges(topo, model, cfg)
    rows, encoder_ranks = None, None
    if topo.placement.colocated:
        rows = WholeStepRows(bridges, pipeline.first) if pipeline is not None else LocalRows(bridges)
    else:
        like = torch.empty((0, cfg.model.language.hidden_size), dtype=hidden_dtype, device=device)  # the rows'
        if hosts_llm:
            rows = ReceivedRows(bridges, like)
        else:
            order = stage0_order(cfg.parallel.pp_schedule, lay.pp * cfg.parallel.pp_virtual_stages,
                                 cfg.train.microbatches)
            encoder_ranks = _encoder_ranks(topo, model, bridges, order, like, hidden_dtype)
    runner = None if not hosts_llm else ScheduleRunner(pipeline) if pipeline is not None else MicrobatchLoop()
    plan = RankPlan(topo, comms, shares, sample_multiple(lay, cfg), rows, runner, run_context, encoder_ranks,
                    pipeline, me.modules)
    if cfg.data.sources:
        topo.registry.add(DATA_GROUP, [tuple(range(topo.placement.world_size))], backend="gloo")
        plan.data_group = topo.registry.named(DATA_GROUP)
    return plan


def _encoder_ranks(topo: Topology, model: MultimodalModel, bridges: dict[str, P2PBridge], order: list,
                   like: torch.Tensor, hidden_dtype: torch.dtype) -> EncoderRanks:
    """An encoder rank's program: its encoders' bridges and, for pipelined ones, the links to their neighbouring
    stages (every encoder on these ranks sits at the same stage: topology/checks.py)."""
    me, names = topo.role(), model.encoder_names
    grads_group = topo.registry.named(P2P_GRADIENTS)
    links = {m: StageLink(topo.grids[m], dist.group.WORLD, grads_group, names.index(m), len(names),
                          like.new_empty((0, model.encoder(m).encoder.cfg.hidden_size), dtype=hidden_dtype))
             for m in me.modules if topo.grids[m].layout.pp > 1}
    return EncoderRanks(bridges, list(me.modules), order, like, links, me.stage(me.modules[0]))


def _bridges(topo: Topology, model: MultimodalModel, cfg: JobConfig) -> dict:
    """Each encoder's bridge to the LLM: point-to-point between disjoint grids, or, colocated, into the
    LLM's first pipeline stage (pp > 1) or into its replicas (pp = 1). Built on every rank, in one order."""
    lang, names = topo.grids["language"], model.encoder_names
    if not topo.placement.colocated:
        # the row gradients travel on a second group over the world (bridge/p2p.py says why)
        topo.registry.add(P2P_GRADIENTS, [tuple(range(topo.placement.world_size))])
        grads_group = topo.registry.named(P2P_GRADIENTS)
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
