"""Image files → LLaVA-OneVision's tiles (data/anyres.py), cut with Pillow as LlavaOnevisionImageProcessor cuts
them: an image alone in its sample resized into its canvas with the aspect kept, centred on black, cut row by row
after its base tile (the whole image resized to one tile); an image among several padded square with the mean's
colour, then resized to one tile. Each tile is rescaled and normalised as any image (images.py)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

from loom.data.anyres import TiledImage
from loom.data.conversations import BadSample
from loom.data.image_modes import as_rgb, upright_size
from loom.data.images import ImageRule, PreprocessorConfigError, normalised, opened
from loom.data.sample import MediaFile


def tiled_file(source: str | Path | bytes, rule: ImageRule, alone: bool, where: str = "", name: str = ""
               ) -> MediaFile:
    """The image at `source`, its tiles counted from its header alone; `alone`: the only image of its sample (else
    it is its base tile only, as the processor treats the images of a sample with several)."""
    label = name or str(source)
    try:
        with Image.open(opened(source)) as img:
            height, width = upright_size(img)
    except (OSError, UnidentifiedImageError) as e:
        raise BadSample(f"{where + ': ' if where else ''}cannot read image {label!r} ({e})") from None
    tiles = 1 + math.prod(rule.anyres.grid(height, width)) if alone else 1
    return MediaFile(label, (tiles, 3, height, width), functools.partial(load_tiled, source, rule, alone, where, name))


def load_tiled(source: str | Path | bytes, rule: ImageRule, alone: bool, where: str = "", name: str = ""
               ) -> TiledImage:
    try:
        with Image.open(opened(source)) as img:
            img = as_rgb(img)
            pieces = _cut(img, rule) if alone else [_square_tile(img, rule)]
            return TiledImage(torch.stack([normalised(p, rule) for p in pieces]), (img.height, img.width))
    except (OSError, UnidentifiedImageError) as e:
        raise BadSample(f"{where + ': ' if where else ''}cannot decode image {name or str(source)!r} ({e})") from None


def _cut(img: Image.Image, rule: ImageRule) -> list[Image.Image]:
    """The base tile, then the canvas's tiles row by row."""
    a, resample = rule.anyres, Image.Resampling(rule.resample)
    h, w = img.height, img.width
    ch, cw = a.canvas(h, w)
    if cw / w < ch / h:  # the width fills the canvas; the height rounded up, as the processor rounds it
        nh, nw = min(math.ceil(h * (cw / w)), ch), cw
    else:
        nh, nw = ch, min(math.ceil(w * (ch / h)), cw)
    canvas = Image.new("RGB", (cw, ch), (0, 0, 0))
    canvas.paste(img.resize((nw, nh), resample), ((cw - nw) // 2, (ch - nh) // 2))
    t = a.tile
    return [img.resize((t, t), resample)] + [canvas.crop((x, y, x + t, y + t)) for y in range(0, ch, t)
                                             for x in range(0, cw, t)]


def _square_tile(img: Image.Image, rule: ImageRule) -> Image.Image:
    side = max(img.height, img.width)
    square = Image.new("RGB", (side, side), rule.fill)
    square.paste(img, ((side - img.width) // 2, (side - img.height) // 2))
    return square.resize((rule.anyres.tile, rule.anyres.tile), Image.Resampling(rule.resample))


def check_processor(folder: str | Path, rule: ImageRule) -> None:
    """The folder's preprocessor_config.json cuts tiles as its config.json reads them: the same canvases and a tile
    of the tower's size."""
    path = Path(folder) / "preprocessor_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    a = rule.anyres
    pins = data.get("image_grid_pinpoints")
    if pins is not None and [tuple(p) for p in pins] != list(a.pinpoints):
        raise PreprocessorConfigError(f"{path}: image_grid_pinpoints {pins} differ from config.json's "
                                      f"{[list(p) for p in a.pinpoints]}: the tiles would not be the ones the model "
                                      f"lays out")
    if rule.size != (a.tile, a.tile):
        raise PreprocessorConfigError(f"{path}: size {rule.size} is not the tower's tile, {a.tile} × {a.tile} "
                                      f"(vision_config.image_size)")
