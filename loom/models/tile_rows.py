"""LLaVA-OneVision's layout of an anyres image's rows for the LLM (data/anyres.py says the geometry).

The tower encodes every tile of every image as an image of its own and the projector maps each row; this module then
gives each image its LLM rows: its base tile's rows, then the tile grid's feature map — the tiles' rows put back side
by side, cut to the image's aspect ratio, pooled bilinearly when it is too large — row by row, each row followed by
the learned `image_newline` (a base tile alone is followed by one). It holds that one parameter.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.data.anyres import Anyres, TiledImage
from loom.model_config import VisionConfig


class TileRows(nn.Module):
    def __init__(self, cfg: VisionConfig, llm_hidden: int) -> None:
        super().__init__()
        self.anyres = Anyres.of(cfg.grid_pinpoints, cfg.position_grid * cfg.patch_size, cfg.position_grid,
                                cfg.max_tiles)
        self.channels = cfg.channels
        self.image_newline = nn.Parameter(torch.empty(llm_hidden))

    def num_tokens(self, item) -> int:
        return self.anyres.rows(tuple(item.shape))

    def tower_rows(self, item) -> int:
        return self.anyres.tower_rows(tuple(item.shape))

    def empty_input(self) -> TiledImage:
        """The smallest item: one base tile (of an image among several)."""
        t = self.anyres.tile
        return TiledImage(torch.zeros(1, self.channels, t, t, device=self.image_newline.device), (t, t))

    @staticmethod
    def tiles(items: list[TiledImage]) -> list[torch.Tensor]:
        """Every tile of every item, each an image for the tower, in order."""
        return [tile for item in items for tile in item.tiles]

    def forward(self, rows: torch.Tensor, items: list[TiledImage]) -> torch.Tensor:
        """rows: the projected rows of `tiles(items)` ([tiles · side², hidden]) → the items' LLM rows, one after
        another."""
        per_tile = self.anyres.side**2
        newline = self.image_newline.to(rows.dtype)
        out, start = [], 0
        for item in items:
            n, _, h, w = item.shape
            out.append(rows[start:start + per_tile])  # the base tile's
            if n == 1:
                out.append(newline[None])
            else:
                out.append(self._grid_rows(rows[start + per_tile:start + n * per_tile], h, w, newline))
            start += n * per_tile
        return torch.cat(out)

    def _grid_rows(self, rows: torch.Tensor, h: int, w: int, newline: torch.Tensor) -> torch.Tensor:
        a = self.anyres
        (gh, gw), s = a.grid(h, w), a.side
        # tile (i, j)'s s × s rows at rows i·s …, columns j·s … of one map
        fmap = rows.view(gh, gw, s, s, -1).permute(0, 2, 1, 3, 4).reshape(gh * s, gw * s, -1)
        r0, r1, c0, c1 = a.kept(h, w)
        fmap = fmap[r0:r1, c0:c1]
        size = a.pooled(r1 - r0, c1 - c0)
        if size is not None:  # bilinear, corners not aligned: as LLaVA-OneVision pools
            fmap = F.interpolate(fmap.permute(2, 0, 1)[None], size=size, mode="bilinear")[0].permute(1, 2, 0)
        ends = newline.expand(fmap.shape[0], 1, -1)
        return torch.cat([fmap, ends], dim=1).reshape(-1, fmap.shape[-1])
