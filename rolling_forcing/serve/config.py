"""Frozen configuration of ``rolling-forcing serve`` (validated on construction, nothing else happens)."""

from __future__ import annotations

import math
from dataclasses import dataclass

IMAGE_FORMATS = ("jpeg", "png")


@dataclass(frozen=True)
class ServeConfig:
    """Everything the server needs; every field is checked in ``__post_init__`` (``ValueError`` naming it).

    Attributes:
        preset: model preset (``rolling_forcing.config.PRESETS``); ``demo`` by default (the shipped trained
            model). ``demo`` and ``tiny`` need no files; the others are built by ``rolling-forcing serve``
            from ``--checkpoint`` and ``--text-encoder`` (see :mod:`rolling_forcing.serve.engine`).
        host, port: where uvicorn binds (127.0.0.1 by default: loopback only).
        max_sessions: hard cap on concurrent sessions (admission refuses beyond it).
        headroom: fraction of the per-chunk deadline kept free by admission, in [0, 1).
        buffer_frames: playout buffer depth in video frames (>= one chunk: 12 at Wan's 3 x 4).
        fps: playback rate of the decoded video (Wan2.1: 16); the deadline is ``12 / fps`` per chunk.
        image_format: ``"jpeg"`` (default) or ``"png"`` (lossless: the tests compare frames exactly).
        jpeg_quality: 1..95.
        weights_seed: seed of the tiny preset's random weights (and of the calibration stream's noise).
        max_prompt_chars: longest prompt accepted (characters, after stripping).
        prompt_interval_s: least time between two prompt switches of one session.
        session_interval_s: least time between two admitted sessions (server-wide).
        max_session_s: longest stream of one session (video seconds); its block count bounds the stream.
        connect_timeout_s: a session whose viewer has not connected (or has gone) for this long is closed.
        threads: torch intra-op threads while serving (1: the tiny and demo presets gain nothing from more).
        calibration_chunks: steady chunks of the untimed start-up stream that measure the chunk cost.
        cost_window: per-session chunk costs kept for its p99 (admission and buffer start).
        allowed_hosts: Host header names accepted; None: the loopback names when ``host`` is loopback,
            any otherwise (see :mod:`rolling_forcing.serve.guard`; a browser's Origin is always checked).
        report_dir: server-side directory for each closed session's JSON report (None: not written;
            reports are also returned by ``DELETE /api/sessions/{id}`` and ``GET /api/reports/{id}``).
    """

    preset: str = "demo"
    host: str = "127.0.0.1"
    port: int = 8000
    max_sessions: int = 4
    headroom: float = 0.2
    buffer_frames: int = 24
    fps: float = 16.0
    image_format: str = "jpeg"
    jpeg_quality: int = 85
    weights_seed: int = 0
    max_prompt_chars: int = 300
    prompt_interval_s: float = 1.0
    session_interval_s: float = 0.5
    max_session_s: float = 3600.0
    connect_timeout_s: float = 10.0
    threads: int = 1
    calibration_chunks: int = 6
    cost_window: int = 64
    report_dir: str | None = None
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        from rolling_forcing.config import PRESETS

        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {self.preset!r}")
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.host:
            raise ValueError("host must be a non-empty address")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not (0.0 <= self.headroom < 1.0):
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")
        if self.buffer_frames < self.chunk_frames:
            raise ValueError(
                f"buffer_frames must hold at least one chunk ({self.chunk_frames} frames), "
                f"got {self.buffer_frames}"
            )
        if not (math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"fps must be a positive number, got {self.fps}")
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {self.image_format!r}")
        if not (1 <= self.jpeg_quality <= 95):
            raise ValueError(f"jpeg_quality must be in [1, 95], got {self.jpeg_quality}")
        if self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        for name in ("prompt_interval_s", "session_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_session_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.calibration_chunks < 1:
            raise ValueError(f"calibration_chunks must be >= 1, got {self.calibration_chunks}")
        if self.cost_window < 1:
            raise ValueError(f"cost_window must be >= 1, got {self.cost_window}")

    @property
    def host_names(self) -> tuple[str, ...]:
        """Host header names the server answers (empty: any; see ``allowed_hosts``)."""
        from rolling_forcing.serve.guard import LOOPBACK_NAMES, is_loopback

        if self.allowed_hosts is not None:
            return tuple(h.lower() for h in self.allowed_hosts)
        return LOOPBACK_NAMES if is_loopback(self.host) else ()

    @property
    def chunk_frames(self) -> int:
        """Video frames of a steady chunk: ``frames_per_block`` (3) x Wan's temporal stride (4) = 12."""
        from rolling_forcing.config import PipelineConfig
        from rolling_forcing.video import VideoSpec

        return PipelineConfig().frames_per_block * VideoSpec().temporal_stride

    @property
    def deadline_s(self) -> float:
        """Real-time budget of one chunk: ``chunk_frames / fps`` (0.75 s at 16 fps)."""
        return self.chunk_frames / self.fps


__all__ = ["IMAGE_FORMATS", "ServeConfig"]
