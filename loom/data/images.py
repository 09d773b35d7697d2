"""Image files → the vision encoder's input: decoded with Pillow, resized to whole patches, normalised.

The size keeps the aspect ratio: each side is rounded to a multiple of the patch size, and the whole image is
scaled down (or up) until its pixel count lies within [min_pixels, max_pixels] — the rule Qwen2-VL's
processor uses, so an image costs tokens in proportion to its area and no image is padded. The picture is
first made upright 8-bit RGB as transformers' `load_image` / `convert_to_rgb` make it (image_modes.py); the
resampling filter, rescale factor, mean and std come from the encoder folder's `preprocessor_config.json` when
there is one (`resample`, `rescale_factor`, `image_mean`, `image_std`, `do_rescale`, `do_normalize`), else
bicubic, 1/255, 0.5 and 0.5 (SigLIP's).

A whole-model folder's images (LLaVA's) are sized as its processor sizes them instead (`ImageRule.of(…,
processor_sizes=True)`): CLIP's shorter side to `size.shortest_edge` (aspect kept, the longer side truncated) and a
centred `crop_size` crop, or a resize straight to `size.height × width` — every image then has the tower's size;
Qwen2-VL's (`merge_size` in the file) by the rule above with its `min_pixels` / `max_pixels` (`size.shortest_edge` /
`longest_edge` in transformers 5) and sides of whole merger groups (patch_size · merge_size pixels).
"""

from __future__ import annotations

import functools
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from loom.data.anyres import Anyres
from loom.data.conversations import BadSample
from loom.data.image_modes import as_rgb, upright_size
from loom.data.sample import MediaFile


class PreprocessorConfigError(ValueError):
    """The vision folder's preprocessor_config.json holds a value loom cannot use (the message names it)."""


@dataclass(frozen=True)
class ImageRule:
    patch: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC  # a Pillow filter, as preprocessor_config.json's "resample" holds
    shortest_edge: int = 0  # CLIP's processor: the shorter side resized to this first (0: Qwen2-VL's rule above)
    size: tuple[int, int] | None = None  # (H, W) every image ends at: CLIP's centred crop, or a straight resize
    smart_resize: bool = False  # Qwen2-VL's processor: its smart_resize to the letter (a side under half a patch too)
    anyres: Anyres | None = None  # LLaVA-OneVision's processor: each image cut into tiles (anyres_images.py) …
    fill: tuple[int, int, int] = (0, 0, 0)  # … an image among several padded square with this 8-bit colour (its mean)

    @staticmethod
    def of(patch: int, min_pixels: int, max_pixels: int, folder: str | Path | None = None,
           processor_sizes: bool = False) -> ImageRule:
        """With the preprocessing of `folder`'s preprocessor_config.json, when it has one; `processor_sizes`: its
        sizes too (a LLaVA folder's, which must have the file)."""
        if not patch * patch <= min_pixels <= max_pixels:
            raise ValueError(f"image pixels: need patch² ({patch * patch}) ≤ min_pixels ({min_pixels}) ≤ "
                             f"max_pixels ({max_pixels})")
        config = Path(folder) / "preprocessor_config.json" if folder else None
        if processor_sizes and (config is None or not config.is_file()):
            raise PreprocessorConfigError(f"{folder}: no preprocessor_config.json, where this model's image size and "
                                          f"normalisation are written")
        try:
            data = json.loads(config.read_text()) if config is not None and config.is_file() else {}
            mean, std = tuple(data.get("image_mean", (0.5,) * 3)), tuple(data.get("image_std", (0.5,) * 3))
            if not data.get("do_normalize", True):
                mean, std = (0.0,) * 3, (1.0,) * 3
            factor = float(data.get("rescale_factor", 1 / 255)) if data.get("do_rescale", True) else 1.0
            resample = int(data.get("resample", Image.Resampling.BICUBIC))
        except (ValueError, TypeError) as e:
            raise PreprocessorConfigError(f"{config}: {e}") from None
        if resample not in set(Image.Resampling):
            raise PreprocessorConfigError(f"{config}: resample = {resample} is not a Pillow filter "
                                          f"({', '.join(f'{r.value} {r.name}' for r in Image.Resampling)})")
        if len(mean) != 3 or len(std) != 3 or not all(x > 0 for x in std):
            raise PreprocessorConfigError(f"{config}: image_mean = {list(mean)}, image_std = {list(std)}: need "
                                          f"three of each, every std > 0")
        sizes = dict(patch=patch, min_pixels=min_pixels, max_pixels=max_pixels)
        sizes.update(_processor_sizes(data, config) if processor_sizes else {})
        fill = tuple(int(x * 255) for x in data.get("image_mean", mean))  # before do_normalize, as transformers pads
        return ImageRule(**sizes, mean=mean, std=std, rescale_factor=factor, resample=resample, fill=fill)


