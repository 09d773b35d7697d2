"""`loom plan --search`: every layout of a job on N GPUs — placement, tp/cp/pp/dp/ep per module, microbatches,
T — priced by the cost model, filtered by memory, and accepted by loom's own checks before it is shown.

The search proposes, loom decides: a candidate is a list of `--a.b=value` overrides, and it is valid exactly when
`load_config(config, overrides, N)` accepts it (every check of `loom train`, layout included) and its steps' samples
fit its microbatches (data/bins.py's assign_bins, train/inputs.py's check_longest — the checks `loom train` runs
before and at each step). No validity rule is written a second time here. Candidates are priced first (pure
arithmetic) and validated best first, until `top` valid ones that fit are found.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from loom.config import JobConfig
from loom.data.bins import DoesNotFit, assign_bins
from loom.train.plan_cells import Cells
from loom.job import load_config
from loom.plan_search.calibration import Calibration
from loom.plan_search.cost import ModuleLayout, Settings
from loom.plan_search.estimate import Estimate, estimate_steps
from loom.parallel.fsdp import blocks_per_unit
from loom.plan_search.workload import JobFacts
from loom.topology import Topology
from loom.topology.checks import sample_multiple
from loom.train.length_rules import check_longest
from loom.typed_config import ConfigError

MICROBATCHES = (1, 2, 4, 8)
GIB = 2**30
# the share of --gpu-memory a layout's prediction may not use: the model under-predicted the 2B workload's
# measured peak by up to 19% on an H100, and a layout predicted at 91% of the GPU ran out (bench/RESULTS.md)
MEMORY_HEADROOM = 0.2


@dataclass(frozen=True)
class Candidate:
    world_size: int
    layouts: dict[str, ModuleLayout]  # module → layout, language last
    microbatches: int
    tokens_per_microbatch: int  # 0: each replica's share as it comes
    activation_checkpointing: str = ""  # "" the config's; else "none" / "full" / "selective" (searched)

    @property
    def colocated(self) -> bool:
        return len({(lay.start, lay.size) for lay in self.layouts.values()}) == 1

    def overrides(self) -> list[str]:
        """The candidate as loom's `--a.b=value` overrides: what is validated, and what the written config sets."""
        out = [f"--layout.world_size={self.world_size}"]
        for name, lay in self.layouts.items():
            last = lay.start + lay.size - 1
            out += [f"--layout.{name}.{dim}={getattr(lay, dim)}" for dim in ("tp", "cp", "pp", "dp")]
            out.append(f'--layout.{name}.ranks="{lay.start}-{last}"')
            if name == "language":
                out.append(f"--layout.language.ep={lay.ep}")
        out += [f"--train.microbatches={self.microbatches}",
                f"--data.tokens_per_microbatch={self.tokens_per_microbatch}"]
        return out + ([f"--train.activation_checkpointing={self.activation_checkpointing}"]
                      if self.activation_checkpointing else [])

    def describe(self, name: str) -> str:
        lay = self.layouts[name]
        ep = f"·ep{lay.ep}" if lay.ep > 1 else ""
        where = "" if self.colocated else f" @{lay.start}-{lay.start + lay.size - 1}"
        return f"tp{lay.tp}·cp{lay.cp}·pp{lay.pp}·dp{lay.dp}{ep}{where}"


@dataclass
class Ranked:
    candidate: Candidate
    estimate: Estimate


@dataclass
class SearchResult:
    ranked: list[Ranked]  # valid, within memory, fastest first
    enumerated: int = 0
    validated: int = 0
    over_memory: int = 0
    refused: Counter = field(default_factory=Counter)  # loom's first words of why → count


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _llm_layouts(n: int, start: int, experts: int) -> Iterator[ModuleLayout]:
    for tp, cp, pp in itertools.product(divisors(n), repeat=3):
        if n % (tp * cp * pp):
            continue
        dp = n // (tp * cp * pp)
        for ep in (divisors(dp * cp) if experts else [1]):
            yield ModuleLayout(tp, cp, pp, dp, ep, start)


