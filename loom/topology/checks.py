"""Layout checks: the world size agrees with the launcher's, every degree splits the module it is applied to.

Run on every rank before any group or model is built, so a bad config fails everywhere at once
instead of deadlocking the ranks that passed.
"""

from __future__ import annotations

import math

from loom.config import ConfigError, JobConfig
from loom.data.spans import ROW_MULTIPLE
from loom.topology.layout import Layout, Placement, resolve_placement


def check_layout(cfg: JobConfig, world_size: int | None = None) -> None:
    """layout.world_size against the launcher's; then, when the world is known (from either), every module's
    placement on it."""
    declared = cfg.layout.world_size
    if declared and world_size and declared != world_size:
        raise ConfigError(f"layout.world_size = {declared} but the launcher started {world_size} ranks")
    world = world_size or declared
    if world:
        check_placement(resolve_placement(cfg, world), cfg)


def check_placement(placement: Placement, cfg: JobConfig) -> None:
    lang = placement.layouts["language"]
    _check_sharding(placement, cfg)
    for name, lay in placement.layouts.items():
        if name != "language" and lay.dp % lang.dp and lang.dp % lay.dp:
            raise ConfigError(
                f"{name}: dp = {lay.dp} and language dp = {lang.dp}: one must divide the other, so that each replica "
                f"of one module serves whole replicas of the other (the bridges route rows between such blocks)"
            )
        if name == "language":
            _check_language(lay, cfg)
            if not placement.colocated and lay.pp > 1 and cfg.parallel.pp_schedule not in ("1f1b", "gpipe"):
                raise ConfigError(
                    f"parallel.pp_schedule = {cfg.parallel.pp_schedule!r} with encoders on ranks of their own: the "
                    f"encoder ranks follow the LLM stage 0's order of forwards and backwards, known for '1f1b' and "
                    f"'gpipe' only; use one of them, or put the encoders on the LLM's ranks")
        else:
            _check_encoder(lay, cfg)
            _check_encoder_pipeline(lay, placement, cfg)
        batch, m = cfg.train.global_batch_size, cfg.train.microbatches
        per_item = cfg.train.sequences_per_item
        if name == "language" and not cfg.data.tokens_per_microbatch and batch % (per_item * lay.dp * m):
            pairs = " (DPO: whole pairs per microbatch)" if per_item > 1 else ""
            raise ConfigError(
                f"language: train.global_batch_size = {batch} is not divisible by {'2 × ' if per_item > 1 else ''}"
                f"its dp = {lay.dp} × train.microbatches = {m}{pairs}; use a multiple of {per_item * lay.dp * m}, or "
                f"set data.tokens_per_microbatch to pack microbatches by tokens"
            )


def _check_language(lay: Layout, cfg: JobConfig) -> None:
    lm = cfg.model.language
    _divides(lay, "tp", {"num_heads": lm.num_heads, "intermediate_size": lm.intermediate_size,
                         "vocab_size": lm.vocab_size}, "model.language")
    kv, tp = lm.num_kv_heads, lay.tp
    if kv % tp and tp % kv:  # tp < kv splits the KV heads; tp > kv gives each rank the one its queries read
        fits = [d for d in range(1, lay.size + 1) if lay.size % d == 0 and lm.num_heads % d == 0 and
                (kv % d == 0 or d % kv == 0)]
        raise ConfigError(
            f"language: tp = {tp} neither divides model.language.num_kv_heads = {kv} nor is a multiple of it "
            f"(KV heads are split over tp, or each replicated on tp / num_kv_heads ranks); use tp ∈ "
            f"{{{', '.join(map(str, fits))}}}")
    if lay.sequence_parallel and lay.tp == 1:
        raise ConfigError("language: sequence_parallel = true needs tp > 1 (it shards tokens over the tp group)")
    _check_experts(lay, lm)
    _check_pipeline(lay, cfg)
    budget, multiple = cfg.data.tokens_per_microbatch, sample_multiple(lay, cfg)
    if budget and budget % multiple:
        raise ConfigError(
            f"data.tokens_per_microbatch = {budget} is not a multiple of {multiple} (every sample is padded to "
            f"{_multiple_reason(lay, cfg)}); use {budget // multiple * multiple or multiple} or "
            f"{(budget // multiple + 1) * multiple}")


