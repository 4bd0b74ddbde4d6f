"""Image preprocessing for Llama 4: decode, RGB, tile, normalise -- the pixels Meta's reference feeds its model.

An image is resized without distortion onto the canvas of whole tiles (at most ``max_num_chunks``)
that needs the least resizing, padded with black on the right and bottom, normalised to [-1, 1]
and cut into tiles row by row. When that gives more than one tile, a thumbnail of the whole
image squeezed to one tile is appended. Resizing is Pillow's bilinear filter, as in the reference.
"""

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import PromptError


@dataclass
class TransformedImage:
    tiles: torch.Tensor  # float32 [n, 3, size, size]; the thumbnail last when n > 1
    grid: tuple[int, int]  # tiles (rows, columns) of the canvas, thumbnail not counted


def load_image(data: Any):
    """A PIL image in RGB from bytes, a file path, a binary file object or a PIL image.

    Transparent pixels (RGBA) are laid over white; other modes are converted as Pillow does.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, Image.Image):
        image, what = data, "the image"
    else:
        if isinstance(data, (bytes, bytearray)):
            source, what = io.BytesIO(data), "the image bytes"
        elif isinstance(data, (str, os.PathLike)):
            path = Path(data).expanduser()
            if not path.is_file():
                raise PromptError(f"image file {path} does not exist")
            source, what = path, f"image file {path}"
        elif hasattr(data, "read"):
            source, what = data, "the image stream"
        else:
            raise PromptError(f"an image must be bytes, a file path or a PIL image, not {type(data).__name__}")
        try:
            image = Image.open(source)
            image.load()
        except UnidentifiedImageError:
            raise PromptError(f"{what} is not an image format Pillow can read") from None
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise PromptError(f"cannot read {what}: {e}") from None
    if image.mode == "RGBA":
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(image, mask=image.split()[3])
        return rgb
    return image.convert("RGB")


def supported_canvases(max_num_chunks: int, size: int) -> list[tuple[int, int]]:
    """Canvases of up to ``max_num_chunks`` tiles, in the reference's order (which settles ties):
    grouped by aspect ratio in order of first appearance, walking tile counts downwards."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for n in range(max_num_chunks, 0, -1):
        factors = sorted({f for i in range(1, int(n**0.5) + 1) if n % i == 0 for f in (i, n // i)})
        for a in factors:
            by_ratio.setdefault(a / (n // a), []).append((a, n // a))
    # The reference reads the first of each pair as the canvas width.
    return [(a * size, b * size) for pairs in by_ratio.values() for a, b in pairs]


def best_canvas(width: int, height: int, canvases: list[tuple[int, int]]) -> tuple[int, int]:
    """(width, height) of the canvas needing the smallest upscale (or, if none fits, the least
    downscale) without distortion; among equals the one of least area (first on ties)."""
    res = torch.tensor(canvases)
    scale_w, scale_h = res[:, 0] / width, res[:, 1] / height  # float32, as the reference computes them
    scales = torch.where(scale_w > scale_h, scale_h, scale_w)
    up = scales[scales >= 1]
    chosen = torch.min(up) if len(up) > 0 else torch.max(scales[scales < 1])
    fits = res[scales == chosen]
    return tuple(fits[torch.argmin(fits[:, 0] * fits[:, 1])].tolist())


def _fit(width: int, height: int, target_w: int, target_h: int) -> tuple[int, int]:
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return target_w, min(math.floor(height * scale_w), target_h)
    return min(math.floor(width * scale_h), target_w), target_h


def _to_tensor(image) -> torch.Tensor:
    """uint8 RGB -> float32 [3, H, W] in [-1, 1]: x / 255, then (x - 0.5) / 0.5."""
    import numpy as np

    t = torch.from_numpy(np.array(image, dtype=np.uint8, copy=True)).permute(2, 0, 1)
    return t.to(torch.float32).div(255).sub_(0.5).div_(0.5)


def transform_image(image, size: int, max_num_chunks: int) -> TransformedImage:
    """Tiles of a PIL RGB image for tiles of ``size`` pixels (see the module's description)."""
    from PIL import Image

    if not isinstance(max_num_chunks, int) or isinstance(max_num_chunks, bool) or max_num_chunks < 1:
        raise PromptError(f"max_num_chunks must be a positive integer, got {max_num_chunks!r}")
    width, height = image.size
    canvas_w, canvas_h = best_canvas(width, height, supported_canvases(max_num_chunks, size))
    # A side grows at most to one tile's length (or stays as it is if longer): images are not blown up.
    target_w, target_h = min(max(width, size), canvas_w), min(max(height, size), canvas_h)
    new_w, new_h = _fit(width, height, target_w, target_h)
    resized = image.resize((max(new_w, 1), max(new_h, 1)), Image.BILINEAR)
    canvas = Image.new("RGB", (canvas_w, canvas_h), (0, 0, 0))
    canvas.paste(resized)
    x = _to_tensor(canvas)
    cols, rows = canvas_w // size, canvas_h // size
    tiles = x.view(3, rows, size, cols, size).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, size, size)
    if rows * cols > 1:
        thumb = _to_tensor(image.resize((size, size), Image.BILINEAR))
        tiles = torch.cat([tiles, thumb[None]], dim=0)
    return TransformedImage(tiles=tiles, grid=(rows, cols))
