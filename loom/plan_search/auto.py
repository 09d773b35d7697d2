"""`loom train CONFIG --layout=auto`: the search of `loom plan --search` run before any model is built; its best
layout becomes the job's overrides, said in two lines beside the runner-up (the fastest layout that differs in
more than M and T).

Every rank reaches the same choice: the search is deterministic (the same config, calibration and drawn steps give
the same arithmetic and order on every rank), and `agree_on_choice` checks it after the process group starts.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from loom.config import JobConfig
from loom.plan_search.calibration import load_calibration
from loom.plan_search.report import chosen_config_text, summary_line, write_chosen
from loom.plan_search.search import GIB, MEMORY_HEADROOM, Ranked, search
from loom.plan_search.workload import job_facts
from loom.typed_config import ConfigError

SEARCHED = 20  # valid layouts the search collects, enough to hold a runner-up with another layout


@dataclass
class AutoLayout:
    best: Ranked
    runner_up: Ranked | None
    overrides: list[str]  # the best as `--a.b=value` overrides, appended to the command line's
    lines: list[str]  # what `loom train` prints about the choice


def choose_layout(config: str | None, overrides: list[str], cfg: JobConfig, world: int, calibration: str | None,
                  gpu_memory_gib: float | None) -> AutoLayout:
    """The best layout of `config` on `world` ranks by the (calibrated) cost model; ConfigError when none fits."""
    if world < 1:
        raise ConfigError(f"--layout=auto needs the number of ranks: layout.world_size or --gpus N, got {world}")
    cal = load_calibration(calibration)
    result = search(config, overrides, cfg, job_facts(cfg), world, cal, gpu_memory_gib, SEARCHED)
    if not result.ranked:
        limit = (f" within {1 - MEMORY_HEADROOM:.0%} of --gpu-memory {gpu_memory_gib} GiB" if gpu_memory_gib else "")
        ranks = f"{world} rank{'s' * (world != 1)}"
        raise ConfigError(f"--layout=auto: no layout of {config or 'the default job'} on {ranks} is accepted by "
                          f"loom{limit}; {summary_line(result)}")
    best = result.ranked[0]
    runner_up = next((r for r in result.ranked[1:] if r.candidate.layouts != best.candidate.layouts),
                     result.ranked[1] if len(result.ranked) > 1 else None)
    modules = [*cfg.model.encoders, "language"]
    where = calibration or "H200 figures: pass --calibration FILE (loom plan --calibrate) for this machine's"
    lines = [f"loom: --layout=auto on {world} rank{'s' * (world != 1)} ({where}); {summary_line(result)}",
             f"loom: chose      {_describe(best, modules)}"]
    if runner_up is None:
        lines.append("loom: runner-up  none: loom accepts no other layout of this job")
    else:
        ratio = runner_up.estimate.tokens_per_s / best.estimate.tokens_per_s
        lines.append(f"loom: runner-up  {_describe(runner_up, modules)} ({ratio:.2f}× the chosen)")
    return AutoLayout(best, runner_up, best.candidate.overrides(), lines)


def neutral_layouts(config: str | None, overrides: list[str]) -> list[str]:
    """Overrides that reset each `[layout.<module>]` the config or command line sets to one rank's degrees, so the
    job's own layout (about to be replaced) cannot fail the first reading on another number of ranks."""
    data = tomllib.loads(Path(config).read_text()).get("layout", {}) if config else {}
    named = {o.split(".")[1] for o in overrides if o.startswith("--layout.") and o.count(".") >= 2}
    modules = sorted(m for m in {*data, *named} if m in ("vision", "audio", "language"))
    return [f"--layout.{m}.{k}={v}" for m in modules for k, v in
            (("tp", 1), ("cp", 1), ("pp", 1), ("dp", 0), ("ep", 1), ("ranks", '""'))]


def _describe(r: Ranked, modules: list[str]) -> str:
    c, e = r.candidate, r.estimate
    layouts = ", ".join(f"{n} {c.describe(n)}" for n in modules)
    placement = "colocated" if c.colocated else "non-colocated"
    recompute = f", recompute {c.activation_checkpointing}" if c.activation_checkpointing not in ("", "none") else ""
    return (f"{placement}: {layouts}; M {c.microbatches}, T {c.tokens_per_microbatch or '—'}{recompute}: "
            f"{e.tokens_per_s:,.0f} tokens/s predicted, {e.step_s * 1e3:.1f} ms a step, "
            f"{e.memory_bytes / GIB:.2f} GiB per GPU")


def write_auto_config(config: str | None, overrides: list[str], auto: AutoLayout, cfg: JobConfig) -> Path:
    """The chosen layout as a config in the run's folder (`loom verify` or a rerun takes it as it is)."""
    path = Path(cfg.run.out_dir) / "layout.auto.toml"
    return write_chosen(path, chosen_config_text(config, overrides, auto.best.candidate, cfg))


def choice_digest(overrides: list[str]) -> int:
    """A number naming the choice, the same on every rank that chose alike (for one all-reduce)."""
    return int.from_bytes(hashlib.sha256("\n".join(overrides).encode()).digest()[:7], "big")


def agree_on_choice(overrides: list[str], device) -> None:
    """Under a launcher every rank searched alone: one all-reduce of the choice's digest (min and max) proves
    they chose alike, else every rank raises the same ConfigError."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digest = choice_digest(overrides)
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t[0]) != -int(t[1]):
        raise ConfigError(f"--layout=auto: the ranks chose different layouts (rank {os.environ.get('RANK')} chose "
                          f"{' '.join(overrides)}); pass the same config, overrides and --calibration to every rank")
