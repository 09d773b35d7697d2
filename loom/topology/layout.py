"""Layouts: where each module runs and how it is split, resolved from the config and checked up front.

A layout gives one module a contiguous range of global ranks and its degrees tp·cp·pp·dp = len(ranks).
Placement is derived: *colocated* when every module spans the same ranks, *non-colocated* when the
ranges are disjoint and tile the world. Anything else is rejected before a process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import ConfigError, JobConfig
from loom.parallel_config import ModuleLayoutConfig

# Grid dimensions from slowest to fastest varying: tp neighbours are adjacent ranks (same node, NVLink).
DIMS = ("pp", "dp", "cp", "tp")
MODULES = ("vision", "audio", "language")


@dataclass(frozen=True)
class Layout:
    module: str
    start: int  # first global rank
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    ep: int = 1  # expert parallel: not a grid dim but a view of the dp×cp ranks, ep × efsdp (parallel/experts.py)
    fsdp: bool = True  # weights sharded over dp·cp by FSDP2; false: whole on each rank (parallel/replicate.py)
    shard: int = 0  # HSDP: FSDP2 shards within runs of this many dp·cp ranks, replicated across runs; 0: all dp·cp

    @property
    def shard_size(self) -> int:
        """The ranks FSDP2 shards this module's weights over: `shard`, or every dp·cp rank."""
        return self.shard or self.dp * self.cp

    @property
    def shard_replicas(self) -> int:
        """HSDP's replicas (runs of `shard_size` dp·cp ranks holding the same shards); 1: plain FSDP2."""
        return self.dp * self.cp // self.shard_size

    @property
    def efsdp(self) -> int:
        """The ranks of dp×cp that hold the same experts, over which FSDP2 shards them."""
        return self.dp * self.cp // self.ep

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.size)

    def degree(self, dim: str) -> int:
        return getattr(self, dim)

    def describe(self) -> str:
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        whole = " replicated" if not self.fsdp and self.dp * self.cp > 1 else ""
        whole += f" hsdp{self.shard_replicas}x{self.shard_size}" if self.fsdp and self.shard_replicas > 1 else ""
        return f"tp{self.tp}·cp{self.cp}·pp{self.pp}·dp{self.dp}{ep}{whole} on ranks {self.start}-{self.ranks[-1]}"


@dataclass(frozen=True)
class Placement:
    world_size: int
    layouts: dict[str, Layout]  # module name → layout, language last

    @property
    def colocated(self) -> bool:
        return len({lay.ranks for lay in self.layouts.values()}) == 1

    @property
    def kind(self) -> str:
        return "colocated" if self.colocated else "non-colocated"


def parse_ranks(text: str | int, world_size: int, key: str) -> range:
    """'0-3' → range(0, 4); '5' or 5 → range(5, 6); '' → the whole world."""
    text = str(text)
    if not text.strip():
        return range(world_size)
    try:
        lo, _, hi = text.partition("-")
        first, last = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"{key} = {text!r} is not a rank range; write it as 'first-last', e.g. '0-3'") from None
    if first < 0 or last < first:
        raise ConfigError(f"{key} = {text!r}: the range must be ascending and start at ≥ 0")
    if last >= world_size:
        raise ConfigError(f"{key} = {text!r} reaches rank {last}, but the world has {world_size} ranks "
                          f"(0-{world_size - 1})")
    return range(first, last + 1)


def resolve_placement(cfg: JobConfig, world_size: int) -> Placement:
    """Every module's layout for a world of `world_size` ranks; raises ConfigError naming the problem."""
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be ≥ 1")
    modules = [*cfg.model.encoders, "language"]
    for name in MODULES:
        if getattr(cfg.layout, name) is not None and name not in modules:
            raise ConfigError(
                f"[layout.{name}] is set but the model has no {name} module (model.encoders = {cfg.model.encoders})"
            )
    lang_cfg = cfg.layout.language or ModuleLayoutConfig()
    lang_ranks = parse_ranks(lang_cfg.ranks, world_size, "layout.language.ranks")
    layouts = {}
    for name in modules:
        mc = getattr(cfg.layout, name)
        # an encoder not listed shares the LLM's ranks with data parallelism only
        mc = mc or (ModuleLayoutConfig() if name != "language" else lang_cfg)
        ranks = parse_ranks(mc.ranks, world_size, f"layout.{name}.ranks") if mc.ranks != "" else lang_ranks
        layouts[name] = _resolve_one(name, mc, ranks)
    _check_placement(layouts, world_size)
    return Placement(world_size, layouts)