# schedule → (virtual stages per rank it needs, what the microbatch count must satisfy)
_SCHEDULE_RULES = {
    "gpipe": ("= 1", "≥ 1"),
    "1f1b": ("= 1", "≥ pp"),
    "interleaved_1f1b": ("≥ 2", "a multiple of pp"),
    "zero_bubble": ("≥ 2", "a multiple of pp"),
    "zbv": ("= 2", "≥ pp"),
}


def _check_pipeline(lay: Layout, cfg: JobConfig) -> None:
    """The LLM's pipeline: schedule, virtual stages, split and microbatches fit together."""
    par, lm, m = cfg.parallel, cfg.model.language, cfg.train.microbatches
    if lay.pp == 1:
        if par.pp_virtual_stages != 1 or par.pp_split:
            raise ConfigError("parallel.pp_virtual_stages / parallel.pp_split apply to a pipelined LLM; set "
                              "layout.language.pp > 1 or remove them")
        if par.pp_grad_reduce != "step":
            raise ConfigError(f"parallel.pp_grad_reduce = {par.pp_grad_reduce!r} applies to a pipelined LLM (without "
                              f"pp FSDP2 reduces once per step, after the last microbatch); set layout.language.pp > 1 "
                              f"or remove it")
        return
    v, schedule = par.pp_virtual_stages, par.pp_schedule
    stages = lay.pp * v
    if lm.num_layers < stages:
        raise ConfigError(f"language: pp = {lay.pp} × parallel.pp_virtual_stages = {v} = {stages} stages exceed "
                          f"model.language.num_layers = {lm.num_layers}; every stage needs at least one layer")
    stages_rule, micro_rule = _SCHEDULE_RULES[schedule]
    if not {"= 1": v == 1, "≥ 2": v >= 2, "= 2": v == 2}[stages_rule]:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} runs parallel.pp_virtual_stages {stages_rule} per "
                          f"rank, got {v}" + ("; use interleaved_1f1b or zero_bubble for more" if v > 1 else ""))
    if not {"≥ 1": True, "≥ pp": m >= lay.pp, "a multiple of pp": m % lay.pp == 0}[micro_rule]:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} with pp = {lay.pp} needs train.microbatches "
                          f"{micro_rule} (every stage busy in the steady state), got {m}; use "
                          f"train.microbatches = {max(lay.pp, -(-m // lay.pp) * lay.pp)}")
    if par.pp_grad_reduce == "microbatch" and schedule in ("zero_bubble", "zbv"):
        raise ConfigError(f"parallel.pp_grad_reduce = 'microbatch' with parallel.pp_schedule = {schedule!r}: "
                          f"zero-bubble schedules defer each microbatch's weight gradients past its input backward, "
                          f"after which FSDP2 would reduce-scatter and reshard, so the weight pass would see "
                          f"parameters its graph never used; use pp_grad_reduce = 'step', or pp_schedule = "
                          f"'interleaved_1f1b' (or '1f1b') with 'microbatch'")
    split = par.pp_split
    if split and (len(split) != stages or sum(split) != lm.num_layers or min(split) < 1):
        raise ConfigError(f"parallel.pp_split = {split}: expected {stages} stage sizes (pp · pp_virtual_stages), "
                          f"each ≥ 1, adding up to model.language.num_layers = {lm.num_layers}; it has "
                          f"{len(split)} adding up to {sum(split)}")
    if cfg.data.format == "thd" and not cfg.data.tokens_per_microbatch:
        raise ConfigError("language: pp > 1 sends fixed-shape activations between stages; set "
                          "data.tokens_per_microbatch (T tokens per microbatch), e.g. 2048")


