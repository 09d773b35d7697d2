"""Qwen2-Audio's audio tower: Whisper's encoder (models/audio.py) over a clip's own frames, each pair of its output
rows averaged (the tower's AvgPool1d(2, stride 2)) before the final norm.

Qwen2AudioProcessor pads every clip to 30 s and the tower masks the padding as keys; the last rows of a clip still
read the two mel frames past its end through the convolutions. So a clip here is its own frames plus those two
(CONTEXT_FRAMES: the processor's padding, data/audio.py `padded_log_mel`), and only the rows the mask keeps are run.
"""

from __future__ import annotations

import torch

from loom.data.audio import CONTEXT_FRAMES
from loom.models.audio import AudioEncoder


def conv_rows(frames: int) -> int:
    """Rows after conv2 of a clip of `frames` mel frames (Qwen2AudioEncoder._get_feat_extract_output_lengths)."""
    return (frames - 1) // 2 + 1


def pooled_rows(frames: int) -> int:
    """Rows after the pooling: the placeholders Qwen2AudioProcessor writes for a clip of `frames` mel frames."""
    return (conv_rows(frames) - 2) // 2 + 1


class Qwen2AudioEncoder(AudioEncoder):
    def empty_input(self) -> torch.Tensor:
        """The smallest clip with a row after pooling: three frames (two after conv2), and its context."""
        return torch.zeros(self.cfg.num_features, 3 + CONTEXT_FRAMES, device=self.conv1.weight.device)

    def num_tokens(self, clip: torch.Tensor) -> int:
        return pooled_rows(clip.shape[-1] - CONTEXT_FRAMES)

    def conv_rows(self, clip: torch.Tensor) -> int:
        return conv_rows(clip.shape[-1] - CONTEXT_FRAMES)  # the rows past them are the padding the tower masks

    def finish(self, h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Each clip's rows averaged in pairs (an odd last row dropped, as AvgPool1d drops it), then the norm."""
        pairs = [x[: n // 2 * 2].unflatten(0, (n // 2, 2)).mean(1) for x, n in zip(h.split(lengths), lengths)]
        return self.layer_norm(torch.cat(pairs))