def _processor_sizes(data: dict, config: Path) -> dict:
    """ImageRule's shortest_edge and size from a CLIP / SigLIP processor's `size`, `crop_size`, `do_center_crop`."""
    size, crop = data.get("size") or {}, data.get("crop_size") or {}
    if isinstance(crop, int):
        crop = {"height": crop, "width": crop}
    if not data.get("do_resize", True):
        raise PreprocessorConfigError(f"{config}: do_resize = false: loom resizes every image to the tower's size")
    if "merge_size" in data:
        return _qwen2_vl_sizes(data, size)
    if "shortest_edge" in size:
        if not data.get("do_center_crop", True) or not {"height", "width"} <= set(crop):
            raise PreprocessorConfigError(f"{config}: size.shortest_edge without a centre crop (do_center_crop, "
                                          f"crop_size) leaves images of several sizes; the tower takes one")
        edge, out = int(size["shortest_edge"]), (int(crop["height"]), int(crop["width"]))
        if edge < max(out):
            raise PreprocessorConfigError(f"{config}: size.shortest_edge = {edge} is smaller than crop_size {out}: "
                                          f"the crop would need padding, which loom does not do")
        return {"shortest_edge": edge, "size": out}
    if {"height", "width"} <= set(size) and not data.get("do_center_crop", False):
        return {"size": (int(size["height"]), int(size["width"]))}
    raise PreprocessorConfigError(f"{config}: size = {size}, crop_size = {crop}: loom reads size.shortest_edge with "
                                  f"a centre crop (CLIP's processor) or size.height and width (SigLIP's)")


def _qwen2_vl_sizes(data: dict, size: dict) -> dict:
    """Qwen2-VL's processor: sides in whole merger groups, the pixel count within its bounds (transformers 5's
    `size.shortest_edge` / `longest_edge`, 4's `min_pixels` / `max_pixels`; its defaults where neither is)."""
    least = size.get("shortest_edge") or size.get("min_pixels") or data.get("min_pixels") or 56 * 56
    most = size.get("longest_edge") or size.get("max_pixels") or data.get("max_pixels") or 28 * 28 * 1280
    return {"patch": int(data.get("patch_size", 14)) * int(data["merge_size"]), "min_pixels": int(least),
            "max_pixels": int(most), "smart_resize": True}


def target_size(height: int, width: int, rule: ImageRule) -> tuple[int, int]:
    """(H, W): multiples of the patch, the aspect ratio kept, H·W within [min_pixels, max_pixels]; or the
    processor's size (ImageRule.size)."""
    return rule.size or resized_size(height, width, rule)


