"""The cost model of `loom plan --search`: a layout's step time and memory per GPU, as data and pure functions.

Per rank and step, each module it hosts costs
    compute     6 · matmul params · tokens + attention (loom/train/flops.py's count) at the matmul rate,
                4/3 of it under full activation checkpointing (the forward again)
    elementwise the activations' bytes written and read again (norms, activations, residual) at memory bandwidth
    tp          4 all-reduces per layer and microbatch of the rank's tokens × width (2 forward, 2 backward)
    cp          the K/V all-gather per layer and microbatch, and its reduce-scatter in backward
    ep          4 all-to-alls per sparse layer and microbatch (dispatch, combine; forward, backward)
    pp          each microbatch's activations sent to the next stage, and their gradient back
    fsdp        all-gather of the module's parameters (per dp×cp group) per microbatch — twice when resharded
                after forward — and one reduce-scatter of the gradients per step (per microbatch: pp_grad_reduce);
                one collective per FSDP unit (each block, and the root); a replicated module (`fsdp = false`):
                one all-reduce of its gradients a step, its weights, gradients and AdamW state whole; under HSDP
                (`shard = S`) the gathers and reduce-scatters over S ranks, then one all-reduce of the gradient
                shards across the dp·cp/S replicas a step, the state divided by S
    bridge      the encoder rows into the LLM and their gradients back (colocated: a collective; p2p otherwise)
    optimizer   AdamW over the rank's fp32 shards: 28 bytes a parameter at memory bandwidth
    host        the host's launches: per layer and microbatch (plus what a TP or FSDP split adds, measured:
                calibration.layer_extra_s), and per microbatch
The LLM's per-microbatch terms are stretched by the pipeline bubble (p−1)/(m+p−1). A colocated rank runs its
modules one after the other; non-colocated encoder and LLM ranks run at once: max(E, L) + min(E, L)/M (the first
microbatch's encoder forward and the last one's backward have nothing to overlap with). Collectives are not
overlapped with compute (FSDP's prefetch does hide some on GPU). The model is meant to rank layouts, and its
absolute times are estimates; how well it does either is measured in bench/RESULTS.md ("Cost model of loom plan
--search").

Memory per GPU: fp32 weights, gradients and AdamW moments (16 bytes a parameter) sharded over the module's
dp×cp (experts: ep × efsdp), the unsharded gradient accumulated over microbatches, the gathered weights, and
activations per token per layer (`activation_bytes_per_token_layer`) for the microbatches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.plan_search.calibration import Calibration
from loom.train.flops import attention_flops

ADAMW_BYTES = 28  # fp32: read weight, grad, exp_avg, exp_avg_sq; write weight, exp_avg, exp_avg_sq
STATE_BYTES = 16  # fp32 weight + grad + exp_avg + exp_avg_sq per parameter, sharded by FSDP


@dataclass(frozen=True)
class ModuleSizes:
    """What the cost model needs of one module, counted on the whole (unsplit) model."""

    name: str
    params: int  # every parameter (memory)
    expert_params: int  # the routed experts' share of params (held 1/ep per rank under EP)
    matmul_params: int  # per token: linear layers, experts at their active share (flops.matmul_params)
    layers: int
    hidden: int  # residual width
    attention_width: int  # heads · head_dim
    kv_width: int  # KV heads · head_dim (K and V each)
    kv_heads: int
    mlp_width: int  # per token: the dense MLP's, or top_k experts' (+ shared)
    mlp_tensors: int  # MLP activations kept per token per unit of width: SwiGLU 4 (gate, up, act, product), GELU 2
    causal: bool
    vocab: int = 0  # the LLM's logits
    sparse_layers: int = 0  # mixture-of-experts layers
    top_k: int = 0
    out_width: int = 0  # an encoder's rows into the LLM (the LLM's hidden size)


@dataclass(frozen=True)
class Workload:
    """One step's data: LLM tokens of each sample and each encoder's rows per item (drawn by workload.py)."""

    llm_lengths: tuple[int, ...]
    encoder_items: dict[str, tuple[int, ...]] = field(default_factory=dict)
    llm_targets: int = 0  # tokens with a label, where the LM head runs (data/batch.py target_rows); 0: every token

    @property
    def tokens(self) -> int:
        return sum(self.llm_lengths)

    @property
    def samples(self) -> int:
        return len(self.llm_lengths)


@dataclass(frozen=True)
class ModuleLayout:
    """One module's degrees and its ranks in a candidate (the fields of loom's topology Layout)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    start: int = 0

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True)
class Settings:
    """The config's keys the costs depend on, not searched."""

    dtype_bytes: int = 2  # activations and gathered weights: bf16 2, fp32 4
    microbatches: int = 1
    tokens_per_microbatch: int = 0  # 0: each replica's share as it comes
    activation_checkpointing: str = "none"
    reshard_after_forward: bool = False
    unit_blocks: dict[str, int] = field(default_factory=dict)  # blocks per FSDP2 unit, by module (absent: 1)
    pp_grad_reduce: str = "step"
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    sequence_parallel: bool = False
    replicated: frozenset[str] = frozenset()  # modules with `fsdp = false`: whole on each dp·cp rank
    shard: dict[str, int] = field(default_factory=dict)  # HSDP: module → its `shard` (the ranks FSDP2 shards over)


