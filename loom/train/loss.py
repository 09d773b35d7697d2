"""Token loss as a *sum*: the caller divides by the global count of supervised tokens of the step, so the
gradient is the mean over the global batch whatever the layout or microbatching."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from loom.data.batch import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over supervised positions, computed in fp32."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


# Compiled, the fp32 upcast fuses into the softmax: fp32 logits over a 150K vocabulary are never stored
# whole, and the backward writes the logits' gradient in their own dtype in one pass. One compiled function per
# backend, made at first use; its rows are a microbatch's targets (data/batch.py target_rows), so they are traced
# symbolic from the first call (no recompile when they change) while the vocabulary stays a constant.
@functools.cache
def compiled_token_loss_sum(backend: str):
    compiled = torch.compile(token_loss_sum, backend=backend)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(logits, 0)
        torch._dynamo.maybe_mark_dynamic(labels, 0)
        return compiled(logits, labels)

    return loss


def loss_function(compile_backend: str | None, loss_parallel: bool):
    """The token loss to use: compiled with `compile_backend` (None: eager), except on vocab-sharded (DTensor)
    logits."""
    return compiled_token_loss_sum(compile_backend) if compile_backend and not loss_parallel else token_loss_sum
