"""Activation checkpointing per transformer block (`train.activation_checkpointing`).

- "full": a block keeps only its inputs; its whole forward runs again in backward.
- "selective": a per-op policy saves the outputs of matmuls, attention kernels and the TP reduce-scatter /
  all-reduce, and recomputes the rest (norms, activations, rotary, elementwise): the saved ops are the
  compute-bound (or communicating) ones, the recomputed ones are memory-bound and cheap to redo, yet they
  make most of a block's intermediate tensors.

Like compile.py, each block's `forward` is replaced in place (no `checkpoint_wrapper`): parameter names do not
change, and the hooks that FSDP2 and TP install on the block run outside the checkpointed body. FSDP2's
pre-backward hook re-gathers the block's weights before its backward unpacks the first saved tensor, which is
when the recomputation runs. Under `train.compile` the compiled forward runs inside the checkpoint (compile
first, then this): the recomputation calls the same compiled graphs again. Context-parallel attention
re-issues its K/V all-gathers in the recomputation; every cp rank runs the same backward graph in the same
order, so they stay matched.

"selective" with `train.compile` is rejected by config validation: the policy runs as a TorchDispatchMode,
under which torch.compile does not trace (the recomputation then fails against the compiled forward), and
compiling around the checkpoint (torchtitan's order) needs a block without graph breaks: loom's per-sample
CPU/fp32 attention and CP attention break it, and dynamo then runs the whole block eagerly.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from loom.parallel.blocks import transformer_blocks

MODES = ("none", "full", "selective")


# ops whose outputs "selective" keeps, by schema name (an op this torch build lacks never matches)
SAVED_OPS = frozenset({
    *(f"aten::{name}" for name in (
        "mm", "addmm", "bmm", "baddbmm", "linear",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
        "_efficient_attention_forward", "_cudnn_attention_forward",
    )),
    "torch_attn::_varlen_attn",  # FlashAttention varlen (CUDA, bf16)
    # TP/SP outputs of row-parallel layers: saving them spares a collective in the recomputation
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_reduce",
})


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    # a pure function of the op: the forward and the recomputation must take the same decisions
    return CheckpointPolicy.MUST_SAVE if func._schema.name in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    return create_selective_checkpoint_contexts(_policy)


def checkpointed(forward, mode: str):
    """`forward`, recomputed in backward: whole ("full") or all but the saved ops ("selective")."""
    kwargs = {"use_reentrant": False, "preserve_rng_state": False}  # loom's blocks draw no random numbers
    if mode == "selective":
        kwargs["context_fn"] = selective_contexts

    @functools.wraps(forward)
    def run(*args, **kw):
        if not torch.is_grad_enabled():  # evaluation / generation: nothing would be saved anyway
            return forward(*args, **kw)
        return checkpoint(forward, *args, **kwargs, **kw)

    run.activation_checkpointing = mode
    return run


def checkpoint_blocks(name: str, module: nn.Module, mode: str, compiled: bool = False) -> None:
    """Checkpoints every transformer block of module `name` in place. Call it after compile_blocks (the compiled
    forward then runs inside the checkpoint) and before TP/FSDP, or after them: their hooks stay outside."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r}: choose one of {list(MODES)}")
    if mode == "none":
        return
    if mode == "selective" and compiled:
        raise ValueError("selective activation checkpointing does not compose with train.compile (see module doc)")
    if compiled:
        # dynamo tries the most recently used compiled graph first, so the recomputation may pick another
        # variant of the block than its forward did (e.g. the encoders share the block code at other sizes),
        # one that saves other tensors, which checkpoint rejects (pytorch#166926; torchtitan does the same).
        # In insertion order the first variant whose guards pass is the forward's again.
        torch._C._dynamo.eval_frame._set_lru_cache(False)
    for block in transformer_blocks(name, module):
        if getattr(block.forward, "activation_checkpointing", None):
            raise RuntimeError(f"{name}: a block is already checkpointed")
        # the forward, not the module (checkpoint_wrapper renames parameters; FSDP2's hooks must stay outside)
        block.forward = checkpointed(block.forward, mode)