@dataclass
class Costs:
    """Seconds per step on one rank, by term; `bytes` per GPU by term."""

    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)

    def add(self, other: Costs, scale: float = 1.0) -> None:
        for k, v in other.seconds.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v * scale
        for k, v in other.bytes.items():
            self.bytes[k] = self.bytes.get(k, 0.0) + v

    @property
    def device_s(self) -> float:
        return sum(v for k, v in self.seconds.items() if k != "host")

    def total_s(self, cal: Calibration) -> float:
        host = self.seconds.get("host", 0.0)
        return max(self.device_s, host) if cal.host_overlaps_device else self.device_s + host

    @property
    def memory(self) -> float:
        return sum(self.bytes.values())


# ---------------------------------------------------------------- the terms, each by itself


def pipeline_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """1F1B's idle share of a stage: (p − 1) / (v·m + p − 1); 0 without a pipeline."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def collective_s(cal: Calibration, kind: str, group: int, nbytes: float, calls: int = 1) -> float:
    """`calls` collectives over `group` ranks moving `nbytes` together (the whole buffer: all-gather's output,
    reduce-scatter's input, all-reduce's tensor, all-to-all's input): a latency per call, and the bus bytes per
    rank — (g−1)/g of the buffer, twice for all-reduce — at the bus bandwidth."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):  # reduce-scatter mirrors all-gather; a2a as ag
        link, bus = cal.link("all_gather", group), nbytes * (group - 1) / group
    elif kind == "all_reduce":
        link, bus = cal.link("all_reduce", group), 2 * nbytes * (group - 1) / group
    elif kind == "p2p":  # one message between two ranks: a 2-rank all-gather's link moves (g−1)/g = half its buffer
        link, bus = cal.link("all_gather", 2), nbytes
    else:
        raise ValueError(f"unknown collective {kind!r}")
    return calls * link.latency_s + bus / link.bus_bytes_per_s


def fsdp_bytes(params: int, tp: int, pp: int, param_bytes: int) -> float:
    """The buffer one FSDP all-gather of a module's (stage's, tp shard's) parameters fills."""
    return params / (tp * pp) * param_bytes


def activation_bytes_per_token_layer(m: ModuleSizes, tp: int, dtype_bytes: int, sequence_parallel: bool = False,
                                     checkpointing: str = "none") -> float:
    """Activations a layer keeps for backward, per token (the estimate of Korthikanti et al. 2022, with flash
    attention's O(L) memory): the norms' and projections' inputs (4 × hidden: split over tp only under sequence
    parallel), q, k, v and the attention output (split over tp; K/V heads replicated when tp > KV heads), and
    the MLP's `mlp_tensors` × width (split over tp). Full checkpointing keeps only the block's input."""
    if checkpointing == "full":
        return m.hidden * dtype_bytes / (tp if sequence_parallel else 1)
    replicated = 4 * m.hidden / (tp if sequence_parallel else 1)
    kv = 2 * m.kv_width / min(tp, m.kv_heads)
    split = (2 * m.attention_width) / tp + kv + m.mlp_tensors * m.mlp_width / tp
    return (replicated + split) * dtype_bytes


# ---------------------------------------------------------------- one module on its ranks


def module_costs(m: ModuleSizes, lay: ModuleLayout, s: Settings, work_tokens: int, lengths: list[int],
                 runs_per_step: int, cal: Calibration, head_tokens: int | None = None) -> Costs:
    """One rank of module `m` for one step. `work_tokens`: tokens (rows) the whole module computes per step —
    fixed-shape microbatches count their filler; `lengths`: the real samples (items), for attention;
    `runs_per_step`: forward + backward passes per step (M, or 1 for encoders in the three-phase step);
    `head_tokens`: the rows the LLM's head projects (its targets; None: every row)."""
    c = Costs()
    tp, cp, pp, dp = lay.tp, lay.cp, lay.pp, lay.dp
    layers = max(1, m.layers // pp)
    tokens_rank = work_tokens / (dp * cp)  # this rank's tokens per step (every pp stage sees them all)
    tokens_mb = tokens_rank / runs_per_step
    recompute = 4 / 3 if s.activation_checkpointing == "full" else 1.0
    head_params, head_tokens = m.hidden * m.vocab, work_tokens if head_tokens is None else head_tokens
    flops = (6.0 * (m.matmul_params - head_params) * work_tokens + 6.0 * head_params * head_tokens
             + attention_flops(lengths, m.layers, m.attention_width, m.causal))
    c.seconds["compute"] = flops / (dp * cp * tp * pp) * recompute / cal.matmul_flops_per_s
    act = activation_bytes_per_token_layer(m, tp, s.dtype_bytes, s.sequence_parallel)
    c.seconds["elementwise"] = 3 * act * tokens_rank * layers / cal.memory_bytes_per_s  # write, read, its gradient
    width_bytes = tokens_mb * m.hidden * s.dtype_bytes
    c.seconds["tp"] = runs_per_step * layers * 4 * collective_s(cal, "all_reduce", tp, width_bytes)
    kv_bytes = tokens_mb * cp * 2 * m.kv_width / min(tp, m.kv_heads) * s.dtype_bytes  # gathered: the replica's
    c.seconds["cp"] = runs_per_step * layers * 2 * collective_s(cal, "all_gather", cp, kv_bytes)
    if m.sparse_layers and lay.ep > 1:
        a2a = tokens_mb * m.top_k * m.hidden * s.dtype_bytes  # each token to its top_k experts' ranks
        sparse = max(1, m.sparse_layers // pp)
        c.seconds["ep"] = runs_per_step * sparse * 4 * collective_s(cal, "all_to_all", lay.ep, a2a)
    if pp > 1:
        c.seconds["pp"] = runs_per_step * 2 * collective_s(cal, "p2p", 2, width_bytes)
    # FSDP: dense parameters over dp×cp, experts over efsdp = dp·cp / ep
    dense, experts = m.params - m.expert_params, m.expert_params / lay.ep
    replicated = m.name in s.replicated
    shard = s.shard.get(m.name, 0)
    hsdp = 0 < shard < dp * cp and (dp * cp) % shard == 0 and lay.ep == 1  # what load_config lets through
    shard_group, expert_group = (1, 1) if replicated else (shard if hsdp else dp * cp, dp * cp // lay.ep)
    gathers = runs_per_step * (2 if s.reshard_after_forward else 1)
    per_unit = s.unit_blocks.get(m.name, 1)
    reduces = runs_per_step if (pp > 1 and s.pp_grad_reduce == "microbatch") else 1
    fsdp = 0.0
    # one FSDP unit per run of `per_unit` blocks, plus the root (embeddings, head, norms): a collective per unit
    units = ((-(-layers // per_unit) + 1, dense, shard_group), (max(1, m.sparse_layers // pp), experts, expert_group))
    for calls, params, group in units:
        fsdp += gathers * collective_s(cal, "all_gather", group, fsdp_bytes(params, tp, pp, s.dtype_bytes), calls)
        fsdp += reduces * collective_s(cal, "reduce_scatter", group, fsdp_bytes(params, tp, pp, 4), calls)
    if hsdp:  # the reduce-scattered gradient shards summed across the replicas once a step
        fsdp += collective_s(cal, "all_reduce", dp * cp // shard, fsdp_bytes(m.params, tp, pp, 4) / shard)
    if replicated:  # nothing gathered: one all-reduce of the fp32 gradients a step (parallel/replicate.py)
        fsdp = collective_s(cal, "all_reduce", dp * cp, fsdp_bytes(m.params, tp, pp, 4)) if dp * cp > 1 else 0.0
    c.seconds["fsdp"] = fsdp
    local_params = dense / (tp * pp * shard_group) + experts / (tp * pp * expert_group)
    c.seconds["optimizer"] = ADAMW_BYTES * local_params / cal.memory_bytes_per_s
    per_layer = cal.overhead_per_layer_s + cal.extra("tp", tp) + (0.0 if replicated else cal.extra("fsdp", shard_group))
    c.seconds["host"] = runs_per_step * (layers * per_layer + cal.overhead_per_microbatch_s)
    # memory
    unsharded = dense / (tp * pp) + experts / (tp * pp)
    c.bytes["weights+grads+adamw"] = STATE_BYTES * local_params
    if runs_per_step > 1 or pp > 1:  # gradients accumulate unsharded until the step's reduce-scatter
        c.bytes["accumulated grads"] = 4 * unsharded if s.pp_grad_reduce == "step" else 0.0
    # resharded: this unit, the next one (prefetched) and the last (kept for its backward); else every block
    kept_blocks = layers if not s.reshard_after_forward else min(layers, 3 * per_unit)
    c.bytes["gathered weights"] = 0.0 if replicated else unsharded * s.dtype_bytes * kept_blocks / layers
    in_flight = 1
    if pp > 1:
        in_flight = runs_per_step if s.pp_schedule == "gpipe" else min(pp, runs_per_step)
    act_layer = activation_bytes_per_token_layer(m, tp, s.dtype_bytes, s.sequence_parallel, s.activation_checkpointing)
    c.bytes["activations"] = act_layer * tokens_mb * layers * in_flight
    if s.activation_checkpointing == "full":  # one block's full activations while it recomputes
        c.bytes["activations"] += act * tokens_mb
    if m.vocab:  # fp32 logits and their gradient, on the last stage: a microbatch's head rows
        c.bytes["logits"] = 2 * 4 * tokens_mb * (head_tokens / work_tokens if work_tokens else 1) * m.vocab / tp
    return c


# ---------------------------------------------------------------- a whole candidate


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


def estimate(sizes: dict[str, ModuleSizes], layouts: dict[str, ModuleLayout], s: Settings, w: Workload,
             cal: Calibration) -> Estimate:
    """Step time, tokens/s and memory per GPU of one candidate (`layouts`: every module, language included)."""
    lang = layouts["language"]
    colocated = len({(lay.start, lay.size) for lay in layouts.values()}) == 1
    work = llm_work_tokens(w, lang, s)
    llm = module_costs(sizes["language"], lang, s, work, list(w.llm_lengths), s.microbatches, cal,
                       llm_head_tokens(w, lang, s, work))
    bubble = pipeline_bubble(lang.pp, s.microbatches, s.pp_virtual_stages)
    for term in ("compute", "elementwise", "tp", "cp", "ep", "pp", "host"):
        if term in llm.seconds:
            llm.seconds[term] /= 1 - bubble
    encoders = Costs()
    bridge = 0.0
    for name, lay in layouts.items():
        if name == "language":
            continue
        items = list(w.encoder_items.get(name, ()))
        runs = 1 if (colocated and lang.pp > 1) else s.microbatches  # the three-phase step: once per step
        # a pipelined encoder's stages before the last run every forward, then every backward (GPipe's order)
        enc_settings = Settings(**{**s.__dict__, "pp_grad_reduce": "step", "pp_schedule": "gpipe",
                                   "pp_virtual_stages": 1})
        costs = module_costs(sizes[name], lay, enc_settings, sum(items), items, runs, cal)
        for term in ("compute", "elementwise", "tp", "pp", "host"):  # its own bubble, as the LLM's
            if term in costs.seconds:
                costs.seconds[term] /= 1 - pipeline_bubble(lay.pp, runs)
        encoders.add(costs)
        bridge += bridge_s(sizes[name], sum(items), lay, lang, s, colocated, cal)
    if colocated:
        rank = Costs()
        rank.add(llm)
        rank.add(encoders)
        rank.seconds["bridge"] = bridge
        step, worst = rank.total_s(cal), rank
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
