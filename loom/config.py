"""The job's configuration as data: the JobConfig dataclasses, read from TOML with dotted `--a.b=value`
overrides (typed_config.py), and the checks that need nothing but the config's own fields — a value's sign or
range, fields that must agree with each other.

Checks against other parts of loom (the model's sizes, the data on disk, the layout on the ranks) live with
those parts, and loom/job.py runs all of them in order. This module imports only typed_config.py and two
leaves of config dataclasses: the model's (model_config.py) and the layouts' and parallelism's (parallel_config.py).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from loom.model_config import ModelConfig
from loom.parallel_config import LayoutConfig, ParallelConfig
from loom.typed_config import (
    ConfigError,
    check_non_negative,
    check_positive,
    choice,
    from_dict,
    parse_override,
    set_dotted,
)


@dataclass
class SourceConfig:
    """[[data.sources]]: one JSONL file of conversations and its share of the mixture."""

    path: str = ""  # a JSONL file, a parquet file or a `datasets` folder; in a config, relative to its folder
    weight: float = 1.0  # > 0: the source's share of the mixture is its weight over the sum of the weights


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
    # LLM replicas planned together: a step's items are cut into cells, one per this many consecutive replicas, and
    # the token packer balances each cell alone, so a rank plans only its own cells, whatever the world (0, or at
    # least the LLM's dp: the whole batch as one cell)
    balance_replicas: int = 64
    # train.compile: rows of one call of an encoder's layers, e.g. {vision = 2048}; fixed, so they never recompile
    # (not listed: T per LLM microbatch served, always enough; a call with more rows compiles again)
    encoder_rows_per_microbatch: dict = field(default_factory=dict)
    seed: int = 0  # the built-in tasks' examples and every job's sample order, a function of (seed, step)
    workers: int = 2  # processes preparing the coming steps (plan, this rank's samples) while one trains; 0: in step
    prescan_cache: bool = False  # keep each source's prescan beside it (<source>.prescan-<key>.json) for the next start
    prefetch_steps: int = 2  # steps each worker holds ready


@dataclass
class ModuleTrainConfig:
    """[train.<module>]: per-module optimisation."""

    lr_scale: float = 1.0  # this module's lr = train.lr · schedule · lr_scale
    freeze: bool = False  # no gradients, no optimizer state


@dataclass
class GRPOConfig:
    """[train.grpo]: the GRPO objective (train.objective = "grpo"); per-token fields from the data: advantage,
    and optionally logprobs (the behaviour policy's) and ref_logprobs (the reference policy's)."""

    clip_low: float = 0.2  # ε_low: the ratio is clipped below at 1 − ε_low
    clip_high: float = 0.2  # ε_high: above at 1 + ε_high (DAPO's clip-higher uses 0.28)
    dual_clip: float = 0.0  # c > 1: for A < 0 the loss is capped at −A·c; 0: off
    kl_beta: float = 0.0  # β: weight of the k3 estimate of KL(policy ‖ reference), from ref_logprobs
    # "token": every completion token weighs the same, over the global batch; "sequence": each sequence's token
    # mean, averaged over the global batch's sequences
    normalise: str = choice("token", "token", "sequence")
    temperature: float = 1.0  # the logits are divided by it before the log-softmax (as the sampler did)


@dataclass
class DPOConfig:
    """[train.dpo]: the DPO objective (train.objective = "dpo") on lines with "chosen" and "rejected" answers to
    one prompt, against the reference policy (train.reference)."""

    beta: float = 0.1  # β in −log σ(β·[(lp_c − lp_ref_c) − (lp_r − lp_ref_r)])
    length_normalise: bool = False  # each answer's logprob sums divided by its tokens (a per-token mean)
    sft_weight: float = 0.0  # α: + α · the chosen answer's mean token cross-entropy, per pair


@dataclass
class TrainConfig:
    steps: int = 600  # optimizer steps
    global_batch_size: int = 32  # sequences per optimizer step over every replica (a DPO pair is two)
    microbatches: int = 1  # M per data-parallel replica per step (gradient accumulation)
    lr: float = 2e-3  # the peak learning rate, reached after warmup
    min_lr_ratio: float = 0.1  # cosine decays to lr·min_lr_ratio
    warmup_steps: int = 30  # lr rises linearly over these steps, then follows the cosine
    weight_decay: float = 0.01  # AdamW's, on matrices only (norms, biases and gains are not decayed)
    beta1: float = 0.9  # AdamW's β1
    beta2: float = 0.95  # AdamW's β2
    eps: float = 1e-8  # AdamW's ε: larger damps the steps of weights whose gradients are mostly noise (RL)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    dtype: str = choice("fp32", "fp32", "bf16")  # bf16: autocast compute, fp32 master weights
    device: str = choice("auto", "auto", "cpu", "cuda")  # auto: the LOCAL_RANK's GPU when CUDA is present, else CPU
    seed: int = 0  # initial weights, drawn per parameter name: the same under every layout
    log_every: int = 10  # steps (loom rl: iterations) between status lines when no progress bar shows
    eval_every: int = 0  # 0: evaluate on the held-out split once, at the end
    eval_max_new_tokens: int = 64  # exact match generates at most this many tokens (up to the longest answer)
    compile: bool = False  # torch.compile each transformer block (fuses norms, activations, rotary)
    # "aot_eager": the same graphs (dynamo + AOTAutograd) run without generated code (CPU tests: seconds, not minutes)
    compile_backend: str = choice("inductor", "inductor", "aot_eager")
    # "reduce-overhead": each block replayed as a CUDA graph (one launch, not one per kernel), on one GPU: the
    # LLM's blocks captured once; an encoder's rows rounded up to a quarter of its budget, each count captured once
    compile_mode: str = choice("default", "default", "reduce-overhead")
    compile_cache_dir: str = ""  # inductor's (and AOTAutograd's) on-disk cache: a later start reuses its kernels
    # recompute each block's activations in backward: "full" or "selective" (all but matmul / attention outputs)
    activation_checkpointing: str = choice("none", "none", "full", "selective")
    # what a step minimises: "sft" (next-token cross-entropy), "grpo" ([train.grpo]) or "dpo" ([train.dpo])
    objective: str = choice("sft", "sft", "grpo", "dpo")
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    # the frozen policy whose logprobs each step scores first (a per-token `ref_logprobs` field: GRPO's KL,
    # DPO's implicit reward): "none", "initial" (the weights the run starts from), or a loom checkpoint folder
    reference: str = "none"
    vision: ModuleTrainConfig = field(default_factory=ModuleTrainConfig)
    audio: ModuleTrainConfig = field(default_factory=ModuleTrainConfig)
    language: ModuleTrainConfig = field(default_factory=ModuleTrainConfig)
    gc_every: int = 50  # Python's collector runs every this many steps, on every rank at once (0: when it likes)

    @property
    def sequences_per_item(self) -> int:
        """Sequences one dataset item trains, all in one microbatch: a DPO pair's two, else one."""
        return 2 if self.objective == "dpo" else 1


