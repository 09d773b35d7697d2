"""LLaVA-OneVision's anyres images: the geometry shared by the data, which cuts an image into tiles, and the model,
which lays out the tiles' feature rows for the LLM.

An image alone in its sample is resized, aspect kept, into the best fitting of the folder's canvases
(`image_grid_pinpoints`, each whole tiles of the tower's size), padded to it, and cut into its grid of tiles; a base
tile (the whole image squeezed to one tile) goes first. The LLM reads the base tile's rows, then the grid's feature
map cut back to the image's aspect ratio — pooled down when it holds more than `max_tiles` tiles' worth — row by
row, each row ended by a learned newline. An image of a sample with several is its base tile alone (padded square
first), followed by one newline. From the image's size alone (a file header's) this says every count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TiledImage:
    """An anyres image as the tower takes it: its tiles [n, channels, S, S], the base tile first, and the (H, W) of
    the picture they were cut from (which the feature map's cut and the token count need)."""

    tiles: torch.Tensor
    size: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        """(tiles, channels, H, W): what the token count reads, known from the file's header before decoding."""
        return (self.tiles.shape[0], self.tiles.shape[1], *self.size)

    def to(self, *args, **kwargs) -> TiledImage:
        return TiledImage(self.tiles.to(*args, **kwargs), self.size)

    def pin_memory(self) -> TiledImage:
        return TiledImage(self.tiles.pin_memory(), self.size)


@dataclass(frozen=True)
class Anyres:
    tile: int  # pixels a side of one tile: the tower's image size
    side: int  # feature rows (and columns) of one tile
    pinpoints: tuple[tuple[int, int], ...]  # the (H, W) canvases, whole tiles each
    max_tiles: int  # anyres_max_N: the grid's map is pooled when above 1.1 × N tiles' worth (in area)

    @staticmethod
    def of(pinpoints, tile: int, side: int, max_tiles: int) -> Anyres:
        bad = check_pinpoints(pinpoints, tile)
        if bad:
            raise ValueError(bad)
        return Anyres(tile, side, tuple((int(h), int(w)) for h, w in pinpoints), max_tiles)

    def canvas(self, h: int, w: int) -> tuple[int, int]:
        """The canvas an h × w image is fitted into: the one keeping the most of its pixels (never more than it
        has), then the one wasting the least; the first listed wins a tie, as LLaVA's processor chooses."""
        best, kept_most, waste_least = self.pinpoints[0], -1, math.inf
        for ch, cw in self.pinpoints:
            scale = min(cw / w, ch / h)
            kept = min(int(w * scale) * int(h * scale), w * h)
            waste = ch * cw - kept
            if kept > kept_most or (kept == kept_most and waste < waste_least):
                best, kept_most, waste_least = (ch, cw), kept, waste
        return best

    def grid(self, h: int, w: int) -> tuple[int, int]:
        """(rows, columns) of tiles an h × w image alone in its sample is cut into."""
        ch, cw = self.canvas(h, w)
        return ch // self.tile, cw // self.tile

    def kept(self, h: int, w: int) -> tuple[int, int, int, int]:
        """(first row, end row, first column, end column) of the grid's feature map that show the image: the
        padding's bands cut off, rounded as LLaVA's model rounds them."""
        gh, gw = self.grid(h, w)
        rows, cols = gh * self.side, gw * self.side
        if w / h > cols / rows:  # wider than the canvas: bands above and below
            pad = (rows - int(round(h * (cols / w), 7))) // 2
            return pad, rows - pad, 0, cols
        pad = (cols - int(round(w * (rows / h), 7))) // 2
        return 0, rows, pad, cols - pad

    def pooled(self, rows: int, cols: int) -> tuple[int, int] | None:
        """The map's size after anyres_max pooling, None when it is small enough to be read as it is."""
        ratio = math.sqrt(rows * cols / (self.max_tiles * self.side**2))
        return (int(rows // ratio), int(cols // ratio)) if ratio > 1.1 else None

    def map_size(self, h: int, w: int) -> tuple[int, int]:
        """(rows, columns) of the feature map the LLM reads of an h × w image alone in its sample."""
        r0, r1, c0, c1 = self.kept(h, w)
        return self.pooled(r1 - r0, c1 - c0) or (r1 - r0, c1 - c0)

    def tower_rows(self, shape: tuple[int, ...]) -> int:
        """Rows the tower runs for an item of TiledImage `shape`: every tile's, the base tile's included."""
        return shape[0] * self.side**2

    def rows(self, shape: tuple[int, ...]) -> int:
        """LLM rows of an item of TiledImage `shape`: the base tile's, then the map with a newline per row (one
        newline alone for a base tile alone)."""
        if len(shape) != 4:
            raise ValueError(f"an anyres tower takes tiled images (tiles, channels, H, W), not shape {tuple(shape)}")
        n, _, h, w = shape
        if n == 1:
            return self.side**2 + 1
        rows, cols = self.map_size(h, w)
        return self.side**2 + rows * (cols + 1)


def check_pinpoints(pinpoints, tile: int) -> str:
    """Why `pinpoints` cannot be canvases of `tile`-pixel tiles ("" when they can)."""
    if not pinpoints:
        return "no canvases: anyres needs at least one [height, width]"
    for p in pinpoints:
        ok = isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) and x > 0 for x in p)
        if not ok:
            return f"{p!r} is not a [height, width] of positive whole pixels"
        if p[0] % tile or p[1] % tile:
            return (f"{p[0]} × {p[1]} is not whole tiles of {tile} pixels (the tower's image_size): "
                    f"{p[0] / tile:g} × {p[1] / tile:g} tiles")
    return ""
