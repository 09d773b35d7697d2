"""Qwen2-VL's vision tower: dynamic resolution, 2-D rotary positions, and the 2×2 patch merger's grouping.

An image comes in resized by its processor (sides whole multiples of patch · merge pixels) and normalised, as
[channels, H, W]. Its patches are taken in merger order — each 2×2 group's four patches one after another, the
groups row-major — and each patch holds `temporal_patch_size` copies of the image (a still image is a clip of
identical frames), so the Conv3d patch embedding is one matmul over flattened patches. The blocks attend within
each image (one packed segment per image), rotating half of each head's dims by the patch's row and half by its
column. The output is the merger's input: each group's four rows, layer-normed, side by side ([groups, 4 · hidden]);
the merger's MLP is the modality's projector (models/projector.py with a hidden width of 4 · hidden). Its config is
a VisionConfig with family = "qwen2_vl" (position_grid, class_token and the LLaVA keys unused).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.data.spans import ROW_MULTIPLE, TokenSpans, filler_lengths
from loom.models.attention import attend
from loom.models.layers import GeluMLP, RMSNorm, SwiGLU, apply_rotary, project
from loom.models.vision import VisionConfig


class VisionRotary(nn.Module):
    """Qwen2-VL's 2-D rotary embedding: head_dim / 4 frequencies, turned once by the row and once by the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        half = self.head_dim // 2
        return 1.0 / (self.theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))

    def reset_buffers(self) -> None:
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def forward(self, rows_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows_cols: [patches, 2] → cos, sin [patches, 1, head_dim] (broadcast over heads)."""
        freqs = (rows_cols.float()[..., None] * self.inv_freq).flatten(-2)  # [patches, row freqs + column freqs]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    """Qwen2-VL's fused `qkv` [3 · dim, dim] held as three Linears, its row blocks in order (models/hf/qwen2_vl.py
    splits it on load and joins it on export): each is then column-parallel by heads like any ViT's q/k/v, and
    checkpoints keep global, layout-free tensors; `project` still runs them as one matmul on one process."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, spans: TokenSpans, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in project(x, (self.q_proj, self.k_proj, self.v_proj)))
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.proj(attend(q, k, v, spans, causal=False).flatten(-2))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(cfg)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.norm2 = _norm(cfg)
        # Qwen2.5-VL's MLP: SwiGLU with biases; Qwen2-VL's: two layers around a gelu
        self.mlp = (SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=True) if cfg.family == "qwen2_5_vl"
                    else GeluMLP(cfg.hidden_size, cfg.intermediate_size, approximate=cfg.act))

    def forward(self, h: torch.Tensor, spans: TokenSpans, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), spans, rope)
        return h + self.mlp(self.norm2(h))


def _norm(cfg: VisionConfig) -> nn.Module:
    """Qwen2.5-VL's RMSNorm, Qwen2-VL's LayerNorm (both eps 1e-6 in their towers)."""
    return RMSNorm(cfg.hidden_size, 1e-6) if cfg.family == "qwen2_5_vl" else nn.LayerNorm(cfg.hidden_size, eps=1e-6)