@dataclass
class RunConfig:
    out_dir: str = "runs/default"  # checkpoints, metrics.jsonl, tensorboard/; relative to the current directory
    tensorboard: bool = True  # event files under out_dir/tensorboard
    wandb: bool = False  # Weights & Biases next to TensorBoard (pip install 'loom[wandb]')
    wandb_project: str = "loom"  # the Weights & Biases project the run is logged to
    wandb_mode: str = choice("online", "online", "offline")  # offline: written under out_dir/wandb, synced later
    progress: bool = True  # live progress bar; plain log lines when false or not a terminal
    save_every: int = 0  # 0: save a checkpoint only at the end
    async_save: bool = False  # write checkpoints in the background (host copy first); published at the next save
    # sharded step-N checkpoints kept in out_dir (0: all); older ones go after a newer one is complete
    keep_last: int = 0
    resume: str = ""  # "" fresh; "auto": out_dir's latest checkpoint (fresh if none); or a checkpoint folder


@dataclass
class ScoreConfig:
    """[score]: `loom score` and RL's scoring pass."""

    top_k: int = 0  # the k largest logits and their token ids at each scored position (0: none)
    temperature: float = 1.0  # the logits are divided by it first (the sampler's)


@dataclass
class RLConfig:
    """[rl]: `loom rl`'s loop — sample G completions per prompt from the policy, reward them, score them, then K
    GRPO steps over the rollouts (train.objective = "grpo", [train.grpo]), stream the weights to the sampler."""

    iterations: int = 20  # rounds of sample, reward, train
    init: str = ""  # a loom checkpoint (step-N) whose weights the policy starts from (an SFT run's, say)
    # a JSONL of prompts (messages without the final assistant turn, plus the fields the reward reads); empty:
    # the job's training samples, each cut before its answer
    prompts: str = ""
    prompts_per_iteration: int = 16  # drawn in a seeded order
    group_size: int = 4  # G completions per prompt
    steps_per_iteration: int = 1  # K optimizer steps over the rollouts (train.global_batch_size each)
    max_new_tokens: int = 16  # a completion's most tokens
    temperature: float = 1.0  # the sampler's (train.grpo.temperature must match)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this probability (1: all)
    # "package.module:function" called with (prompt record, completion text) → float; empty: exact match of the
    # built-in tasks' (or a line's final assistant turn's) answer
    reward: str = ""
    advantage: str = choice("group", "group", "mean")  # (r − mean_g) / (std_g + 1e-6), or r − mean_g (Dr. GRPO)
    equal_groups: str = choice("skip", "skip", "keep")  # groups whose rewards are all equal: no signal
    prompts_per_sampling_batch: int = 8  # prompts (× G rows) one sampler call decodes together
    save_every: int = 0  # iterations between checkpoints (0: at the end only)
    eval_every: int = 0  # iterations between held-out exact-match evaluations (0: at the end only)


