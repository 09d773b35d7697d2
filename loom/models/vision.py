"""ViT vision encoder in the SigLIP or CLIP layout; images of different sizes give different numbers of patches.

The patches of all images of a batch are packed into one [patches, hidden] stream and attention stays
inside each image (THD with one segment per image), so no image is padded to the largest one.
CLIP adds a learned [CLS] row before each image's patches and a LayerNorm before the first layer; a LLaVA
tower stops at the layer its LLM reads (`vision_feature_layer`), without the final norm, and may drop each
image's first row (`vision_feature_select_strategy = "default"`).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.models.encoder_layer import EncoderLayer, RowBudget, run_packed
from loom.models.projector import PROJECTOR_ACTS
from loom.typed_config import choice


@dataclass
class VisionConfig:
    channels: int = 3
    patch_size: int = 4
    hidden_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    layer_norm_eps: float = 1e-6
    position_grid: int = 8  # learned positions for a grid×grid patch image, interpolated for other sizes
    act: str = "tanh"  # gelu approximation: "tanh" (SigLIP), "none" (exact) or "quick" (CLIP's quick_gelu)
    class_token: bool = False  # CLIP: a learned [CLS] row before each image's patches, position row 0 its own
    patch_bias: bool = True  # CLIP's patch embedding has none
    pre_norm: bool = False  # CLIP's LayerNorm of the embeddings before the first layer (`pre_layrnorm`)
    final_norm: bool = True  # post_layernorm on the last layer's output; a LLaVA tower's LLM reads a layer's output
    drop_first_row: bool = False  # LLaVA's "default" feature strategy: each image's first output row ([CLS]) dropped
    projector_act: str = choice("gelu", *PROJECTOR_ACTS)  # the projector's activation, between its two matmuls
    # which tower: "vit" (SigLIP / CLIP, this file) or "qwen2_vl" (models/qwen2_vision.py: 2-D rotary positions and
    # a 2×2 patch merger, whose MLP is the projector; the keys below are its)
    # (qwen2_5_vl: RMSNorm, a SwiGLU MLP and windowed attention)
    family: str = choice("vit", "vit", "qwen2_vl", "qwen2_5_vl")
    temporal_patch_size: int = 2  # frames per patch; a still image is repeated to fill them
    merge_size: int = 2  # the merger joins merge_size × merge_size neighbouring patches into one LLM token
    rope_theta: float = 10000.0  # the tower's 2-D rotary base
    window_size: int = 0  # Qwen2.5-VL: layers attend within windows this many pixels a side (0: whole images) …
    full_attention_layers: list[int] = field(default_factory=list)  # … but these, over whole images
    hf: str = ""  # Hugging Face folder to load this module from; its config.json then replaces the sizes here


class VisionEncoder(nn.Module):
    # the submodules before the layers (`embed`) and after them (`finish`): a pipeline stage keeps only its own
    STEM = ("patch_embedding", "position_embedding", "class_embedding", "pre_layrnorm")
    HEAD = ("post_layernorm",)

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.patch_embedding = nn.Conv2d(cfg.channels, d, cfg.patch_size, stride=cfg.patch_size, bias=cfg.patch_bias)
        self.position_embedding = nn.Embedding(cfg.position_grid**2 + cfg.class_token, d)
        # CLIP's names (`pre_layrnorm` is spelt so in its checkpoints); None where the tower has no such part
        self.class_embedding = nn.Parameter(torch.empty(d)) if cfg.class_token else None
        self.pre_layrnorm = nn.LayerNorm(d, eps=cfg.layer_norm_eps) if cfg.pre_norm else None
        self.layers = nn.ModuleList(
            EncoderLayer(d, cfg.num_heads, cfg.intermediate_size, cfg.layer_norm_eps, cfg.act)
            for _ in range(cfg.num_layers)
        )
        self.post_layernorm = nn.LayerNorm(d, eps=cfg.layer_norm_eps) if cfg.final_norm else None
        self.row_budget: RowBudget | None = None  # fixed layer shapes under compile (parallel/compile.py)

    @property
    def out_dim(self) -> int:
        return self.cfg.hidden_size

    def empty_input(self) -> torch.Tensor:
        """The smallest valid image: one patch (a whole grid where the positions do not interpolate: CLIP's)."""
        side = self.cfg.patch_size * (self.cfg.position_grid if self.cfg.class_token else 1)
        return torch.zeros(self.cfg.channels, side, side, device=self.patch_embedding.weight.device)

    def num_tokens(self, image: torch.Tensor) -> int:
        patches = (image.shape[-2] // self.cfg.patch_size) * (image.shape[-1] // self.cfg.patch_size)
        return patches + self.cfg.class_token - self.cfg.drop_first_row

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        """images: each [channels, H, W] → patch features [sum of patches, hidden], image after image."""
        h, lengths = self.embed(images)
        return self.finish(run_packed(h, lengths, self.layers, self.row_budget), lengths)

    def embed(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """The layers' input: every image's patches embedded, with positions ([sum of patches, hidden]), and
        each image's patch count."""
        p = self.cfg.patch_size
        grids = [(img.shape[-2] // p, img.shape[-1] // p) for img in images]
        conv = self.patch_embedding
        # the stride-p convolution as one matmul over every image's patches: no per-size cuDNN plan per image
        patches = torch.cat([_patchify(img, p, h, w) for img, (h, w) in zip(images, grids)])
        x = F.linear(patches.to(conv.weight.dtype), conv.weight.flatten(1), conv.bias)
        if self.class_embedding is not None:  # each image's [CLS] row before its patches
            per_image = x.split([h * w for h, w in grids])
            cls = self.class_embedding.to(x.dtype)[None]
            x = torch.cat([part for rows in per_image for part in (cls, rows)])
        # in x's dtype: a grid-sized image's table is fp32 under autocast, and the layers' input dtype must not vary
        x = x + torch.cat([self._positions(h, w) for h, w in grids]).to(x.dtype)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        return x, [h * w + self.cfg.class_token for h, w in grids]

    def finish(self, h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The layers' output (images of `lengths` rows, one after another) → the encoder's."""
        if self.post_layernorm is not None:
            h = self.post_layernorm(h)
        if self.cfg.drop_first_row:  # the rows after each image's first, indexed from the host (no device sync)
            keep = torch.ones(h.shape[0], dtype=torch.bool)
            keep[[0, *itertools.accumulate(lengths)][:-1]] = False
            h = h.index_select(0, keep.nonzero().squeeze(1).to(h.device, non_blocking=True))
        return h

    def _positions(self, h: int, w: int) -> torch.Tensor:
        g = self.cfg.position_grid
        table = self.position_embedding.weight
        if (h, w) == (g, g):
            return table
        if self.cfg.class_token:
            raise ValueError(f"vision: an image of {h}×{w} patches; this CLIP tower takes {g}×{g} "
                             f"({g * self.cfg.patch_size} pixels square) and does not interpolate its positions")
        # SigLIP's bicubic resize of the learned grid, done as the separable linear map it is: rows with one
        # 1-D matrix, columns with another (two small matmuls; the backward of F.interpolate's bicubic is an
        # atomic-add scatter that cost ~10% of a ViT step on GPU)
        rows, cols = _bicubic_matrix(g, h, table.device), _bicubic_matrix(g, w, table.device)
        grid = table.reshape(g, g, -1)
        return torch.einsum("hi,ijd,wj->hwd", rows.to(table.dtype), grid, cols.to(table.dtype)).reshape(h * w, -1)


def _patchify(image: torch.Tensor, p: int, h: int, w: int) -> torch.Tensor:
    """[C, H, W] → [h·w, C·p·p], patches row-major, each flattened as (C, p, p) like the conv's weight."""
    c = image.shape[0]
    return image[:, : h * p, : w * p].reshape(c, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, c * p * p)


@functools.lru_cache(maxsize=256)
def _bicubic_matrix(src: int, dst: int, device: torch.device) -> torch.Tensor:
    """[dst, src]: F.interpolate(mode="bicubic", align_corners=False) along one axis, as a matrix."""
    basis = torch.eye(src, device=device, dtype=torch.float64).reshape(src, 1, src, 1)  # exact weights
    return F.interpolate(basis, size=(dst, 1), mode="bicubic", align_corners=False).reshape(src, dst).T.contiguous()
