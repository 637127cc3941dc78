"""Incremental MP4 writing (imageio + imageio-ffmpeg, H.264 / yuv420p) and read-back helpers.

Frames are appended chunk by chunk as the stream produces them, so a long stream never holds the whole
video in memory. Frames are uint8 ``[T, H, W, 3]``; H and W must be even (yuv420p chroma subsampling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np


@dataclass(frozen=True)
class VideoSpec:
    """Pixel-side constants of Wan2.1 (github.com/Wan-Video/Wan2.1 @ 9737cba: ``wan/configs``, VAE strides).

    ``fps``: sampling rate of the decoded video (16); ``temporal_stride``: video frames per latent frame
    after the first (causal VAE, 4); ``spatial_stride``: pixels per latent pixel (8).
    """

    fps: float = 16.0
    temporal_stride: int = 4
    spatial_stride: int = 8

    def __post_init__(self) -> None:
        if self.fps <= 0 or self.temporal_stride < 1 or self.spatial_stride < 1:
            raise ValueError(f"VideoSpec values must be positive, got {self}")

    def video_frames(self, num_blocks: int, frames_per_block: int) -> int:
        """Video frames of ``num_blocks`` blocks: ``stride * F - (stride - 1)`` for F latent frames."""
        if num_blocks < 1:
            return 0
        return self.temporal_stride * num_blocks * frames_per_block - (self.temporal_stride - 1)

    def blocks_for_seconds(self, seconds: float, frames_per_block: int) -> int:
        """Fewest blocks whose decoded video lasts at least ``seconds`` at ``fps``."""
        if not seconds > 0:
            raise ValueError(f"seconds must be positive, got {seconds}")
        want = math.ceil(seconds * self.fps - 1e-9)
        per_block = self.temporal_stride * frames_per_block
        return max(1, math.ceil((want + self.temporal_stride - 1) / per_block))


class VideoWriter:
    """Append uint8 ``[T, H, W, 3]`` frame batches to an H.264 MP4 at ``fps``.

    Use as a context manager or call :meth:`close`; the file is playable once closed.
    """

    def __init__(self, path: str | Path, fps: float, *, quality: float = 7.0) -> None:
        if fps <= 0:
            raise ValueError(f"fps must be positive, got {fps}")
        self.path = Path(path)
        if self.path.suffix.lower() != ".mp4":
            raise ValueError(f"out path must end with .mp4, got {str(self.path)!r}")
        self.fps = fps
        self.quality = quality
        self.frames_written = 0
        self._shape: tuple[int, int] | None = None
        self._writer: Any = None

    def _open(self) -> None:
        import imageio.v2 as iio

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = iio.get_writer(
            str(self.path),
            format="FFMPEG",
            mode="I",
            fps=self.fps,
            codec="libx264",
            pixelformat="yuv420p",
            quality=self.quality,
            macro_block_size=1,
            ffmpeg_log_level="error",
        )

    def write(self, frames: np.ndarray) -> None:
        """Append frames: uint8 ``[T, H, W, 3]`` (or one ``[H, W, 3]``); every batch must share H and W."""
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
            raise TypeError(f"frames must be a uint8 numpy array, got {type(frames).__name__}")
        if frames.ndim == 3:
            frames = frames[None]
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be [T, H, W, 3], got {list(frames.shape)}")
        h, w = frames.shape[1:3]
        if h % 2 or w % 2:
            raise ValueError(f"frame height and width must be even for yuv420p, got {h}x{w}")
        if self._shape is None:
            self._shape = (h, w)
            self._open()
        elif self._shape != (h, w):
            raise ValueError(f"frame size changed mid-stream from {self._shape} to {(h, w)}")
        for frame in frames:
            self._writer.append_data(frame)
        self.frames_written += frames.shape[0]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_video(path: str | Path) -> np.ndarray:
    """Decode a whole video file into uint8 ``[T, H, W, 3]`` (for tests and checks)."""
    import imageio.v2 as iio

    reader: Any = iio.get_reader(str(path), format="FFMPEG")
    try:
        return np.stack([np.asarray(f) for f in reader])
    finally:
        reader.close()
