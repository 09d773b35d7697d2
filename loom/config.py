"""Typed job configuration: dataclasses loaded from TOML, dotted CLI overrides (read by typed_config.py), one
validate().

Every problem is reported before any model is built, with the dotted key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from loom.data.tables import is_table
from loom.models.audio import AudioConfig
from loom.models.llm import LLMConfig
from loom.models.vision import VisionConfig
from loom.typed_config import ConfigError, choice, from_dict, parse_override, set_dotted


@dataclass
class ModelConfig:
    encoders: list[str] = field(default_factory=lambda: ["vision", "audio"])
    # a Hugging Face tokenizer folder (tokenizer.json + chat template) for data.sources; empty: loom's byte
    # tokenizer, which the built-in tasks use
    tokenizer: str = ""
    attention: str = choice("auto", "auto", "sdpa", "varlen")
    language: LLMConfig = field(default_factory=LLMConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)


@dataclass
class SourceConfig:
    """[[data.sources]]: one JSONL file of conversations and its share of the mixture."""

    path: str = ""
    weight: float = 1.0


@dataclass
class DataConfig:
    tasks: list[str] = field(default_factory=lambda: ["digits", "shapes", "tones"])  # built-in (no data.sources)
    train_size: int = 60000  # built-in tasks' examples per epoch
    heldout_size: int = 240  # held-out examples; with data.sources and no data.heldout, the last ones of each file
    # a user's JSONL conversations (replace data.tasks; need model.tokenizer), mixed by weight
    sources: list[SourceConfig] = field(default_factory=list)
    heldout: str = ""  # a JSONL of held-out conversations (default: split off the sources, data.heldout_size)
    train_on: str = choice("assistant", "assistant", "all")  # which turns' tokens are targets
    # a malformed line, a missing or undecodable file, placeholders that do not match the media: stop naming
    # file:line, or skip it (counted, listed in out_dir/bad_samples.jsonl; every rank decides alike)
    on_bad_sample: str = choice("error", "error", "skip")
    image_min_pixels: int = 0  # images are resized into [min, max] pixels keeping their aspect ratio (0: no bound)
    image_max_pixels: int = 0
    format: str = choice("thd", "thd", "bshd")  # packed (THD) or padded (BSHD) batches
    pad_to_multiple: int = 1  # each sample's length is rounded up to this (the layout adds 2·cp, ·tp under SP)
    tokens_per_microbatch: int = 0  # T: every LLM microbatch packs exactly T tokens (0: each share as it comes)
    padded_length: int = 0  # S: every bshd microbatch is [rows, S] (0: the data's longest sample, rounded up)
    too_long: str = choice("error", "error", "skip")  # a sample longer than T (or S): stop with its index, or skip it
    # train.compile: rows of one call of an encoder's layers, e.g. {vision = 2048}; fixed, so they never recompile
    # (not listed: T per LLM microbatch served, always enough; a call with more rows compiles again)
    encoder_rows_per_microbatch: dict = field(default_factory=dict)
    seed: int = 0
    # processes preparing the coming steps (samples, plan, this rank's media decoded) while one trains; 0: in step
    workers: int = 2
    prefetch_steps: int = 2  # steps each worker holds ready


@dataclass
class ModuleTrainConfig:
    """[train.<module>]: per-module optimisation."""

    lr_scale: float = 1.0  # this module's lr = train.lr · schedule · lr_scale
    freeze: bool = False  # no gradients, no optimizer state


@dataclass
class TrainConfig:
    steps: int = 600
    global_batch_size: int = 32
    microbatches: int = 1  # M per data-parallel replica per step (gradient accumulation)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr·min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    dtype: str = choice("fp32", "fp32", "bf16")  # bf16: autocast compute, fp32 master weights
    device: str = choice("auto", "auto", "cpu", "cuda")
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate on the held-out split once, at the end
    eval_max_new_tokens: int = 64  # exact match generates at most this many tokens (up to the longest answer)
    compile: bool = False  # torch.compile each transformer block (fuses norms, activations, rotary)
    # recompute each transformer block's activations in backward: "full" (the whole block) or "selective"
    # (all but matmul / attention outputs); less activation memory for more compute
    activation_checkpointing: str = choice("none", "none", "full", "selective")
    vision: ModuleTrainConfig = field(default_factory=ModuleTrainConfig)
    audio: ModuleTrainConfig = field(default_factory=ModuleTrainConfig)
    language: ModuleTrainConfig = field(default_factory=ModuleTrainConfig)


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    tensorboard: bool = True
    wandb: bool = False  # Weights & Biases next to TensorBoard (pip install 'loom[wandb]')
    wandb_project: str = "loom"
    wandb_mode: str = choice("online", "online", "offline")  # offline: written under out_dir/wandb, synced later
    progress: bool = True  # live progress bar; plain log lines when false or not a terminal
    save_every: int = 0  # 0: save a checkpoint only at the end
    async_save: bool = False  # write checkpoints in the background (host copy first); published at the next save
    keep_last: int = 0  # sharded step-N checkpoints kept in out_dir (0: all); older ones go after a newer one is complete
    resume: str = ""  # "" fresh; "auto": out_dir's latest checkpoint (fresh if none); or a checkpoint folder


@dataclass
class ModuleLayoutConfig:
    """[layout.<module>]: how one module is split. dp = 0 derives it: len(ranks) / (tp·cp·pp)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 0
    ranks: str | int = ""  # "first-last", or one rank (2 or "2"); empty: the LLM's ranks (colocated), for it the whole world
    sequence_parallel: bool = False  # shard the residual stream's tokens (an encoder's packed rows) over tp


