"""A job's config, read and checked: `load_config()` is the one way in, for the CLI, the tests and the benches.

Every problem is reported before any model is built, with the dotted key, the value and what is allowed. The
checks live with what they check; this module runs them in a fixed order (the first problem is the one reported):

    config.check_values          each field on its own (signs, ranges, names)
    data/checks.check_data       built-in tasks vs encoders, or a user's sources on disk
    models/checks.check_model    the model's sizes, the LLM's vocabulary vs the byte tokenizer
    config.check_combinations    fields that must agree (attention vs device and format, batch shapes, ...)
    check_installed              optional packages the config asks for (wandb)
    topology/checks.check_layout the world size, and each module's layout on it (when it is known)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from loom.config import JobConfig, check_combinations, check_values, read_config
from loom.config_paths import with_config_relative_paths
from loom.data.checks import check_data
from loom.data.tokenizer import ByteTokenizer
from loom.models.checks import check_model
from loom.models.hf.load import with_pretrained_sizes
from loom.topology.checks import check_layout
from loom.typed_config import ConfigError


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), world_size: int | None = None
) -> JobConfig:
    """Defaults ← TOML file ← `--a.b=value` overrides, the file's input paths relative to its folder
    (config_paths.py), the sizes of modules read from Hugging Face folders,
    then check_config() (layouts too when the world size is known, from the argument or layout.world_size)."""
    cfg = with_config_relative_paths(read_config(path, overrides), path, overrides)
    cfg.model = with_pretrained_sizes(cfg.model)
    check_config(cfg, world_size)
    return cfg


def check_config(cfg: JobConfig, world_size: int | None = None) -> None:
    """Every check of a read config, in order; raises ConfigError on the first problem."""
    check_values(cfg)
    check_data(cfg)
    # a user's tokenizer: train/job_data.py grows the vocabulary by the ids it adds
    check_model(cfg.model, 0 if cfg.data.sources else ByteTokenizer().vocab_size)
    check_combinations(cfg)
    check_installed(cfg)
    check_layout(cfg, world_size)


def check_installed(cfg: JobConfig) -> None:
    """Optional packages the config turns on (pyarrow for tables is data/checks.py's)."""
    if cfg.run.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("run.wandb = true needs the wandb package, which is not installed: "
                          "pip install 'loom[wandb]' (or set run.wandb = false)")
