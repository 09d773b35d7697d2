"""The job's data against the rest of its config and the disk, before anything is read or built: built-in
tasks need their encoders; a user's sources exist, have weights, a tokenizer and what their format needs.

The files' contents are checked later, line by line (train/prescan.py, data/source.py `checked`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from loom.config import ConfigError, JobConfig
from loom.data.tables import is_table
from loom.data.tasks import TASKS

# the encoder each built-in task's inputs go through (None: text only)
TASK_ENCODER = {"digits": "vision", "shapes": "vision", "tones": "audio", "sums": None}


def check_data(cfg: JobConfig) -> None:
    """data.sources (a user's files) or data.tasks (the built-in ones); raises ConfigError on the first problem."""
    if cfg.data.sources:
        check_sources(cfg)
    else:
        check_tasks(cfg)


def check_tasks(cfg: JobConfig) -> None:
    m, d = cfg.model, cfg.data
    if cfg.train.global_batch_size > d.train_size:
        raise ConfigError(f"train.global_batch_size = {cfg.train.global_batch_size} exceeds data.train_size = "
                          f"{d.train_size}")
    for task in d.tasks:
        if task not in TASKS:
            raise ConfigError(f"data.tasks contains {task!r}; allowed: {list(TASKS)}")
    for task in d.tasks:
        if TASK_ENCODER[task] is not None and TASK_ENCODER[task] not in m.encoders:
            raise ConfigError(
                f"data.tasks contains {task!r}, which needs the {TASK_ENCODER[task]} encoder, but model.encoders = "
                f"{m.encoders}; add {TASK_ENCODER[task]!r} to model.encoders or remove {task!r}"
            )
    if not d.tasks:
        raise ConfigError("data.tasks is empty; choose from " + str(list(TASKS)))
    v = m.vision
    images = [t for t in d.tasks if TASK_ENCODER[t] == "vision"]
    if v.class_token and "vision" in m.encoders and images:  # the tasks' images have assorted sizes
        side = v.position_grid * v.patch_size
        raise ConfigError(f"data.tasks {images} draw images of assorted sizes, and this CLIP tower takes only "
                          f"{side} × {side} (its positions do not interpolate): train it on data.sources, whose images "
                          f"its processor sizes, or on text tasks")
    if v.grid_pinpoints and "vision" in m.encoders and images:
        raise ConfigError(f"data.tasks {images} draw images as tensors, and this LLaVA-OneVision tower takes each "
                          f"image cut into tiles from its file (model.vision.grid_pinpoints): train it on "
                          f"data.sources, whose images its processor cuts, or on text tasks")
    if m.tokenizer:
        raise ConfigError(f"model.tokenizer = {m.tokenizer!r} is the tokenizer of a user's data ([[data.sources]]); "
                          f"the built-in tasks (data.tasks) use loom's byte tokenizer")


def check_sources(cfg: JobConfig) -> None:
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