@dataclass
class LayoutConfig:
    world_size: int = 0  # 0: taken from the launcher (WORLD_SIZE)
    vision: ModuleLayoutConfig | None = None  # not listed: same ranks as the LLM, data parallel only
    audio: ModuleLayoutConfig | None = None
    language: ModuleLayoutConfig | None = None


@dataclass
class ParallelConfig:
    backend: str = choice("auto", "auto", "gloo", "nccl")  # auto: NCCL with CUDA, gloo without
    reshard_after_forward: bool = True  # FSDP2: free gathered block weights after forward (less memory)
    blocks_per_unit: int = 1  # FSDP2: consecutive blocks gathered together (fewer, larger collectives and hooks)
    debug_checks: bool = False  # verify invariants at run time, e.g. encoder output equal on its tp ranks
    timeout_s: int = 600  # a collective that does not complete in this time ends the run with an error
    # LLM pipeline (layout.language.pp > 1): torch.distributed.pipelining's schedule over the M microbatches
    pp_schedule: str = choice("1f1b", "1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "zbv")
    pp_virtual_stages: int = 1  # stages per pp rank (interleaved_1f1b, zero_bubble: ≥ 2 cuts the bubble; zbv: 2)
    pp_split: list[int] = field(default_factory=list)  # layers per stage, e.g. [5, 7]; empty: balanced by cost
    # FSDP2 under pp: reduce-scatter once per step (unsharded grads held) or per microbatch (sharded, M× traffic)
    pp_grad_reduce: str = choice("step", "step", "microbatch")


@dataclass
class JobConfig:
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), world_size: int | None = None
) -> JobConfig:
    """Defaults ← TOML file ← `--a.b=value` overrides, then validate() (layouts too when the world size is
    known, from the argument or layout.world_size)."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    cfg = from_dict(JobConfig, data, "")
    cfg.model = _with_pretrained_sizes(cfg.model)
    validate(cfg, world_size)
    return cfg


def _with_pretrained_sizes(m: ModelConfig) -> ModelConfig:
    """A module whose `hf` folder is set takes its sizes from that folder's config.json."""
    if not any(getattr(getattr(m, name, None), "hf", "") for name in ("language", *m.encoders)):
        return m
    from loom.models.hf import HFError, resolve_pretrained_configs

    try:
        return resolve_pretrained_configs(m)
    except HFError as e:
        raise ConfigError(str(e)) from None


# ---------------------------------------------------------------- validation


