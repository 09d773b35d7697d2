"""Everything a job builds before its first step, in one function (`build_job`): `loom train`, `loom verify`
and the benchmarks build through it, so they cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.config import JobConfig
from loom.data.loader import GlobalBatches
from loom.data.sample import Sample
from loom.data.tokenizer import Vocabulary
from loom.models.multimodal import MultimodalModel
from loom.parallel.materialize import WeightSource, materialize
from loom.checkpoint.sharded import tied_aliases
from loom.topology.checks import sample_multiple
from loom.topology.layout import resolve_placement
from loom.train.length_rules import check_longest, with_padded_length
from loom.train.job_data import JobData, build_job_data, job_tokenizer, with_vocabulary
from loom.train.job_model import (
    build_batches,
    build_job_model,
    initial_weights,
    resolve_device,
    token_counters,
)
from loom.train.flops import ModelFlops
from loom.train.optim import ModuleOptimizers
from loom.train.rank_plan import RankPlan, setup_parallel
from loom.train.reference import reference_policy

@dataclass
class Job:
    cfg: JobConfig  # the config as run: vocabulary grown for added placeholders, bshd's row length resolved
    device: torch.device
    tok: Vocabulary
    model: MultimodalModel  # this rank's part, with storage
    counters: dict  # encoder → its rows per item (TokenCounter)
    data: JobData
    plan: RankPlan
    optimizer: ModuleOptimizers
    batches: GlobalBatches[Sample]
    weight_aliases: dict[str, str]  # tied names → the name stored (taken before a pipeline split unties them)
    weight_names: set[str]  # every weight of the whole model, a tied alias once: what a checkpoint holds
    n_params: int  # of the whole model (a rank may keep part)
    flops: ModelFlops  # the whole model's sizes as the FLOP count reads them (the trainer's MFU)
    reference: MultimodalModel | None = None  # `loom verify`: the whole model on this process, fp32


def build_job(cfg: JobConfig, device: torch.device | None = None, pretrained: bool = True,
              reference: bool = False, weights: WeightSource | None = None, rollouts: bool = False) -> Job:
    """The job's tokenizer, model (built on meta, then this rank's shards only), data (every line checked before
    any weight is read), rank plan, optimizer and global batches. `pretrained`: read the Hugging Face folders
    (a resumed run takes its weights from the checkpoint instead); `reference`: also the whole model from the
    same initial weights, never parallelised or compiled (`loom verify`); `weights`: where the weights come
    from instead of the folders and seeded draws (`loom eval`: a checkpoint); `rollouts`: the steps train on
    `loom rl`'s samples, not on the data's lines (which then need no RL values)."""
    torch.manual_seed(cfg.train.seed)  # initial weights are seeded per name; this seeds any later draw
    device = device or resolve_device(cfg.train.device)
    tok = job_tokenizer(cfg)
    cfg = with_vocabulary(cfg, tok)  # the placeholders a pretrained tokenizer lacked get embedding rows
    model = build_job_model(cfg, tok)  # on meta until setup_parallel gives this rank its shards
    counters = token_counters(model)
    # the placement and the LLM's sample multiple, resolved once here and passed down (the prescan needs it)
    placement = resolve_placement(cfg, dist.get_world_size()) if dist.is_initialized() else None
    multiple = sample_multiple(placement.layouts["language"], cfg) if placement else cfg.data.pad_to_multiple
    data = build_job_data(cfg, tok, counters, multiple, rollouts)
    weights = weights or initial_weights(model, cfg, pretrained)
    try:
        aliases = tied_aliases(model)
        names = set(model.state_dict()) - set(aliases)
        weights.check_holds(names)  # before any is read
        whole = None
        if reference:
            whole = build_job_model(cfg, tok)
            materialize(whole, device, weights)
        # bshd: S fixed before compile sets the encoders' row budgets (R·S rows) from it
        cfg = with_padded_length(cfg, data.longest, multiple)
        n_params = sum(p.numel() for p in model.parameters())
        flops = ModelFlops.of(model)  # before the layout keeps only this rank's part
        plan = setup_parallel(model, cfg, device, weights, placement)
    finally:
        weights.close()
    check_longest(cfg, data.longest, plan.sample_multiple)  # on every rank alike, before the first step
    plan.reference = reference_policy(model, cfg)
    optimizer = ModuleOptimizers(model, list(plan.hosted), cfg.train)
    return Job(cfg, device, tok, model, counters, data, plan, optimizer, build_batches(cfg, data), aliases, names,
               n_params, flops, whole)