class Qwen2VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, p, t = cfg.hidden_size, cfg.patch_size, cfg.temporal_patch_size
        # Qwen2-VL's Conv3d (its weight's shape and name), applied as a matmul over flattened patches
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.channels, d, (t, p, p), stride=(t, p, p), bias=False)
        self.rotary = VisionRotary(d // cfg.num_heads, cfg.rope_theta)
        self.layers = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_q = _norm(cfg)  # the merger's norm (its MLP is the projector)

    @property
    def out_dim(self) -> int:
        return self.cfg.hidden_size * self.cfg.merge_size**2

    def grid(self, image: torch.Tensor) -> tuple[int, int, int]:
        """The image's patch grid (t, h, w), as the processor's image_grid_thw row."""
        side = self.cfg.patch_size * self.cfg.merge_size
        if image.shape[-2] % side or image.shape[-1] % side:
            raise ValueError(f"vision: an image of {image.shape[-2]}×{image.shape[-1]} pixels; this Qwen2-VL tower "
                             f"takes sides that are multiples of patch_size · merge_size = {side} (its processor's "
                             f"smart_resize)")
        return 1, image.shape[-2] // self.cfg.patch_size, image.shape[-1] // self.cfg.patch_size

    def num_tokens(self, image: torch.Tensor) -> int:
        t, h, w = self.grid(image)
        return t * h * w // self.cfg.merge_size**2

    def empty_input(self) -> torch.Tensor:
        side = self.cfg.patch_size * self.cfg.merge_size
        return torch.zeros(self.cfg.channels, side, side, device=self.patch_embed.proj.weight.device)

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        """images: each [channels, H, W] → [sum of merged tokens, merge² · hidden], image after image."""
        grids = [self.grid(img) for img in images]
        weight = self.patch_embed.proj.weight
        patches = torch.cat([self.patches(img) for img in images])
        h = F.linear(patches.to(weight.dtype), weight.flatten(1))
        rows_cols = torch.cat([self._rows_cols(gh, gw) for _, gh, gw in grids])
        images = [t * gh * gw for t, gh, gw in grids]
        order, windows = self._windows(grids)
        if order is not None:  # Qwen2.5-VL: each window's merger groups one after another (within its image)
            group = self.cfg.merge_size**2
            h, rows_cols = _by_groups(h, order, group), _by_groups(rows_cols, order, group)
        # filler rows after the (reordered) stream, as encoder_layer.run_packed's: a multiple of ROW_MULTIPLE rows
        # splits evenly over sequence-parallel ranks; dropped before the merger, so its groups stay whole
        rows, fill = h.shape[0], -h.shape[0] % ROW_MULTIPLE
        h = torch.cat([h, h.new_zeros(fill, h.shape[1])])
        rope = self.rotary(torch.cat([rows_cols, rows_cols.new_zeros(fill, 2)]).to(h.device))
        spans = lambda lengths: TokenSpans.from_lengths([*lengths, *filler_lengths(fill)], device=h.device)  # noqa: E731
        images, windows = spans(images), windows and spans(windows)
        for i, layer in enumerate(self.layers):
            full = order is None or i in self.cfg.full_attention_layers
            h = layer(h, images if full else windows, rope)
        out = self.ln_q(h[:rows]).view(-1, self.out_dim)  # each merger group's rows are consecutive
        return out if order is None else out[torch.argsort(order).to(out.device)]  # groups back in image order

    def patches(self, image: torch.Tensor) -> torch.Tensor:
        """[C, H, W] → [patches, C · temporal · p · p] in merger order, each flattened as the Conv3d weight."""
        c, p, m, t = image.shape[0], self.cfg.patch_size, self.cfg.merge_size, self.cfg.temporal_patch_size
        _, gh, gw = self.grid(image)
        frames = image.unsqueeze(0).expand(t, *image.shape)
        x = frames.reshape(t, c, gh // m, m, p, gw // m, m, p)
        return x.permute(2, 5, 3, 6, 1, 0, 4, 7).reshape(gh * gw, c * t * p * p)

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor | None, list[int] | None]:
        """Qwen2.5-VL's windows: each image's merged grid cut into squares of window_size pixels (the last row
        and column of windows cut short), windows row-major, groups row-major inside; (the merger groups in that
        order, the windows' lengths in patches). None, None without windows."""
        if not self.cfg.window_size:
            return None, None
        m, side = self.cfg.merge_size, self.cfg.window_size // self.cfg.merge_size // self.cfg.patch_size
        order, lengths, start = [], [], 0
        for t, gh, gw in grids:
            lh, lw = gh // m, gw // m
            for f in range(t):
                for y0 in range(0, lh, side):
                    for x0 in range(0, lw, side):
                        ys, xs = range(y0, min(y0 + side, lh)), range(x0, min(x0 + side, lw))
                        order += [start + (f * lh + y) * lw + x for y in ys for x in xs]
                        lengths.append(len(ys) * len(xs) * m * m)
            start += t * lh * lw
        return torch.tensor(order), lengths

    def _rows_cols(self, gh: int, gw: int) -> torch.Tensor:
        """Each patch's (row, column) in the grid, in merger order: [gh · gw, 2]."""
        m = self.cfg.merge_size
        rows = torch.arange(gh)[:, None].expand(gh, gw)
        cols = torch.arange(gw)[None, :].expand(gh, gw)
        order = lambda x: x.reshape(gh // m, m, gw // m, m).transpose(1, 2).flatten()  # noqa: E731
        return torch.stack([order(rows), order(cols)], dim=-1)


def _by_groups(x: torch.Tensor, order: torch.Tensor, size: int) -> torch.Tensor:
    """Rows of `x` taken `size` at a time (a merger group), the groups in `order`."""
    return x.unflatten(0, (-1, size))[order.to(x.device)].flatten(0, 1)
