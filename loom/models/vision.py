"""ViT vision encoder in the SigLIP layout; images of different sizes give different numbers of patches.

The patches of all images of a batch are packed into one [patches, hidden] stream and attention stays
inside each image (THD with one segment per image), so no image is padded to the largest one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.models.encoder_layer import EncoderLayer, RowBudget, run_packed


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
    act: str = "tanh"  # gelu approximation: "tanh" (SigLIP) or "none"
    hf: str = ""  # Hugging Face folder to load this module from; its config.json then replaces the sizes here


class VisionEncoder(nn.Module):
    # the submodules before the layers (`embed`) and after them (`finish`): a pipeline stage keeps only its own
    STEM = ("patch_embedding", "position_embedding")
    HEAD = ("post_layernorm",)

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv2d(cfg.channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.position_grid**2, cfg.hidden_size)
        self.layers = nn.ModuleList(
            EncoderLayer(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.layer_norm_eps, cfg.act)
            for _ in range(cfg.num_layers)
        )
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.row_budget: RowBudget | None = None  # fixed layer shapes under compile (parallel/compile.py)

    @property
    def out_dim(self) -> int:
        return self.cfg.hidden_size

    def empty_input(self) -> torch.Tensor:
        """The smallest valid image: one patch."""
        p = self.cfg.patch_size
        return torch.zeros(self.cfg.channels, p, p, device=self.patch_embedding.weight.device)

    def num_tokens(self, image: torch.Tensor) -> int:
        return (image.shape[-2] // self.cfg.patch_size) * (image.shape[-1] // self.cfg.patch_size)

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        """images: each [channels, H, W] → patch features [sum of patches, hidden], image after image."""
        return self.finish(run_packed(*self.embed(images), self.layers, self.row_budget))

    def embed(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """The layers' input: every image's patches embedded, with positions ([sum of patches, hidden]), and
        each image's patch count."""
        p = self.cfg.patch_size
        grids = [(img.shape[-2] // p, img.shape[-1] // p) for img in images]
        conv = self.patch_embedding
        # the stride-p convolution as one matmul over every image's patches: no per-size cuDNN plan per image
        patches = torch.cat([_patchify(img, p, h, w) for img, (h, w) in zip(images, grids)])
        x = F.linear(patches.to(conv.weight.dtype), conv.weight.flatten(1), conv.bias)
        # in x's dtype: a grid-sized image's table is fp32 under autocast, and the layers' input dtype must not vary
        x = x + torch.cat([self._positions(h, w) for h, w in grids]).to(x.dtype)
        return x, [h * w for h, w in grids]

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        """The layers' output → the encoder's."""
        return self.post_layernorm(h)

    def _positions(self, h: int, w: int) -> torch.Tensor:
        g = self.cfg.position_grid
        table = self.position_embedding.weight
        if (h, w) == (g, g):
            return table
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