def resized_size(height: int, width: int, rule: ImageRule) -> tuple[int, int]:
    """(H, W) an image is resized to, before any crop."""
    if rule.shortest_edge:  # as transformers' get_resize_output_image_size: the longer side truncated
        short, long = min(height, width), max(height, width)
        other = int(rule.shortest_edge * long / short)
        return (other, rule.shortest_edge) if width <= height else (rule.shortest_edge, other)
    if rule.size:
        return rule.size
    if rule.smart_resize:
        return smart_resize(height, width, rule)
    p = rule.patch
    h, w = max(p, round(height / p) * p), max(p, round(width / p) * p)
    if h * w > rule.max_pixels:
        beta = math.sqrt(height * width / rule.max_pixels)
        h, w = max(p, math.floor(height / beta / p) * p), max(p, math.floor(width / beta / p) * p)
        while h * w > rule.max_pixels:  # one side held at a whole patch: the other gives way
            h, w = (h - p, w) if h >= w else (h, w - p)
    elif h * w < rule.min_pixels:
        beta = math.sqrt(rule.min_pixels / (height * width))
        h, w = math.ceil(height * beta / p) * p, math.ceil(width * beta / p) * p
    return h, w


def smart_resize(height: int, width: int, rule: ImageRule) -> tuple[int, int]:
    """Qwen2-VL's smart_resize as its processor runs it: unlike resized_size, a side rounds to 0 patches before
    the pixel bounds are applied (a thin image then grows by the min_pixels rule)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {height}×{width} pixels: Qwen2-VL's processor takes aspect ratios up to 200")
    p = rule.patch
    h, w = round(height / p) * p, round(width / p) * p
    if h * w > rule.max_pixels:
        beta = math.sqrt(height * width / rule.max_pixels)
        h, w = max(p, math.floor(height / beta / p) * p), max(p, math.floor(width / beta / p) * p)
    elif h * w < rule.min_pixels:
        beta = math.sqrt(rule.min_pixels / (height * width))
        h, w = math.ceil(height * beta / p) * p, math.ceil(width * beta / p) * p
    return h, w


def image_file(source: str | Path | bytes, rule: ImageRule, where: str = "", name: str = "") -> MediaFile:
    """The image at `source` (a file, or its bytes held in a table: `name` says where), its size read from the
    header alone (Pillow opens lazily); decoded on `load()`."""
    label = name or str(source)
    try:
        with Image.open(opened(source)) as img:
            height, width = upright_size(img)  # a photo stored turned (EXIF) is fed upright
    except (OSError, UnidentifiedImageError) as e:
        raise BadSample(f"{where + ': ' if where else ''}cannot read image {label!r} ({e})") from None
    return MediaFile(label, (3, *target_size(height, width, rule)),
                     functools.partial(load_image, source, rule, where, name))


def load_image(source: str | Path | bytes, rule: ImageRule, where: str = "", name: str = "") -> torch.Tensor:
    """[3, H, W] float32, normalised; an undecodable file is a BadSample naming `where` (file:line) and it."""
    try:
        with Image.open(opened(source)) as img:
            img = as_rgb(img)
            h, w = resized_size(img.height, img.width, rule)
            img = img.resize((w, h), Image.Resampling(rule.resample))
            if rule.shortest_edge:  # the centred crop, its top-left corner rounded down as transformers rounds it
                (ch, cw), top, left = rule.size, (h - rule.size[0]) // 2, (w - rule.size[1]) // 2
                img = img.crop((left, top, left + cw, top + ch))
            return normalised(img, rule)
    except (OSError, UnidentifiedImageError) as e:
        raise BadSample(f"{where + ': ' if where else ''}cannot decode image {name or str(source)!r} ({e})") from None


def normalised(img: Image.Image, rule: ImageRule) -> torch.Tensor:
    """An 8-bit RGB picture → [3, H, W] float32: rescaled, then the mean taken off and divided by the std."""
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) * np.float32(rule.rescale_factor)).permute(2, 0, 1)
    mean, std = torch.tensor(rule.mean).view(3, 1, 1), torch.tensor(rule.std).view(3, 1, 1)
    return (x - mean) / std


def opened(source: str | Path | bytes):
    """What Image.open reads: a path, or a file's bytes (a `datasets` Image feature's) as a file object."""
    return io.BytesIO(source) if isinstance(source, bytes) else source