def _check_sharding(placement: Placement, cfg: JobConfig) -> None:
    """FSDP2's keys name the job's modules; a replicated module where it is supported; CUDA graphs only where no
    module is sharded over several ranks."""
    par, layouts = cfg.parallel, placement.layouts
    if par.fsdp_prefetch < 0:
        raise ConfigError(f"parallel.fsdp_prefetch = {par.fsdp_prefetch} must be ≥ 0 (units gathered ahead; 0: "
                          f"FSDP2's own order)")
    for name, blocks in par.module_blocks_per_unit.items():
        if name not in layouts or not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
            raise ConfigError(f"parallel.module_blocks_per_unit.{name} = {blocks!r}: expected a positive block count "
                              f"for one of the job's modules {sorted(layouts)}")
    for name, lay in layouts.items():
        if not lay.fsdp and (lay.pp > 1 or lay.ep > 1):
            what = "pp > 1" if lay.pp > 1 else "ep > 1"
            raise ConfigError(f"layout.{name}.fsdp = false with {what}: a replicated module is supported without "
                              f"pipeline or expert parallelism for now; set layout.{name}.fsdp = true (FSDP2) for "
                              f"this layout")
    if cfg.train.compile_mode == "reduce-overhead" and not placement.colocated and cfg.train.microbatches > 1:
        raise ConfigError(
            f"train.compile_mode = 'reduce-overhead' with encoders on ranks of their own and train.microbatches = "
            f"{cfg.train.microbatches}: the encoder ranks run microbatch i + 1's forward before microbatch i's "
            f"backward, which CUDA graph trees cannot replay (measured on 4 H200s: 5.2 s steps against 0.53 s "
            f"compiled without graphs); use train.compile_mode = 'default', or train.microbatches = 1")
    sharded = {n: lay.dp * lay.cp for n, lay in layouts.items() if lay.dp * lay.cp > 1 and lay.fsdp}
    if cfg.train.compile_mode == "reduce-overhead" and sharded:
        name, ranks = next(iter(sharded.items()))
        raise ConfigError(
            f"train.compile_mode = 'reduce-overhead' with {name} sharded by FSDP2 over dp·cp = {ranks} ranks: the "
            f"blocks' CUDA graphs do not survive its gathers and reshards (measured on 4 H200s: 9 s steps against "
            f"0.69 s compiled without graphs); set layout.{name}.fsdp = false (its weights whole on each rank, "
            f"which graphs can replay) if they fit, or use train.compile_mode = 'default'")


def sample_multiple(lay: Layout, cfg: JobConfig) -> int:
    """What every sample's tokens are padded to: data.pad_to_multiple, times what the layout needs — 2·cp
    chunks per sample under cp, tp shards under sequence parallel (derived, so nobody has to set it)."""
    cp = 2 * lay.cp if lay.cp > 1 else 1
    return math.lcm(cfg.data.pad_to_multiple, cp * (lay.tp if lay.sequence_parallel else 1))


def _multiple_reason(lay: Layout, cfg: JobConfig) -> str:
    parts = [f"data.pad_to_multiple = {cfg.data.pad_to_multiple}"] if cfg.data.pad_to_multiple > 1 else []
    parts += [f"2·cp = {2 * lay.cp} chunks"] if lay.cp > 1 else []
    parts += [f"tp = {lay.tp} sequence-parallel shards"] if lay.sequence_parallel else []
    return " and ".join(parts) or "1"


def _check_encoder(lay: Layout, cfg: JobConfig) -> None:
    name = lay.module
    enc = getattr(cfg.model, name)
    if lay.sequence_parallel and (lay.tp == 1 or ROW_MULTIPLE % lay.tp):
        raise ConfigError(f"{name}: sequence_parallel = true shards the encoder's packed rows (padded to a multiple "
                          f"of {ROW_MULTIPLE}) over tp; it needs tp > 1 dividing {ROW_MULTIPLE}, not tp = {lay.tp}")
    if lay.cp > 1:
        raise ConfigError(
            f"{name}: cp = {lay.cp}, but encoders do not use context parallelism; give the {name} encoder "
            f"cp = 1 and more dp instead (its batch is spread over the LLM's cp ranks)"
        )
    # Qwen2-VL's tower runs at any tp (+SP) the sizes divide: attention and the merger see the stream whole
    # (gathered before attention, after the last layer), so its windows and 2×2 groups need no rule of their own
    if name == "vision" and enc.family in ("qwen2_vl", "qwen2_5_vl") and lay.pp > 1:
        raise ConfigError(f"vision: pp = {lay.pp} with Qwen2-VL's tower (model.vision.family = {enc.family!r}): an "
                          f"encoder pipeline (ranks of its own only) passes a ViT's stream and spans between stages, "
                          f"not this tower's 2-D rotary positions and Qwen2.5-VL's window order; set "
                          f"layout.vision.pp = 1 and give it dp or tp")
    if name == "audio" and enc.family == "qwen2_audio" and lay.pp > 1:
        raise ConfigError(f"audio: pp = {lay.pp} with Qwen2-Audio's tower (model.audio.family = 'qwen2_audio'): "
                          f"its stages would pass a clip's unpooled rows, twice the placeholders it fills, which "
                          f"encoder pipelines do not count; set layout.audio.pp = 1 and give it dp or tp")
    if name == "vision" and enc.grid_pinpoints and lay.pp > 1:
        raise ConfigError(f"vision: pp = {lay.pp} with LLaVA-OneVision's anyres tower (model.vision.grid_pinpoints): "
                          f"its rows are laid out per image after the projector (tile layout, image_newline), which "
                          f"an encoder stage does not run; set layout.vision.pp = 1 and give it dp or tp")
    _divides(lay, "tp", {"num_heads": enc.num_heads, "hidden_size": enc.hidden_size,
                         "intermediate_size": enc.intermediate_size}, f"model.{name}")


