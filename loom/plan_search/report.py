"""What `loom plan --search` shows and writes: the ranked layouts as a table, the best as a TOML config that
`loom train` takes (the original config, the command line's overrides and the chosen keys)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from rich.table import Table

from loom.config import JobConfig
from loom.plan_search.search import GIB, Candidate, SearchResult
from loom.typed_config import parse_override, set_dotted

TERMS = ("compute", "elementwise", "fsdp", "tp", "cp", "ep", "pp", "bridge", "optimizer", "host")


def ranking_table(result: SearchResult, modules: list[str], world: int) -> Table:
    table = Table(title=f"loom plan --search: the {len(result.ranked)} fastest layouts on {world} GPUs (predicted)")
    table.add_column("#", justify="right")
    table.add_column("placement")
    for name in modules:
        table.add_column(name)
    for col in ("M", "T", "recompute", "tokens/s", "step ms", "GiB/GPU", "bubble", "largest terms (ms)"):
        table.add_column(col, justify="right" if col not in ("largest terms (ms)",) else "left")
    for i, r in enumerate(result.ranked, 1):
        c, e = r.candidate, r.estimate
        terms = sorted(((k, v) for k, v in e.seconds.items() if v > 0), key=lambda kv: -kv[1])[:3]
        table.add_row(str(i), "colocated" if c.colocated else "non-colocated",
                      *(c.describe(n) for n in modules), str(c.microbatches),
                      str(c.tokens_per_microbatch or "—"), c.activation_checkpointing or "—",
                      f"{e.tokens_per_s:,.0f}", f"{e.step_s * 1e3:.1f}",
                      f"{e.memory_bytes / GIB:.2f}", f"{e.bubble:.0%}",
                      " ".join(f"{k} {v * 1e3:.1f}" for k, v in terms))
    return table


def summary_line(result: SearchResult) -> str:
    refused = sum(result.refused.values())
    line = (f"{result.enumerated} layouts priced; {result.validated} checked by loom best first, {refused} refused, "
            f"{result.over_memory} over the memory limit")
    if result.refused:
        reason, n = result.refused.most_common(1)[0]
        line += f" (most often: {reason!r}, {n}×)"
    return line


def chosen_config_text(config: str | None, overrides: list[str], c: Candidate, cfg: JobConfig) -> str:
    """The original TOML with the command line's overrides and the candidate's keys set, input paths absolute
    (so the file runs from wherever it is written)."""
    data = tomllib.loads(Path(config).read_text()) if config else {}
    for item in [*overrides, *c.overrides()]:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    m, d = cfg.model, cfg.data  # load_config resolved these from the config's folder
    for name in ("language", "vision", "audio"):
        if getattr(m, name).hf:
            set_dotted(data, f"model.{name}.hf", getattr(m, name).hf)
    if m.tokenizer:
        set_dotted(data, "model.tokenizer", m.tokenizer)
    if d.heldout:
        set_dotted(data, "data.heldout", d.heldout)
    if d.sources:
        data.setdefault("data", {})["sources"] = [{"path": s.path, "weight": s.weight} for s in d.sources]
    head = (f"# written by `loom plan --search` from {config or 'loom/default.toml'}: the original config with the "
            f"chosen layout,\n# train.microbatches, data.tokens_per_microbatch and train.activation_checkpointing "
            f"(input paths made absolute).\n")
    return head + to_toml(data)


def write_chosen(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def default_output(config: str | None) -> str:
    stem = os.path.splitext(os.path.basename(config))[0] if config else "default"
    return f"{stem}.search.toml"


# ---------------------------------------------------------------- a small TOML writer (tomllib only reads)


def to_toml(data: dict) -> str:
    lines: list[str] = []
    _table(data, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _table(data: dict, path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict) and not _is_table_array(v)}
    if path and (scalars or not data):
        lines += ["", f"[{'.'.join(map(_key, path))}]"]
    for k, v in scalars.items():
        lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in data.items():
        if isinstance(v, dict):
            _table(v, [*path, k], lines)
        elif _is_table_array(v):
            for item in v:
                lines += ["", f"[[{'.'.join(map(_key, [*path, k]))}]]"]
                lines += [f"{_key(ik)} = {_value(iv)}" for ik, iv in item.items()]


def _is_table_array(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _value(k)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")
