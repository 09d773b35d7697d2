"""A config's paths to the user's files — `data.sources[i].path`, `data.heldout`, `model.tokenizer`, each
`[model.*] hf` — are relative to the config file's folder, so a config runs from any directory; the same key
given as a `--a.b=value` override is relative to the current directory, as a command line's paths are.

Output paths (`run.out_dir`, `run.resume`) stay relative to the current directory: where a run writes is the
caller's choice, not the recipe's.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from loom.config import JobConfig
from loom.typed_config import parse_override

MODULES = ("language", "vision", "audio")  # the [model.*] tables with an `hf` folder


def with_config_relative_paths(cfg: JobConfig, config_file: str | Path | None, overrides: list[str] | tuple[str, ...]
                               ) -> JobConfig:
    """`cfg` with each input path the config file gave made absolute from the file's folder (a path an override
    gave, or an absolute one, is left as it is)."""
    if config_file is None:
        return cfg
    folder = os.path.dirname(os.path.abspath(config_file))
    given = [parse_override(o)[0] for o in overrides]

    def resolve(key: str, value: str) -> str:
        from_command_line = any(key == k or key.startswith(k + ".") for k in given)
        return value if not value or from_command_line else os.path.normpath(os.path.join(folder, value))

    m, d = cfg.model, cfg.data
    modules = {name: dataclasses.replace(getattr(m, name), hf=resolve(f"model.{name}.hf", getattr(m, name).hf))
               for name in MODULES}
    model = dataclasses.replace(m, tokenizer=resolve("model.tokenizer", m.tokenizer), hf=resolve("model.hf", m.hf),
                                **modules)
    sources = [dataclasses.replace(s, path=resolve(f"data.sources.{i}.path", s.path)) for i, s in enumerate(d.sources)]
    data = dataclasses.replace(d, sources=sources, heldout=resolve("data.heldout", d.heldout))
    return dataclasses.replace(cfg, model=model, data=data)