def _check_encoder_pipeline(lay: Layout, placement: Placement, cfg: JobConfig) -> None:
    """An encoder's pp: only on ranks of its own (non-colocated), at most one stage per layer, and the same pp
    as any encoder sharing its ranks (a rank runs one stage's program for all its encoders)."""
    if lay.pp == 1:
        return
    name, layers = lay.module, getattr(cfg.model, lay.module).num_layers
    if placement.colocated:
        raise ConfigError(
            f"{name}: pp = {lay.pp} with the encoders on the LLM's ranks (colocated): a colocated encoder runs "
            f"unpipelined — per microbatch, or on the whole step before a pipelined LLM — so give it more dp "
            f"instead (pp = 1), or put the encoders on ranks of their own (layout.{name}.ranks)")
    v = cfg.model.vision
    if name == "vision" and v.drop_first_row:
        raise ConfigError(f"vision: pp = {lay.pp} with a LLaVA tower that drops each image's first row (its "
                          f"vision_feature_select_strategy = 'default'): its stages would pass one row per image more "
                          f"than it outputs, which encoder pipelines do not count; set layout.vision.pp = 1")
    if layers < lay.pp:
        raise ConfigError(f"{name}: pp = {lay.pp} stages exceed model.{name}.num_layers = {layers}; every stage "
                          f"needs at least one layer (use pp ≤ {layers})")
    for other in placement.layouts.values():
        if other.module not in (name, "language") and other.ranks == lay.ranks and other.pp != lay.pp:
            raise ConfigError(
                f"{name}: pp = {lay.pp} but {other.module} on the same ranks {lay.start}-{lay.ranks[-1]} has "
                f"pp = {other.pp}; encoders sharing ranks need one pp (a rank runs one pipeline stage of each), "
                f"set layout.{other.module}.pp = {lay.pp} or give it ranks of its own")


def _divides(lay: Layout, dim: str, sizes: dict[str, int], prefix: str) -> None:
    degree = lay.degree(dim)
    for field, size in sizes.items():
        if size % degree:
            fits = [d for d in range(1, lay.size + 1) if lay.size % d == 0 and all(s % d == 0 for s in sizes.values())]
            raise ConfigError(
                f"{lay.module}: {dim} = {degree} does not divide {prefix}.{field} = {size}; "
                f"use {dim} ∈ {{{', '.join(map(str, fits))}}}"
            )


def _check_experts(lay: Layout, lm) -> None:
    """layout.language.ep: a view of the dp×cp ranks, each holding num_experts / ep whole experts."""
    if lay.ep == 1:
        return
    if not lm.num_experts:
        raise ConfigError(f"layout.language.ep = {lay.ep} needs experts: set model.language.num_experts (valid ep "
                          f"for a dense LLM: 1)")
    ranks = lay.dp * lay.cp
    fits = [d for d in range(1, ranks + 1) if ranks % d == 0 and lm.num_experts % d == 0]
    if lm.num_experts % lay.ep:
        raise ConfigError(f"layout.language.ep = {lay.ep} does not divide model.language.num_experts = "
                          f"{lm.num_experts} (valid ep: {fits})")
    if ranks % lay.ep:
        raise ConfigError(f"layout.language.ep = {lay.ep} does not divide the LLM's dp·cp = {lay.dp}·{lay.cp} = "
                          f"{ranks} ranks it is a view of (valid ep: {fits})")
