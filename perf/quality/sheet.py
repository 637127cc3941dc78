"""PNG contact sheets: a grid of evenly spaced frames of a stream, each captioned with its time.

Layout (pixels): tiles of ``H * scale`` x ``W * scale`` (nearest-neighbour upscaling), a caption strip of
:data:`CAPTION` pixels under each tile, :data:`GAP` pixels between tiles and around the grid, on a dark
background: ``width = cols * (W * scale + GAP) + GAP``, ``height = rows * (H * scale + CAPTION + GAP) + GAP``
(:func:`sheet_size`). Pillow draws the captions and writes the PNG (imported when called).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["CAPTION", "GAP", "contact_sheet", "pick_frames", "sheet_size", "write_png"]

GAP = 4
CAPTION = 14
_BG = (24, 24, 24)


def pick_frames(num_frames: int, count: int) -> np.ndarray:
    """``count`` (>= 1) frame indices evenly spaced over ``[0, num_frames)`` (first and last included)."""
    if num_frames < 1 or count < 1:
        raise ValueError(f"pick_frames: need num_frames >= 1 and count >= 1, got {num_frames}, {count}")
    return np.unique(np.round(np.linspace(0, num_frames - 1, min(count, num_frames))).astype(np.int64))


def sheet_size(frame_hw: tuple[int, int], rows: int, cols: int, scale: int) -> tuple[int, int]:
    """``(height, width)`` of a sheet of ``rows`` x ``cols`` tiles of frames ``frame_hw`` at ``scale``."""
    h, w = frame_hw
    return rows * (h * scale + CAPTION + GAP) + GAP, cols * (w * scale + GAP) + GAP


def contact_sheet(
    frames: np.ndarray,
    *,
    cols: int = 8,
    count: int = 16,
    scale: int = 2,
    fps: float = 16.0,
    captions: Sequence[str] | None = None,
) -> np.ndarray:
    """uint8 ``[H, W, 3]`` grid of ``count`` evenly spaced frames of uint8 ``[T, h, w, 3]`` ``frames``
    (``cols`` per row, ``scale`` >= 1), captioned ``"t=1.25s"`` at ``fps`` unless ``captions`` (one per
    picked frame) are given."""
    if (
        not isinstance(frames, np.ndarray)
        or frames.ndim != 4
        or frames.shape[-1] != 3
        or frames.dtype != np.uint8
    ):
        got = (frames.shape, frames.dtype) if isinstance(frames, np.ndarray) else type(frames).__name__
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {got}")
    if cols < 1 or scale < 1:
        raise ValueError(f"contact_sheet: cols and scale must be >= 1, got {cols}, {scale}")
    from PIL import Image, ImageDraw

    idx = pick_frames(frames.shape[0], count)
    if captions is not None and len(captions) != idx.size:
        raise ValueError(f"contact_sheet: {idx.size} frames picked but {len(captions)} captions given")
    rows = -(-idx.size // cols)
    cols = min(cols, idx.size)
    h, w = frames.shape[1] * scale, frames.shape[2] * scale
    height, width = sheet_size(frames.shape[1:3], rows, cols, scale)
    img = Image.new("RGB", (width, height), _BG)
    draw = ImageDraw.Draw(img)
    for n, t in enumerate(idx):
        r, c = divmod(n, cols)
        x0, y0 = GAP + c * (w + GAP), GAP + r * (h + CAPTION + GAP)
        tile = frames[t].repeat(scale, axis=0).repeat(scale, axis=1)
        img.paste(Image.fromarray(tile), (x0, y0))
        text = captions[n] if captions is not None else f"t={t / fps:.2f}s"
        draw.text((x0 + 1, y0 + h + 1), text, fill=(220, 220, 220))
    return np.asarray(img, dtype=np.uint8)


def write_png(path: str | Path, image: np.ndarray) -> Path:
    """Write uint8 ``[H, W, 3]`` ``image`` as a PNG (parent directories created); returns the path."""
    from PIL import Image

    if (
        not isinstance(image, np.ndarray)
        or image.ndim != 3
        or image.shape[-1] != 3
        or image.dtype != np.uint8
    ):
        raise ValueError("write_png: image must be uint8 [H, W, 3]")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(p, format="PNG")
    return p