@dataclass
class JobConfig:
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- reading


def read_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Defaults ← TOML file ← `--a.b=value` overrides; types and choices checked, nothing else (loom/job.py's
    load_config() runs every check)."""
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
    return from_dict(JobConfig, data, "")


# ---------------------------------------------------------------- checks of the config alone


def check_values(cfg: JobConfig) -> None:
    """Each value on its own: signs, ranges, names; raises ConfigError on the first problem."""
    m, d, t = cfg.model, cfg.data, cfg.train
    check_positive(
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
            "parallel.ep_chunks": cfg.parallel.ep_chunks,
            "parallel.timeout_s": cfg.parallel.timeout_s,
            "model.language.num_layers": m.language.num_layers,
            "model.language.num_heads": m.language.num_heads,
            "model.language.num_kv_heads": m.language.num_kv_heads,
        }
    )
    check_non_negative(
        {
            "train.lr": t.lr,
            "train.warmup_steps": t.warmup_steps,
            "train.weight_decay": t.weight_decay,
            "train.grad_clip": t.grad_clip,
            "train.eval_every": t.eval_every,
            "data.tokens_per_microbatch": d.tokens_per_microbatch,
            "data.padded_length": d.padded_length,
            "data.balance_replicas": d.balance_replicas,
            "parallel.replica_bucket_mb": cfg.parallel.replica_bucket_mb,
            "data.workers": d.workers,
            "run.save_every": cfg.run.save_every,
            "run.keep_last": cfg.run.keep_last,
            "train.grpo.clip_low": t.grpo.clip_low,
            "train.grpo.clip_high": t.grpo.clip_high,
            "train.grpo.kl_beta": t.grpo.kl_beta,
        }
    )
    check_positive({"train.grpo.temperature": t.grpo.temperature, "score.temperature": cfg.score.temperature})
    check_non_negative({"score.top_k": cfg.score.top_k})
    if t.reference != "none" and t.objective == "sft":
        raise ConfigError(f"train.reference = {t.reference!r} is read by train.objective = 'grpo' (its KL term) "
                          f"or 'dpo'; train.objective is 'sft'")
    if t.objective == "dpo":
        if t.reference == "none":
            raise ConfigError("train.objective = 'dpo' measures each answer against the reference policy: set "
                              "train.reference = 'initial' (the weights the run starts from) or a checkpoint folder")
        if t.global_batch_size % 2:
            raise ConfigError(f"train.global_batch_size = {t.global_batch_size} counts sequences, two per DPO pair: "
                              f"use an even number")
        check_positive({"train.dpo.beta": t.dpo.beta})
        check_non_negative({"train.dpo.sft_weight": t.dpo.sft_weight})
    if t.reference not in ("none", "initial") and not Path(t.reference).is_dir():
        raise ConfigError(f"train.reference = {t.reference!r}: no such checkpoint folder (or 'none', 'initial')")
    r = cfg.rl
    check_positive({"rl.iterations": r.iterations, "rl.prompts_per_iteration": r.prompts_per_iteration,
                    "rl.group_size": r.group_size, "rl.steps_per_iteration": r.steps_per_iteration,
                    "rl.max_new_tokens": r.max_new_tokens, "rl.top_p": r.top_p,
                    "rl.prompts_per_sampling_batch": r.prompts_per_sampling_batch})
    check_non_negative({"rl.temperature": r.temperature, "rl.save_every": r.save_every,
                        "rl.eval_every": r.eval_every})
    if r.prompts and not Path(r.prompts).is_file():
        raise ConfigError(f"rl.prompts = {r.prompts!r}: no such file")
    if r.init and not Path(r.init).is_dir():
        raise ConfigError(f"rl.init = {r.init!r}: no such checkpoint folder")
    if r.top_p > 1:
        raise ConfigError(f"rl.top_p = {r.top_p} must be in (0, 1]")
    if r.reward and (r.reward.count(":") != 1 or not all(r.reward.split(":"))):
        raise ConfigError(f"rl.reward = {r.reward!r}: expected \"package.module:function\"")
    if t.grpo.dual_clip and t.grpo.dual_clip <= 1:
        raise ConfigError(f"train.grpo.dual_clip = {t.grpo.dual_clip} must be > 1 (0: off)")
    for name in ("vision", "audio", "language"):
        if getattr(t, name).lr_scale < 0:
            raise ConfigError(f"train.{name}.lr_scale = {getattr(t, name).lr_scale} must be ≥ 0")
    # an unknown encoder has no train.<name> table: not frozen here, reported just below
    if all(getattr(getattr(t, n, None), "freeze", False) for n in ("language", *m.encoders)):
        raise ConfigError("every module is frozen (train.<module>.freeze = true); nothing would train")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio = {t.min_lr_ratio} must lie in [0, 1]")
    check_positive({"train.eps": t.eps})
    for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{key} = {beta} must lie in [0, 1)")
    for name in m.encoders:
        if name not in ("vision", "audio"):
            raise ConfigError(f"model.encoders contains {name!r}; allowed: ['vision', 'audio']")


def check_combinations(cfg: JobConfig) -> None:
    """Fields that must agree with each other (attention backend and device, batch shape and format, ...)."""
    m, d, t = cfg.model, cfg.data, cfg.train
    if m.attention == "varlen" and (t.device == "cpu" or d.format != "thd"):
        raise ConfigError(
            "model.attention = 'varlen' runs only on CUDA with packed batches (data.format = 'thd'); "
            "use model.attention = 'auto' to fall back to SDPA elsewhere"
        )
    if (t.device, cfg.parallel.backend) in (("cpu", "nccl"), ("cuda", "gloo")):  # NCCL runs on GPUs, gloo on CPU
        raise ConfigError(f"train.device = {t.device!r} and parallel.backend = {cfg.parallel.backend!r} disagree: "
                          f"NCCL runs the ranks on GPUs, gloo on CPU; set one of them to 'auto'")
    if d.tokens_per_microbatch and d.format != "thd":
        raise ConfigError("data.tokens_per_microbatch packs microbatches (data.format = 'thd'); padded (bshd) "
                          "microbatches are [rows, data.padded_length]: set data.tokens_per_microbatch = 0 and "
                          "data.padded_length to fix their length")
    if d.padded_length and d.format != "bshd":
        raise ConfigError(f"data.padded_length = {d.padded_length} is the rows' length of padded batches; set "
                          f"data.format = 'bshd', or data.tokens_per_microbatch for packed (thd) ones")
    per_item = t.sequences_per_item
    if not d.tokens_per_microbatch and t.global_batch_size % (per_item * t.microbatches):
        raise ConfigError(f"train.global_batch_size = {t.global_batch_size} is not divisible by "
                          f"{'2 × ' if per_item > 1 else ''}train.microbatches = {t.microbatches}"
                          f"{' (DPO: whole pairs per microbatch)' if per_item > 1 else ''}; or set "
                          f"data.tokens_per_microbatch to pack microbatches by tokens")
    for name, rows in d.encoder_rows_per_microbatch.items():
        if name not in m.encoders or not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise ConfigError(f"data.encoder_rows_per_microbatch.{name} = {rows!r}: expected a positive row count "
                              f"for one of model.encoders = {m.encoders}")
    if t.compile_mode != "default" and not (t.compile and t.compile_backend == "inductor" and d.tokens_per_microbatch):
        raise ConfigError(f"train.compile_mode = {t.compile_mode!r} captures CUDA graphs of fixed-shape blocks: it "
                          f"needs train.compile = true, train.compile_backend = 'inductor' and "
                          f"data.tokens_per_microbatch (one shape per microbatch)")
    if t.activation_checkpointing == "selective" and t.compile:
        raise ConfigError(
            "train.activation_checkpointing = 'selective' does not compose with train.compile = true: its per-op "
            "policy runs as a dispatch mode, which torch.compile does not trace, and compiling around the "
            "checkpoint needs blocks without graph breaks (loom's CPU/fp32 and context-parallel attention break "
            "them); use 'full' with compile, or 'selective' without it"
        )