def _encoder_layouts(n: int, start: int, own_ranks: bool) -> list[ModuleLayout]:
    """Encoders: tp and dp, and pp on ranks of their own (loom refuses encoder cp, and encoder pp on the LLM's
    ranks); encoders sharing ranks must agree on pp, which loom's checks leave to the validation."""
    stages = divisors(n) if own_ranks else [1]
    return [ModuleLayout(tp, 1, pp, n // (tp * pp), 1, start)
            for tp, pp in itertools.product(divisors(n), stages) if n % (tp * pp) == 0]


def token_budgets(facts: JobFacts, given: int) -> list[int]:
    """T candidates: 0 (shares as they come), the config's own, and powers of two from the longest sample's up
    to the one that holds a whole step."""
    longest = max([*facts.longest.values(), *(n for w in facts.steps for n in w.llm_lengths)], default=1)
    most = max(w.tokens for w in facts.steps)
    out, t = {0, given}, 1 << max(0, (longest - 1).bit_length())
    while True:
        out.add(t)
        if t >= most:
            break
        t *= 2
    return sorted(out)


def checkpointing_modes(cfg: JobConfig) -> tuple[str, ...]:
    """What the search tries, in this order for a layout that does not fit without: none, selective where the job
    does not compile (loom refuses it with compile), full (whole blocks recomputed: a forward more, a block's input
    kept). A layout that fits only by recomputing is then found, not refused over memory (a 32K-token sample on one
    H200: 125 GiB without, 46 with)."""
    return ("none", "full") if cfg.train.compile else ("none", "selective", "full")


def enumerate_candidates(modules: list[str], world: int, budgets: list[int], experts: int,
                         microbatches: tuple[int, ...] = MICROBATCHES, checkpointing: tuple[str, ...] = ("",)
                         ) -> Iterator[Candidate]:
    """Every combination, valid or not: colocated, then non-colocated with the encoders on ranks 0..k-1."""
    encoders = [m for m in modules if m != "language"]
    splits = [0] + (list(range(1, world)) if encoders else [])  # 0: colocated
    for k in splits:
        n_llm, llm_start = (world, 0) if k == 0 else (world - k, k)
        n_enc = world if k == 0 else k
        enc_options = [_encoder_layouts(n_enc, 0, own_ranks=k > 0) for _ in encoders]
        for lang in _llm_layouts(n_llm, llm_start, experts):
            for enc in itertools.product(*enc_options):
                layouts = {**dict(zip(encoders, enc)), "language": lang}
                for m, t, ac in itertools.product(microbatches, budgets, checkpointing):
                    yield Candidate(world, layouts, m, t, ac)


def settings_of(cfg: JobConfig, c: Candidate) -> Settings:
    return Settings(dtype_bytes=2 if cfg.train.dtype == "bf16" else 4, microbatches=c.microbatches,
                    tokens_per_microbatch=c.tokens_per_microbatch,
                    activation_checkpointing=c.activation_checkpointing or cfg.train.activation_checkpointing,
                    reshard_after_forward=cfg.parallel.reshard_after_forward,
                    unit_blocks={n: blocks_per_unit(n, getattr(cfg.model, n).num_layers, cfg.parallel)
                                 for n in ("language", *cfg.model.encoders)},
                    pp_grad_reduce=cfg.parallel.pp_grad_reduce,
                    pp_schedule=cfg.parallel.pp_schedule, pp_virtual_stages=cfg.parallel.pp_virtual_stages,
                    sequence_parallel=bool(cfg.layout.language and cfg.layout.language.sequence_parallel),
                    replicated=frozenset(n for n in ("language", *cfg.model.encoders)
                                         if (lay := getattr(cfg.layout, n)) is not None and not lay.fsdp),
                    shard={n: lay.shard for n in ("language", *cfg.model.encoders)
                           if (lay := getattr(cfg.layout, n)) is not None and lay.shard},
                    pad_to_multiple=cfg.data.pad_to_multiple, compiled=cfg.train.compile)


def validate(config: str | None, overrides: list[str], c: Candidate, facts: JobFacts) -> JobConfig:
    """loom's verdict on a candidate: its config as `loom train` would load it, or ConfigError / DoesNotFit."""
    cfg = load_config(config, [*overrides, *c.overrides()], c.world_size)
    lay = Topology.plan(cfg, c.world_size).placement.layouts["language"]
    multiple = sample_multiple(lay, cfg)
    check_longest(cfg, facts.longest, multiple)
    if cfg.data.tokens_per_microbatch:
        cells = Cells.of(cfg.data.balance_replicas, lay.dp)
        for w in facts.steps:  # the bins of the drawn steps, as the step would assign them: cell by cell
            tokens = [-(-n // multiple) * multiple for n in w.llm_lengths]
            for c in range(len(cells)):
                items = cells.items(c, len(tokens))
                part = tokens[items.start:items.stop]
                assign_bins(part, [0] * len(part), len(cells.replicas(c)), cfg.train.microbatches,
                            cfg.data.tokens_per_microbatch)
    return cfg


def search(config: str | None, overrides: list[str], base: JobConfig, facts: JobFacts, world: int,
           cal: Calibration, gpu_memory_gib: float | None = None, top: int = 10,
           microbatches: tuple[int, ...] = MICROBATCHES, headroom: float = MEMORY_HEADROOM) -> SearchResult:
    """The `top` fastest candidates loom accepts whose predicted memory fits (1 − headroom) of `gpu_memory_gib`
    (no limit: None)."""
    modules = [*base.model.encoders, "language"]
    budgets = token_budgets(facts, base.data.tokens_per_microbatch)
    experts = base.model.language.num_experts
    limit = (1 - headroom) * gpu_memory_gib * GIB if gpu_memory_gib else float("inf")
    modes = checkpointing_modes(base)
    priced = []
    for c in enumerate_candidates(modules, world, budgets, experts, microbatches, modes[:1]):
        # recomputing only costs time where a layout fits without it: the next mode only for one that does not
        for mode in modes:
            c = replace(c, activation_checkpointing=mode)
            priced.append(Ranked(c, estimate_steps(facts.sizes, c.layouts, settings_of(base, c), facts.steps, cal)))
            if priced[-1].estimate.memory_bytes <= limit:
                break
    priced.sort(key=lambda r: -r.estimate.tokens_per_s)
    result = SearchResult([], enumerated=len(priced))
    for r in priced:
        if r.estimate.memory_bytes > limit:
            result.over_memory += 1
            continue
        result.validated += 1
        try:
            validate(config, overrides, r.candidate, facts)
        except (ConfigError, DoesNotFit) as e:
            result.refused[_reason(e)] += 1
            continue
        result.ranked.append(r)
        if len(result.ranked) == top:
            break
    return result


def _reason(e: Exception) -> str:
    """The start of loom's message, up to its first number-specific part: groups refusals of one kind."""
    text = str(e).split(";")[0]
    return text if len(text) <= 90 else text[:87] + "…"
