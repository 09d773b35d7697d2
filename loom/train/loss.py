"""Token loss as a *sum*: the caller divides by the global count of supervised tokens of the step, so the
gradient is the mean over the global batch whatever the layout or microbatching."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.data.batch import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over supervised positions, computed in fp32."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


# Compiled, the fp32 upcast fuses into the softmax: fp32 logits over a 150K vocabulary are never stored
# whole, and the backward writes the logits' gradient in their own dtype in one pass.
compiled_token_loss_sum = torch.compile(token_loss_sum)


def loss_function(compile: bool, loss_parallel: bool):
    """The token loss to use: compiled when asked, except on vocab-sharded (DTensor) logits."""
    return compiled_token_loss_sum if compile and not loss_parallel else token_loss_sum
