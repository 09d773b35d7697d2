"""The [model] table's sizes, checked before anything is built: caught here, not by a failing forward or a
silently degenerate model. Layout-dependent checks (a tp degree splitting the heads, ...) are
topology/checks.py's; sizes read from a Hugging Face folder are filled in first (models/hf/load.py).
"""

from __future__ import annotations

import dataclasses

from loom.models.llm import LLMConfig
from loom.models.multimodal import ModelConfig
from loom.typed_config import ConfigError, check_positive

# sizes that must be ≥ 1 in every model config that has them (head_dim 0 means "derived")
SIZE_FIELDS = {
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "channels", "patch_size", "position_grid", "num_features", "max_positions",
}


def check_model(m: ModelConfig, tokenizer_vocab: int) -> None:
    """The LLM and the encoders in use; `tokenizer_vocab`: the ids the LLM's vocabulary must hold (0 when the
    tokenizer is a user's, whose added ids train/job_data.py grows the vocabulary by)."""
    check_positive({f"model.{name}.{k}": v for name in ("language", *m.encoders)
                    for k, v in dataclasses.asdict(getattr(m, name)).items()
                    if k in SIZE_FIELDS and not (k == "head_dim" and v == 0)})
    check_language(m.language, tokenizer_vocab)
    for name in m.encoders:
        enc = getattr(m, name)
        if enc.hidden_size % enc.num_heads:
            raise ConfigError(
                f"model.{name}.hidden_size = {enc.hidden_size} is not divisible by "
                f"model.{name}.num_heads = {enc.num_heads}"
            )
    if m.vision.position_grid < 1 or m.vision.patch_size < 1:
        raise ConfigError("model.vision.patch_size and model.vision.position_grid must be ≥ 1")


def check_language(lm: LLMConfig, tokenizer_vocab: int) -> None:
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
