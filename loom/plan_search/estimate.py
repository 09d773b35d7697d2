"""A whole candidate's step time, tokens/s and memory per GPU, from its modules' costs (cost.py).

Each module's replicas are given their shares of the step as loom places its samples (replicas.py). The LLM's
per-microbatch terms are stretched by the pipeline bubble (p−1)/(v·m+p−1), a pipelined encoder's by its own. A
colocated rank runs its modules one after the other, its host and device sequenced in the step's order on a GPU
(`sequenced_s`: the host queues ahead of the device where it is faster, the device waits where it is slower; on a
CPU they add up); non-colocated encoder and LLM ranks run at once: max(E, L) + min(E, L)/M (the first microbatch's
encoder forward and the last one's backward have nothing to overlap with), each side's max(host, device). The search
prices the mean of the drawn steps (`estimate_steps`): the samples' lengths, and so the slowest replica, change from
step to step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from loom.plan_search.calibration import Calibration
from loom.plan_search.cost import (Costs, ModuleLayout, ModuleSizes, Settings, Workload, collective_s, module_costs,
                                   pipeline_bubble)
from loom.plan_search.replicas import Shares, encoder_shares, llm_parts, llm_shares, per_sample


@dataclass(frozen=True)
class Estimate:
    step_s: float
    tokens_per_s: float  # real (not filler) LLM tokens per second, the whole job
    memory_bytes: float  # the fullest GPU's
    bubble: float
    seconds: dict[str, float]  # the slowest rank's terms
    memory: dict[str, float]  # the fullest GPU's terms


def llm_work_tokens(w: Workload, lay: ModuleLayout, s: Settings) -> int:
    """Tokens the LLM computes per step: fixed-shape microbatches compute all of T (filler too)."""
    return s.tokens_per_microbatch * lay.dp * s.microbatches if s.tokens_per_microbatch else w.tokens


def llm_head_tokens(w: Workload, lay: ModuleLayout, s: Settings, work_tokens: int) -> int:
    """Rows the LLM's head projects per step: its targets (train/runners.py `RunContext`), every row under tp with
    sequence parallel (the final norm's rows are a sequence shard there) or when the workload does not say."""
    return work_tokens if (s.sequence_parallel and lay.tp > 1) or not w.llm_targets else w.llm_targets


def bridge_s(enc: ModuleSizes, rows: int, enc_lay: ModuleLayout, lang: ModuleLayout, s: Settings,
             colocated: bool, cal: Calibration) -> float:
    """The encoder's rows into the LLM and their gradients back, per step, on a rank of either side."""
    nbytes = rows / enc_lay.dp * enc.out_width * s.dtype_bytes  # one encoder replica's rows
    fanout = lang.tp * lang.cp * max(1, lang.dp // enc_lay.dp)  # the LLM ranks each replica's rows reach
    if colocated:
        return 2 * collective_s(cal, "all_gather", fanout, nbytes)
    return 2 * collective_s(cal, "p2p", 2, nbytes * lang.tp * lang.cp)  # the same rows to each tp/cp peer


def placed_shares(w: Workload, layouts: dict[str, ModuleLayout], s: Settings, colocated: bool) -> dict[str, Shares]:
    """Each module's replicas' shares of step `w` as loom places its samples (replicas.py); a module left out is
    priced spread evenly (no samples' order to place: a hand-made workload, or bins that do not fit)."""
    lang = layouts["language"]
    multiple = math.lcm(s.pad_to_multiple, 2 * lang.cp if lang.cp > 1 else 1,
                        lang.tp if s.sequence_parallel else 1)
    names = tuple(n for n in layouts if n != "language" and n in w.item_counts)
    items = tuple((w.encoder_items.get(n, ()), w.item_counts[n]) for n in names)
    llm = _llm_placed(w.llm_lengths, items, lang.dp, s.microbatches, s.tokens_per_microbatch, multiple)
    if llm is None:
        return {}
    out = {"language": llm[1]}
    for name, (rows, counts) in zip(names, items):
        dp = layouts[name].dp
        if dp % lang.dp == 0 or lang.dp % dp == 0:  # fan-in or fan-out (loom refuses the others)
            # once: the three-phase step of a pipelined LLM, encoders on the whole step
            out[name] = _encoder_placed(w.llm_lengths, items, lang.dp, s.microbatches, s.tokens_per_microbatch,
                                        multiple, rows, counts, dp, colocated and lang.pp > 1)
    return out


# the search prices hundreds of candidates over a few dozen placements: each placement computed once
@functools.lru_cache(maxsize=1024)
def _llm_placed(lengths: tuple[int, ...], items: tuple, dp: int, microbatches: int, budget: int, multiple: int):
    rows = {str(i): per_sample(r, c)[0] for i, (r, c) in enumerate(items)}  # the bins' tie-break: encoder rows
    parts = llm_parts(list(lengths), rows, dp, microbatches, budget, multiple)
    return None if parts is None else (parts, llm_shares(parts, list(lengths), budget, multiple))


@functools.lru_cache(maxsize=4096)
def _encoder_placed(lengths: tuple[int, ...], items: tuple, llm_dp: int, microbatches: int, budget: int,
                    multiple: int, rows: tuple[int, ...], counts: tuple[int, ...], dp: int, once: bool) -> Shares:
    parts = _llm_placed(lengths, items, llm_dp, microbatches, budget, multiple)[0]
    return encoder_shares(parts, *per_sample(rows, counts), dp, once)


FORWARD_SHARE = 1 / 3  # of a layer's device work, the forward's: 2 of the 6 FLOPs per parameter and token
STEP_END = ("optimizer", "bridge")  # device terms of the whole step (AdamW after the last backward), not per run


def sequenced_s(phases: list[tuple[float, float, int]]) -> float:
    """A rank's step from its phases in order, each (host s, device s, layers): the device runs a phase's kernels
    once the host has queued them — it starts when the first layer's are queued and ends no sooner than the
    host's last — so the host runs ahead where it is faster and the device waits where it is slower. Nothing in
    a step makes the host wait for the device (FSDP2's and DTensor's collectives wait on streams; the step's
    loss is read after the optimizer step is queued), and every step starts from an idle device (the last one's
    read)."""
    host = device = 0.0
    for h, d, layers in phases:
        device = max(max(device, host + h / max(1, layers)) + d, host + h)
        host += h
    return device


def _phase(c: Costs, forward: bool, whole: bool = False) -> tuple[float, float, int]:
    """One run's forward or backward of a module (`whole`: every run, both passes) as (host, device, layers)."""
    device = sum(v for k, v in c.seconds.items() if k not in ("host", *STEP_END))
    host = c.seconds.get("host", 0.0)
    if whole:
        return host, device, c.layers * c.runs
    host_share = c.host_forward_share if forward else 1 - c.host_forward_share
    device_share = FORWARD_SHARE if forward else 1 - FORWARD_SHARE
    return host * host_share / c.runs, device * device_share / c.runs, c.layers


def colocated_phases(llm: Costs, encoders: list[Costs], rank: Costs, three_phase: bool
                     ) -> list[tuple[float, float, int]]:
    """A colocated rank's step in order: per microbatch the encoders' forwards, the LLM's forward and backward,
    the encoders' backwards (under a pipelined LLM, the three-phase step: the encoders once on the whole step
    around the LLM's schedule, taken whole); then the step's end (AdamW, the bridge)."""
    if three_phase:
        phases = [_phase(e, True) for e in encoders] + [_phase(llm, True, whole=True)]
        phases += [_phase(e, False) for e in reversed(encoders)]
    else:
        phases = []
        for _ in range(llm.runs):
            phases += [_phase(e, True) for e in encoders] + [_phase(llm, True), _phase(llm, False)]
            phases += [_phase(e, False) for e in reversed(encoders)]
    return phases + [(0.0, sum(rank.seconds.get(k, 0.0) for k in STEP_END), 1)]


def estimate(sizes: dict[str, ModuleSizes], layouts: dict[str, ModuleLayout], s: Settings, w: Workload,
             cal: Calibration) -> Estimate:
    """Step time, tokens/s and memory per GPU of one candidate (`layouts`: every module, language included)."""
    lang = layouts["language"]
    colocated = len({(lay.start, lay.size) for lay in layouts.values()}) == 1
    work = llm_work_tokens(w, lang, s)
    shares = placed_shares(w, layouts, s, colocated)
    llm = module_costs(sizes["language"], lang, s, work, list(w.llm_lengths), s.microbatches, cal,
                       llm_head_tokens(w, lang, s, work), shares.get("language"))
    bubble = pipeline_bubble(lang.pp, s.microbatches, s.pp_virtual_stages)
    for term in ("compute", "attention", "elementwise", "tp", "cp", "ep", "pp", "host"):
        if term in llm.seconds:
            llm.seconds[term] /= 1 - bubble
    encoders, each = Costs(), []
    bridge = 0.0
    for name, lay in layouts.items():
        if name == "language":
            continue
        items = list(w.encoder_items.get(name, ()))
        runs = 1 if (colocated and lang.pp > 1) else s.microbatches  # the three-phase step: once per step
        # a pipelined encoder's stages before the last run every forward, then every backward (GPipe's order)
        enc_settings = Settings(**{**s.__dict__, "pp_grad_reduce": "step", "pp_schedule": "gpipe",
                                   "pp_virtual_stages": 1})
        costs = module_costs(sizes[name], lay, enc_settings, sum(items), items, runs, cal, shares=shares.get(name))
        for term in ("compute", "attention", "elementwise", "tp", "pp", "host"):  # its own bubble, as the LLM's
            if term in costs.seconds:
                costs.seconds[term] /= 1 - pipeline_bubble(lay.pp, runs)
        encoders.add(costs)
        each.append(costs)
        bridge += bridge_s(sizes[name], sum(items), lay, lang, s, colocated, cal)
    if colocated:
        rank = Costs()
        rank.add(llm)
        rank.add(encoders)
        rank.seconds["bridge"] = bridge
        step, worst = rank.total_s(cal), rank
        if cal.host_overlaps_device:  # the host queues ahead, but only of what it has queued: the step's order
            step = sequenced_s(colocated_phases(llm, each, rank, lang.pp > 1))
        memory = rank
    else:
        llm.seconds["bridge"] = encoders.seconds["bridge"] = bridge
        e, l_ = encoders.total_s(cal), llm.total_s(cal)
        step = max(e, l_) + min(e, l_) / s.microbatches
        worst = llm if l_ >= e else encoders
        memory = llm if llm.memory >= encoders.memory else encoders
    mem = dict(memory.bytes)
    mem["reserved"] = cal.memory_reserved_bytes
    return Estimate(step, w.tokens / step, sum(mem.values()), bubble, dict(worst.seconds), mem)


def estimate_steps(sizes: dict[str, ModuleSizes], layouts: dict[str, ModuleLayout], s: Settings,
                   steps: tuple[Workload, ...] | list[Workload], cal: Calibration) -> Estimate:
    """The candidate over the drawn steps: the mean step time (its terms the means of each step's slowest rank's),
    tokens/s over all of them, and the fullest step's memory."""
    each = [estimate(sizes, layouts, s, w, cal) for w in steps]
    if len(each) == 1:
        return each[0]
    step = sum(e.step_s for e in each) / len(each)
    terms = {k: sum(e.seconds.get(k, 0.0) for e in each) / len(each) for k in each[0].seconds}
    fullest = max(each, key=lambda e: e.memory_bytes)
    return Estimate(step, sum(w.tokens for w in steps) / (step * len(each)), fullest.memory_bytes, each[0].bubble,
                    terms, fullest.memory)