def validate(cfg: JobConfig, world_size: int | None = None) -> None:
    """Checks that need more than one field; raises ConfigError on the first problem."""
    from loom.data.tokenizer import ByteTokenizer
    from loom.topology.checks import check_placement
    from loom.topology.layout import resolve_placement

    m, d, t = cfg.model, cfg.data, cfg.train
    _positive(
        {
            "train.steps": t.steps,
            "train.global_batch_size": t.global_batch_size,
            "train.microbatches": t.microbatches,
            "train.log_every": t.log_every,
            "train.eval_max_new_tokens": t.eval_max_new_tokens,
            "data.train_size": d.train_size,
            "data.heldout_size": d.heldout_size,
            "data.pad_to_multiple": d.pad_to_multiple,
            "data.prefetch_steps": d.prefetch_steps,
            "parallel.blocks_per_unit": cfg.parallel.blocks_per_unit,
            "parallel.timeout_s": cfg.parallel.timeout_s,
            "model.language.num_layers": m.language.num_layers,
            "model.language.num_heads": m.language.num_heads,
            "model.language.num_kv_heads": m.language.num_kv_heads,
        }
    )
    _non_negative(
        {
            "train.lr": t.lr,
            "train.warmup_steps": t.warmup_steps,
            "train.weight_decay": t.weight_decay,
            "train.grad_clip": t.grad_clip,
            "train.eval_every": t.eval_every,
            "data.tokens_per_microbatch": d.tokens_per_microbatch,
            "data.padded_length": d.padded_length,
            "data.workers": d.workers,
            "run.save_every": cfg.run.save_every,
            "run.keep_last": cfg.run.keep_last,
        }
    )
    for name in ("vision", "audio", "language"):
        if getattr(t, name).lr_scale < 0:
            raise ConfigError(f"train.{name}.lr_scale = {getattr(t, name).lr_scale} must be ≥ 0")
    if all(getattr(t, n).freeze for n in ("language", *m.encoders)):
        raise ConfigError("every module is frozen (train.<module>.freeze = true); nothing would train")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio = {t.min_lr_ratio} must lie in [0, 1]")
    for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{key} = {beta} must lie in [0, 1)")
    for name in m.encoders:
        if name not in ("vision", "audio"):
            raise ConfigError(f"model.encoders contains {name!r}; allowed: ['vision', 'audio']")
    if d.sources:
        _validate_sources(cfg)
    else:
        _validate_tasks(cfg)
    _positive({f"model.{name}.{k}": v for name in ("language", *m.encoders)
               for k, v in dataclasses.asdict(getattr(m, name)).items()
               if k in _SIZE_FIELDS and not (k == "head_dim" and v == 0)})
    _validate_language(m.language, 0 if d.sources else ByteTokenizer().vocab_size)  # a tokenizer's: job_data grows it
    for name in m.encoders:
        enc = getattr(m, name)
        if enc.hidden_size % enc.num_heads:
            raise ConfigError(
                f"model.{name}.hidden_size = {enc.hidden_size} is not divisible by "
                f"model.{name}.num_heads = {enc.num_heads}"
            )
    if m.vision.position_grid < 1 or m.vision.patch_size < 1:
        raise ConfigError("model.vision.patch_size and model.vision.position_grid must be ≥ 1")
    if m.attention == "varlen" and (t.device == "cpu" or d.format != "thd"):
        raise ConfigError(
            "model.attention = 'varlen' runs only on CUDA with packed batches (data.format = 'thd'); "
            "use model.attention = 'auto' to fall back to SDPA elsewhere"
        )
    if d.tokens_per_microbatch and d.format != "thd":
        raise ConfigError("data.tokens_per_microbatch packs microbatches (data.format = 'thd'); padded (bshd) "
                          "microbatches are [rows, data.padded_length]: set data.tokens_per_microbatch = 0 and "
                          "data.padded_length to fix their length")
    if d.padded_length and d.format != "bshd":
        raise ConfigError(f"data.padded_length = {d.padded_length} is the rows' length of padded batches; set "
                          f"data.format = 'bshd', or data.tokens_per_microbatch for packed (thd) ones")
    if not d.tokens_per_microbatch and t.global_batch_size % t.microbatches:
        raise ConfigError(f"train.global_batch_size = {t.global_batch_size} is not divisible by train.microbatches "
                          f"= {t.microbatches}; or set data.tokens_per_microbatch to pack microbatches by tokens")
    for name, rows in d.encoder_rows_per_microbatch.items():
        if name not in cfg.model.encoders or not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise ConfigError(f"data.encoder_rows_per_microbatch.{name} = {rows!r}: expected a positive row count "
                              f"for one of model.encoders = {cfg.model.encoders}")
    if t.activation_checkpointing == "selective" and t.compile:
        raise ConfigError(
            "train.activation_checkpointing = 'selective' does not compose with train.compile = true: its per-op "
            "policy runs as a dispatch mode, which torch.compile does not trace, and compiling around the "
            "checkpoint needs blocks without graph breaks (loom's CPU/fp32 and context-parallel attention break "
            "them); use 'full' with compile, or 'selective' without it"
        )
    if cfg.run.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("run.wandb = true needs the wandb package, which is not installed: "
                          "pip install 'loom[wandb]' (or set run.wandb = false)")
    declared = cfg.layout.world_size
    if declared and world_size and declared != world_size:
        raise ConfigError(f"layout.world_size = {declared} but the launcher started {world_size} ranks")
    world = world_size or declared
    if world:
        check_placement(resolve_placement(cfg, world), cfg)