def _resolve_one(name: str, mc: ModuleLayoutConfig, ranks: range) -> Layout:
    for dim in ("tp", "cp", "pp"):
        if getattr(mc, dim) < 1:
            raise ConfigError(f"layout.{name}.{dim} = {getattr(mc, dim)} must be ≥ 1")
    if mc.dp < 0:
        raise ConfigError(f"layout.{name}.dp = {mc.dp} must be ≥ 1 (or 0: derived from the ranks)")
    inner = mc.tp * mc.cp * mc.pp
    n = len(ranks)
    if mc.dp == 0:
        if n % inner:
            raise ConfigError(
                f"layout.{name}: tp·cp·pp = {mc.tp}·{mc.cp}·{mc.pp} = {inner} does not divide its {n} ranks "
                f"({ranks.start}-{ranks[-1]}); choose degrees whose product divides {n}"
            )
        dp = n // inner
    else:
        dp = mc.dp
        if inner * dp != n:
            raise ConfigError(
                f"layout.{name}: tp·cp·pp·dp = {mc.tp}·{mc.cp}·{mc.pp}·{dp} = {inner * dp} but it has {n} ranks "
                f"({ranks.start}-{ranks[-1]}); set dp = {n // inner if n % inner == 0 else 'a value that fits'} "
                f"or omit dp to derive it"
            )
    if mc.ep < 1:
        raise ConfigError(f"layout.{name}.ep = {mc.ep} must be ≥ 1")
    if mc.ep > 1 and name != "language":
        raise ConfigError(f"layout.{name}.ep = {mc.ep}: expert parallelism is for the LLM's experts; an encoder "
                          f"has none (valid: 1)")
    _check_shard(name, mc, dp)
    return Layout(name, ranks.start, mc.tp, mc.cp, mc.pp, dp, mc.sequence_parallel, mc.ep, mc.fsdp, mc.shard)


def _check_shard(name: str, mc: ModuleLayoutConfig, dp: int) -> None:
    """layout.<module>.shard: a divisor of the module's dp·cp, under FSDP2, without experts (for now)."""
    key, ranks = f"layout.{name}.shard = {mc.shard}", dp * mc.cp
    if mc.shard == 0:
        return
    if mc.shard < 0:
        raise ConfigError(f"{key} must be ≥ 1 (the ranks FSDP2 shards {name} over), or 0: all its dp·cp = {ranks}")
    if ranks % mc.shard:
        fits = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise ConfigError(f"{key} does not divide {name}'s dp·cp = {dp}·{mc.cp} = {ranks} ranks: HSDP shards within "
                          f"runs of `shard` of them; use one of {fits[:12]}{' …' if len(fits) > 12 else ''}")
    if not mc.fsdp:
        raise ConfigError(f"{key} with layout.{name}.fsdp = false: a replicated module holds its weights whole, "
                          f"there is nothing to shard; drop shard or set fsdp = true")
    if mc.ep > 1:
        raise ConfigError(f"{key} with layout.{name}.ep = {mc.ep}: HSDP beside expert parallelism is not supported "
                          f"yet; drop shard (FSDP2 over all dp·cp = {ranks}) or set ep = 1")


def _check_placement(layouts: dict[str, Layout], world_size: int) -> None:
    spans = {name: lay.ranks for name, lay in layouts.items()}
    if len(set(spans.values())) == 1:
        only = next(iter(spans.values()))
        if len(only) != world_size:
            raise ConfigError(
                f"every module spans ranks {only.start}-{only[-1]} but the world has {world_size} ranks; "
                f"ranks {sorted(set(range(world_size)) - set(only))} would idle"
            )
        return
    names = list(spans)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ra, rb = spans[a], spans[b]
            if ra == rb:
                continue
            common = set(ra) & set(rb)
            if common:
                raise ConfigError(
                    f"{a} (ranks {ra.start}-{ra[-1]}) and {b} (ranks {rb.start}-{rb[-1]}) partially overlap on "
                    f"ranks {sorted(common)}; modules must share exactly the same ranks (colocated) or "
                    f"disjoint ranges (non-colocated)"
                )
    lang = spans["language"]
    mixed = [name for name, span in spans.items() if name != "language" and span == lang]
    if mixed:  # one placement per job: the bridges are either all collectives or all point-to-point
        raise ConfigError(
            f"{', '.join(mixed)} share the language model's ranks {lang.start}-{lang[-1]} while another module "
            f"has its own ranks; in a non-colocated layout every encoder needs ranks apart from the LLM's (give "
            f"layout.{mixed[0]}.ranks the encoders' range), or put every module on the same ranks")
    covered = set().union(*map(set, spans.values()))
    gaps = sorted(set(range(world_size)) - covered)
    if gaps:
        raise ConfigError(
            f"non-colocated layouts leave ranks {gaps} of the {world_size}-rank world without a module; "
            f"the modules' rank ranges must tile the world"
        )
