"""A decoded picture in any Pillow mode → 8-bit RGB, as a Hugging Face processor sees it.

transformers' `load_image` turns the picture upright by its EXIF orientation (`exif_transpose`; here read from
the header alone, so the size a header promises is the size decoded), and its
`convert_to_rgb` composites transparency (an alpha band: RGBA, LA, PA; or a palette / greyscale
`transparency` entry) onto white; every other mode (L, P, CMYK, YCbCr, 1) is Pillow's `convert("RGB")`.
One departure: a 16-bit greyscale picture (I;16*, or I as Pillow opens 16-bit PNGs) is scaled to 8 bits
(v / 257) first, where Pillow's conversion, and so transformers', clips every value above 255 to white.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

WIDE_GREY = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # 16 bits per pixel (I: 32-bit ints holding 16-bit PNGs)
ORIENTATION = 0x0112  # the EXIF tag; values 5-8 turn the picture a quarter, so width and height swap


# exif_transpose's turns, by EXIF orientation
TURNS = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
         5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
         8: Image.Transpose.ROTATE_90}


def orientation(img: Image.Image) -> int:
    """The EXIF orientation (1: upright), from the header alone: a PNG's only from an eXIf chunk before its
    pixels (Pillow's getexif() would decode the whole PNG to look for one after them)."""
    if img.format == "PNG":
        exif = Image.Exif()
        if img.info.get("exif"):
            exif.load(img.info["exif"])
        return exif.get(ORIENTATION, 1)
    return img.getexif().get(ORIENTATION, 1)


def upright_size(img: Image.Image) -> tuple[int, int]:
    """(height, width) once the EXIF orientation is applied, from the header alone."""
    swapped = orientation(img) in (5, 6, 7, 8)
    return (img.width, img.height) if swapped else (img.height, img.width)


def as_rgb(img: Image.Image) -> Image.Image:
    """`img` upright (exif_transpose's turn, by the header's orientation), in 8-bit RGB, transparency on white."""
    turn = TURNS.get(orientation(img))
    if turn is not None:
        img = img.transpose(turn)
    if img.mode in WIDE_GREY:
        grey = np.asarray(img, dtype=np.float64) / 257.0
        img = Image.fromarray(np.clip(np.round(grey), 0, 255).astype(np.uint8), "L")
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, img.convert("RGBA")).convert("RGB")
    return img.convert("RGB")
