"""Whisper-style audio encoder: two 1-D convolutions (the second halves the frame rate), fixed
sinusoidal positions, pre-norm transformer layers. Clips of different lengths give different frame counts."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.model_config import AudioConfig
from loom.models.encoder_layer import EncoderLayer, RowBudget, run_packed


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's fixed position table: sines then cosines over log-spaced timescales."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2))
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class AudioEncoder(nn.Module):
    # the submodules before the layers (`embed`) and after them (`finish`): a pipeline stage keeps only its own
    STEM = ("conv1", "conv2")
    HEAD = ("layer_norm",)

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.conv1 = nn.Conv1d(cfg.num_features, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        # fixed, not trained: a buffer keeps it out of the optimizer and of gradient reduction
        self.register_buffer("embed_positions", sinusoids(cfg.max_positions, d))
        self.layers = nn.ModuleList(
            EncoderLayer(d, cfg.num_heads, cfg.intermediate_size, cfg.layer_norm_eps, key_bias=False)
            for _ in range(cfg.num_layers)
        )
        self.layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.row_budget: RowBudget | None = None  # fixed layer shapes under compile (parallel/compile.py)

    @property
    def out_dim(self) -> int:
        return self.cfg.hidden_size

    def reset_buffers(self) -> None:
        """Recomputes the position table in place (after a module built on `meta` gets storage)."""
        self.embed_positions.copy_(sinusoids(self.cfg.max_positions, self.cfg.hidden_size))

    def empty_input(self) -> torch.Tensor:
        """The smallest valid clip: two frames (one after subsampling)."""
        return torch.zeros(self.cfg.num_features, 2, device=self.conv1.weight.device)

    def num_tokens(self, clip: torch.Tensor) -> int:
        return self.conv_rows(clip)

    def conv_rows(self, clip: torch.Tensor) -> int:
        """The clip's rows after conv2 that the layers take (Whisper: all of them)."""
        return (clip.shape[-1] + 1) // 2  # conv2: kernel 3, stride 2, padding 1

    def forward(self, clips: list[torch.Tensor]) -> torch.Tensor:
        """clips: each [num_features, frames] → [sum of subsampled frames, hidden], clip after clip."""
        h, lengths = self.embed(clips)
        return self.finish(run_packed(h, lengths, self.layers, self.row_budget), lengths)

    def embed(self, clips: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """The layers' input: every clip subsampled, with positions ([sum of frames, hidden]), and each
        clip's frame count."""
        dtype = self.conv1.weight.dtype
        frames = _conv_frames([c.to(dtype) for c in clips], self.conv1)
        frames = _conv_frames([F.gelu(x).T for x in frames], self.conv2)
        pieces = [self._add_positions(F.gelu(x[: self.conv_rows(c)])) for x, c in zip(frames, clips)]
        return torch.cat(pieces), [x.shape[0] for x in pieces]

    def finish(self, h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The layers' output (clips of `lengths` rows) → the encoder's."""
        return self.layer_norm(h)

    def _add_positions(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.cfg.max_positions:
            raise ValueError(
                f"audio: clip gives {x.shape[0]} frames after subsampling, more than "
                f"model.audio.max_positions={self.cfg.max_positions}; shorten the clip or raise max_positions"
            )
        return x + self.embed_positions[: x.shape[0]].to(x.dtype)


def _conv_frames(clips: list[torch.Tensor], conv: nn.Conv1d) -> list[torch.Tensor]:
    """`conv` over each [channels, frames] clip → [out frames, out channels] per clip, computed as one matmul
    over every clip's windows (the same sums; no per-length cuDNN plan per clip)."""
    k, s, p = conv.kernel_size[0], conv.stride[0], conv.padding[0]
    windows = [F.pad(x, (p, p)).unfold(-1, k, s).transpose(0, 1).flatten(1) for x in clips]  # [T', C·k]
    out = F.linear(torch.cat(windows), conv.weight.flatten(1), conv.bias)
    return list(out.split([w.shape[0] for w in windows]))
