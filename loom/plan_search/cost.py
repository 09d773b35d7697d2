"""The cost model of `loom plan --search`: a layout's step time and memory per GPU, as data and pure functions.

Per rank and step, each module it hosts costs
    compute     6 · matmul params · tokens at the matmul rate, 4/3 of it under full activation checkpointing
                (the forward again)
    attention   the scores and their weighting as FlashAttention runs them: the forward (flops.py's count) and a
                backward of 2.5× it (5 matmuls against 2: it recomputes the scores), at the attention kernels' own
                rate for the layer kind (calibration: the LLM's decoder layer, the encoders'), measured; a forward
                more under full checkpointing
    elementwise the activations' bytes written and read again (norms, activations, residual), at the rate loom's
                own layer of that kind reaches on the machine (eager kernels move more than the count; a copy's
                rate where not measured)
    tp          per layer and microbatch, an all-reduce of the rank's tokens × width for each row-parallel
                output (2, forward) and each column-parallel input's gradient (backward: DTensor reduces each
                projection's own — q, k, v and the MLP's — `column_linears`); under sequence parallel 4
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
    host        the host's launches: per layer and microbatch (loom's own layer of the kind, measured), what a TP
                split adds per layer and an FSDP split per unit (calibration.layer_extra_s), and per microbatch
Each run (microbatch) is priced on its slowest replica (`shares`, replicas.py: the replicas wait for each other at
every FSDP collective). Collectives are not overlapped with compute (FSDP's prefetch does hide some on GPU). A whole
candidate — its modules together, the bubble, placement, the drawn steps — is estimate.py's. The model is meant to
rank layouts, and its absolute times are estimates; how well it does either is measured in bench/RESULTS.md
("Cost model of loom plan --search").

Memory per GPU: fp32 weights, gradients and AdamW moments (16 bytes a parameter) sharded over the module's
dp×cp (experts: ep × efsdp), the unsharded gradient accumulated over microbatches, the gathered weights, and
activations per token per layer as loom's eager layers save them (activations.py) for the microbatches in
flight, the largest replica's microbatch (the fullest GPU's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.plan_search.activations import (activation_bytes_per_token_layer, head_bytes_per_row,
                                          saved_bytes_per_token_layer)
from loom.plan_search.calibration import Calibration
from loom.plan_search.replicas import Shares
from loom.train.flops import attention_forward_flops

ADAMW_BYTES = 28  # fp32: read weight, grad, exp_avg, exp_avg_sq; write weight, exp_avg, exp_avg_sq
STATE_BYTES = 16  # fp32 weight + grad + exp_avg + exp_avg_sq per parameter, sharded by FSDP
FLASH_BACKWARD = 2.5  # FlashAttention's backward over its forward: 5 matmuls (scores recomputed, dV, dP, dQ, dK) to 2


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
    norm_fp32: bool = False  # RMSNorm (normalises in fp32, keeps its fp32 input); LayerNorm otherwise
    qk_norm: bool = False  # RMSNorm on q and k (Qwen3)
    # column-parallel projections per layer under tp (without sequence parallel each all-reduces its input's
    # gradient: DTensor makes the input replicated per module); 2 = Megatron's fused qkv and gate/up
    column_linears: float = 2


@dataclass(frozen=True)
class Workload:
    """One step's data: LLM tokens of each sample and each encoder's rows per item (drawn by workload.py)."""

    llm_lengths: tuple[int, ...]
    encoder_items: dict[str, tuple[int, ...]] = field(default_factory=dict)
    llm_targets: int = 0  # tokens with a label, where the LM head runs (data/batch.py target_rows); 0: every token
    # per encoder, each sample's number of items (batch order): which sample each of encoder_items belongs to, so
    # the replicas' shares can be placed as loom places them (absent: the items spread evenly)
    item_counts: dict[str, tuple[int, ...]] = field(default_factory=dict)

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
    pad_to_multiple: int = 1  # data.pad_to_multiple: every sample's tokens rounded up to it (× 2·cp under cp)
    compiled: bool = False  # train.compile: compiled blocks (and loss) save less (activations.py)


@dataclass
class Costs:
    """Seconds per step on one rank, by term; `bytes` per GPU by term."""

    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)
    # how one module's seconds fall into the step's order (estimate.py sequences a rank's host and device by them):
    # forward + backward `runs` a step, over `layers` layers, the host's forward its `host_forward_share`
    runs: int = 1
    layers: int = 1
    host_forward_share: float = 1 / 3

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


# ---------------------------------------------------------------- one module on its ranks


def layer_kind(m: ModuleSizes) -> str:
    """Which of the calibration's layers `m`'s are: the LLM's decoder layer (causal) or an encoder's."""
    return "decoder" if m.causal else "encoder"


def attention_s_per_square(m: ModuleSizes, s: Settings, cal: Calibration) -> float:
    """Seconds of one replica's attention (all its layers, forward and backward) per unit of Σ length²: the
    forward's FLOPs, FlashAttention's backward over them again, at the attention kernels' own rate (far below the
    matmul rate: 254 against 800 TFLOP/s on an H200, calibration.py); a forward more under full checkpointing."""
    passes = 1 + FLASH_BACKWARD + (1 if s.activation_checkpointing == "full" else 0)
    return attention_forward_flops([1], m.layers, m.attention_width, m.causal) * passes / cal.attention_rate(
        layer_kind(m))


def tp_collectives(m: ModuleSizes, sequence_parallel: bool) -> float:
    """TP's all-reduce-sized collectives per layer, forward and backward: 2 row-parallel outputs and each
    column-parallel input's gradient; under sequence parallel one gather and one reduce-scatter a side for the
    attention and the MLP (4 all-reduces' bytes)."""
    return 4.0 if sequence_parallel else 2 + m.column_linears


def module_costs(m: ModuleSizes, lay: ModuleLayout, s: Settings, work_tokens: int, lengths: list[int],
                 runs_per_step: int, cal: Calibration, head_tokens: int | None = None,
                 shares: Shares | None = None) -> Costs:
    """One rank of module `m` for one step. `work_tokens`: tokens (rows) the whole module computes per step —
    fixed-shape microbatches count their filler; `lengths`: the real samples (items), for attention;
    `runs_per_step`: forward + backward passes per step (M, or 1 for encoders in the three-phase step);
    `head_tokens`: the rows the LLM's head projects (its targets; None: every row); `shares`: each replica's
    rows and squares per run (replicas.py; None: the step spread evenly over dp and the runs)."""
    c = Costs()
    tp, cp, pp, dp = lay.tp, lay.cp, lay.pp, lay.dp
    layers = max(1, m.layers // pp)
    if shares is None:
        shares = Shares.even(work_tokens, sum(n * n for n in lengths), dp, runs_per_step)
    recompute = 4 / 3 if s.activation_checkpointing == "full" else 1.0
    head_params, head_tokens = m.hidden * m.vocab, work_tokens if head_tokens is None else head_tokens
    act = activation_bytes_per_token_layer(m, tp, s.dtype_bytes, s.sequence_parallel)
    # one replica row's seconds on one of its ranks: the matmuls (split tp·pp·cp ways), the elementwise passes
    # (write, read, its gradient: split over cp, and tp where act is), and attention per unit of Σ length²
    per_row = 6.0 * (m.matmul_params - head_params) * recompute / cal.matmul_flops_per_s / (cp * tp * pp)
    per_row_elementwise = 3 * act * layers / cal.elementwise_rate(layer_kind(m)) / cp
    per_square = attention_s_per_square(m, s, cal) / (cp * tp * pp)
    rows, squares = shares.slowest(per_row + per_row_elementwise, per_square)  # each run's slowest replica
    head_flops = 6.0 * head_params * head_tokens / (dp * cp * tp * pp)  # on the mean: targets are not placed
    c.seconds["compute"] = per_row * rows + head_flops * recompute / cal.matmul_flops_per_s
    c.seconds["attention"] = per_square * squares
    c.seconds["elementwise"] = per_row_elementwise * rows
    tokens_rank = rows / cp  # this rank's tokens per step (every pp stage sees them all)
    tokens_mb = tokens_rank / runs_per_step
    width_bytes = tokens_mb * m.hidden * s.dtype_bytes
    c.seconds["tp"] = runs_per_step * layers * tp_collectives(m, s.sequence_parallel) * collective_s(
        cal, "all_reduce", tp, width_bytes)
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
    # the layer's own host time, TP's per layer (each layer's modules are split), FSDP's per unit (its hooks
    # run around a unit of `per_unit` blocks: the ViT's 27 in units of 9 pay 3 units' hooks, not 27)
    fsdp_units = 0.0 if replicated else -(-layers // per_unit)
    per_layer = cal.layer_host_s(layer_kind(m)) + cal.extra("tp", tp)
    c.seconds["host"] = runs_per_step * (layers * per_layer + fsdp_units * cal.extra("fsdp", shard_group)
                                         + cal.overhead_per_microbatch_s)
    c.runs, c.layers = runs_per_step, layers
    c.host_forward_share = cal.layer(layer_kind(m)).forward_share or 1 / 3
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
    act_layer = saved_bytes_per_token_layer(m, tp, s.dtype_bytes, s.sequence_parallel, s.activation_checkpointing,
                                            s.compiled)
    largest_mb = shares.largest / cp  # the fullest rank's microbatch
    c.bytes["activations"] = act_layer * largest_mb * layers * in_flight
    if s.activation_checkpointing != "none":  # one block's full activations while it recomputes
        c.bytes["activations"] += saved_bytes_per_token_layer(m, tp, s.dtype_bytes, s.sequence_parallel, "none",
                                                              s.compiled) * largest_mb
    if m.vocab:  # the head and loss at their peak (activations.py), on the last stage: a microbatch's head rows
        rows = largest_mb * (head_tokens / work_tokens if work_tokens else 1)
        c.bytes["logits"] = rows * head_bytes_per_row(m.vocab, tp, s.dtype_bytes, s.compiled and tp == 1)
    return c
