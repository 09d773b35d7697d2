"""The layouts' and parallelism's configuration as data: [layout.<module>] (how each module is split and on
which ranks), [layout] and [parallel] (how the layouts run: FSDP2's units, the pipeline's schedule, the backend).

A leaf like model_config.py: no torch, no topology; loom/config.py holds it in the JobConfig, topology/ resolves
it into layouts and checks them against each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.typed_config import choice


@dataclass
class ModuleLayoutConfig:
    """[layout.<module>]: how one module is split. dp = 0 derives it: len(ranks) / (tp·cp·pp)."""

    tp: int = 1  # tensor parallel: heads, MLP width and vocabulary split over tp ranks
    cp: int = 1  # context parallel (the LLM only): each sample cut into 2·cp chunks over cp ranks
    pp: int = 1  # pipeline stages (an encoder only on ranks of its own)
    dp: int = 0  # data-parallel replicas; 0: len(ranks) / (tp·cp·pp)
    # true: the module's weights sharded over its dp·cp ranks by FSDP2; false: whole on each (DDP-style: 16 bytes a
    # parameter per rank, gradients all-reduced once a step; no gathers, and CUDA graphs where nothing is sharded)
    fsdp: bool = True
    # HSDP: FSDP2 shards the weights within runs of `shard` of its dp·cp ranks and replicates them across the
    # dp·cp/shard runs (gradients reduce-scattered within a run, all-reduced across); 0: shard over all dp·cp
    shard: int = 0
    # "first-last", or one rank (2 or "2"); empty: the LLM's ranks (colocated), for the LLM the whole world
    ranks: str | int = ""
    sequence_parallel: bool = False  # shard the residual stream's tokens (an encoder's packed rows) over tp
    # LLM with experts: split them over ep ranks, a view of its dp×cp ranks (the rest shard them by FSDP2)
    ep: int = 1


@dataclass
class LayoutConfig:
    world_size: int = 0  # 0: taken from the launcher (WORLD_SIZE)
    vision: ModuleLayoutConfig | None = None  # not listed: same ranks as the LLM, data parallel only
    audio: ModuleLayoutConfig | None = None
    language: ModuleLayoutConfig | None = None


@dataclass
class ParallelConfig:
    backend: str = choice("auto", "auto", "gloo", "nccl")  # auto: NCCL with CUDA, gloo without
    # FSDP2: free gathered block weights after forward (true: less memory, one more gather per block in backward)
    reshard_after_forward: bool = False
    blocks_per_unit: int = 1  # FSDP2: the LLM's consecutive blocks gathered together (fewer collectives and hooks)
    module_blocks_per_unit: dict = field(default_factory=dict)  # per module: {vision = 9} (encoders: a third)
    fsdp_prefetch: int = 1  # FSDP2: all-gathers issued this many units ahead, forward and backward (0: FSDP2's own)
    # under train.dtype = bf16: what gradients are reduced in (FSDP2's reduce-scatters, a replicated module's sums)
    reduce_dtype: str = choice("fp32", "fp32", "bf16")
    # a replicated module's (fsdp = false) gradient sums: MiB per all-reduce, issued as the backward finishes them
    # (0: one sum per group after the backward, none beside it); 256 beat 32 by 2-5% on 4 H200s (fewer, longer sums)
    replica_bucket_mb: float = 256.0
    debug_checks: bool = False  # verify invariants at run time, e.g. encoder output equal on its tp ranks
    timeout_s: int = 600  # a collective that does not complete in this time ends the run with an error
    # LLM pipeline (layout.language.pp > 1): torch.distributed.pipelining's schedule over the M microbatches
    pp_schedule: str = choice("1f1b", "1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "zbv")
    pp_virtual_stages: int = 1  # stages per pp rank (interleaved_1f1b, zero_bubble: ≥ 2 cuts the bubble; zbv: 2)
    pp_split: list[int] = field(default_factory=list)  # layers per stage, e.g. [5, 7]; empty: balanced by cost
    # FSDP2 under pp: reduce-scatter once per step (unsharded grads held) or per microbatch (sharded, M× traffic)
    pp_grad_reduce: str = choice("step", "step", "microbatch")
    # expert parallelism (layout.language.ep > 1): each MoE layer's tokens cut into this many chunks whose
    # all-to-alls overlap the experts' compute of the others (chunk i+1 dispatched, chunk i-1 combined, while chunk
    # i computes; likewise in backward); 1: one exchange per layer, nothing overlapped. On 4 H100s (128 experts,
    # top-8) 2 chunks hid 3 points of exposed communication but ran 2% slower, 4 chunks 7% slower: 1 by default
    ep_chunks: int = 1