def _validate_tasks(cfg: JobConfig) -> None:
    from loom.data.tasks import TASKS

    m, d = cfg.model, cfg.data
    if cfg.train.global_batch_size > d.train_size:
        raise ConfigError(f"train.global_batch_size = {cfg.train.global_batch_size} exceeds data.train_size = "
                          f"{d.train_size}")
    for task in d.tasks:
        if task not in TASKS:
            raise ConfigError(f"data.tasks contains {task!r}; allowed: {list(TASKS)}")
    needs = {"digits": "vision", "shapes": "vision", "tones": "audio"}
    for task in d.tasks:
        if needs[task] not in m.encoders:
            raise ConfigError(
                f"data.tasks contains {task!r}, which needs the {needs[task]} encoder, but model.encoders = "
                f"{m.encoders}; add {needs[task]!r} to model.encoders or remove {task!r}"
            )
    if not d.tasks:
        raise ConfigError("data.tasks is empty; choose from " + str(list(TASKS)))
    if m.tokenizer:
        raise ConfigError(f"model.tokenizer = {m.tokenizer!r} is the tokenizer of a user's data ([[data.sources]]); "
                          f"the built-in tasks (data.tasks) use loom's byte tokenizer")


def _validate_sources(cfg: JobConfig) -> None:
    """A user's JSONL data: the files exist and have weights, a tokenizer is named (its contents are read by
    train/job_data.py, before the model's weights)."""
    m, d = cfg.model, cfg.data
    if not m.tokenizer:
        raise ConfigError("data.sources needs model.tokenizer: a Hugging Face tokenizer folder (tokenizer.json and a "
                          "chat template), usually the LLM's own folder")
    paths = {f"data.sources[{i}].path": s.path for i, s in enumerate(d.sources)}
    for key, path in {**paths, **({"data.heldout": d.heldout} if d.heldout else {})}.items():
        if not path or not Path(path).exists():
            raise ConfigError(f"{key} = {path!r}: no such file (a JSONL of conversations, a parquet file, or a "
                              f"folder of parquet / arrow files)")
        if is_table(path) and importlib.util.find_spec("pyarrow") is None:
            raise ConfigError(f"{key} = {path!r} is a table, read with pyarrow, which is not installed: "
                              f"pip install 'loom[tables]'")
    for i, source in enumerate(d.sources):
        if not source.weight > 0:
            raise ConfigError(f"data.sources[{i}].weight = {source.weight} must be > 0")
    if d.image_min_pixels < 0 or d.image_max_pixels < 0 or (
            d.image_max_pixels and d.image_min_pixels > d.image_max_pixels):
        raise ConfigError(f"data.image_min_pixels = {d.image_min_pixels}, data.image_max_pixels = "
                          f"{d.image_max_pixels}: need 0 ≤ min ≤ max (0: the default bound)")
    if d.format == "bshd" and not d.padded_length:
        raise ConfigError("data.format = 'bshd' with data.sources needs data.padded_length (the tokens of every row): "
                          "a user's longest sample is not known before it is drawn")


# sizes that must be ≥ 1 in every model config that has them (head_dim 0 means "derived")
_SIZE_FIELDS = {
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "channels", "patch_size", "position_grid", "num_features", "max_positions",
}


def _validate_language(lm: LLMConfig, tokenizer_vocab: int) -> None:
    if lm.num_heads % lm.num_kv_heads:
        raise ConfigError(
            f"model.language.num_heads = {lm.num_heads} is not divisible by num_kv_heads = {lm.num_kv_heads} "
            f"(grouped-query attention shares each KV head among an equal number of query heads)"
        )
    if not lm.head_dim and lm.hidden_size % lm.num_heads:
        raise ConfigError(
            f"model.language.hidden_size = {lm.hidden_size} is not divisible by num_heads = {lm.num_heads}; "
            f"set model.language.head_dim explicitly"
        )
    if lm.dim_per_head % 2:
        raise ConfigError(f"model.language head dim = {lm.dim_per_head} must be even for rotary embedding")
    if lm.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.language.vocab_size = {lm.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids"
        )


def _positive(values: dict[str, float]) -> None:
    for key, v in values.items():
        if v <= 0:
            raise ConfigError(f"{key} = {v} must be > 0")


def _non_negative(values: dict[str, float]) -> None:
    for key, v in values.items():
        if v < 0:
            raise ConfigError(f"{key} = {v} must be ≥ 0")
