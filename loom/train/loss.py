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
