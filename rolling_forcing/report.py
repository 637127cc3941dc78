"""Per-chunk latency report against the real-time deadline (figures are *measured*: CPU wall clock).

A chunk of ``frames_per_block`` latent frames decodes to ``frames_per_block * temporal_stride`` video
frames (12 for Wan2.1: 3 x 4), which play for ``12 / fps`` seconds (750 ms at 16 fps). For real-time
streaming each chunk must be ready within that time after the previous one: this is the deadline. The
first chunk decodes to fewer frames (9: Wan's causal VAE) and has to wait for the warm-up windows; its
latency is reported as the time to first frame and is not counted against the deadline.

Report fields (seconds unless named otherwise):

* ``time_to_first_frame_s``: from the start of the stream to the first chunk being ready (decoded).
* ``chunk_latency_s``: per chunk, the time since the previous chunk was ready (the first: since start).
* ``p50/p99/max`` over the steady-state chunks (index >= 1), ``deadline_misses`` = steady-state chunks
  whose latency exceeds the deadline, ``headroom`` = ``deadline / p50 - 1`` (>= 0 means faster than real
  time at the median; ``deadline / p99 - 1`` as well).
* ``playback_stalls``: chunks that would not be ready in time if playback started when the first chunk
  was ready (a cumulative criterion: slack earned by fast chunks pays for slow ones).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ChunkTiming:
    """Wall-clock record of one chunk (``ready_s`` is measured from the stream start)."""

    block: int
    ready_s: float
    video_frames: int
    generate_s: float = 0.0
    decode_s: float = 0.0
    write_s: float = 0.0


def deadline_s(frames_per_block: int, temporal_stride: int, fps: float) -> float:
    """Real-time budget per chunk: ``frames_per_block * temporal_stride / fps`` (3 * 4 / 16 = 0.75 s)."""
    if frames_per_block <= 0 or temporal_stride <= 0 or fps <= 0:
        raise ValueError(
            f"frames_per_block, temporal_stride and fps must be positive, got "
            f"{frames_per_block}, {temporal_stride}, {fps}"
        )
    return frames_per_block * temporal_stride / fps


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]; nan for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class LatencyReport:
    """Summary of a stream's chunk timings; every figure is measured (CPU wall clock)."""

    deadline_s: float
    fps: float
    chunks: tuple[ChunkTiming, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    kind: str = "measured"
    clock: str = "CPU wall clock (time.perf_counter)"

    @property
    def latencies_s(self) -> list[float]:
        prev = 0.0
        out = []
        for c in self.chunks:
            out.append(c.ready_s - prev)
            prev = c.ready_s
        return out

    @property
    def steady_latencies_s(self) -> list[float]:
        return self.latencies_s[1:]

    def summary(self) -> dict[str, Any]:
        lat = self.latencies_s
        steady = lat[1:]
        p50 = percentile(steady, 50)
        p99 = percentile(steady, 99)
        ttff = lat[0] if lat else math.nan
        stalls = 0
        if self.chunks:
            play_at = self.chunks[0].ready_s
            for prev, c in zip(self.chunks, self.chunks[1:]):
                play_at += prev.video_frames / self.fps  # when chunk c's first frame is due on screen
                if c.ready_s > play_at + 1e-12:
                    stalls += 1
        total_frames = sum(c.video_frames for c in self.chunks)
        span = self.chunks[-1].ready_s - self.chunks[0].ready_s if len(self.chunks) > 1 else math.nan
        steady_frames = sum(c.video_frames for c in self.chunks[1:])
        return {
            "kind": self.kind,
            "clock": self.clock,
            "chunks": len(self.chunks),
            "video_frames": total_frames,
            "fps_target": self.fps,
            "deadline_s": self.deadline_s,
            "time_to_first_frame_s": ttff,
            "p50_chunk_latency_s": p50,
            "p99_chunk_latency_s": p99,
            "max_chunk_latency_s": max(steady) if steady else math.nan,
            "deadline_misses": sum(x > self.deadline_s for x in steady),
            "steady_chunks": len(steady),
            "headroom_p50": self.deadline_s / p50 - 1.0 if steady else math.nan,
            "headroom_p99": self.deadline_s / p99 - 1.0 if steady else math.nan,
            "playback_stalls": stalls,
            "throughput_fps": steady_frames / span if len(self.chunks) > 1 and span > 0 else math.nan,
            "total_s": self.chunks[-1].ready_s if self.chunks else 0.0,
        }

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "meta": dict(self.meta),
            "chunks": [dict(asdict(c), latency_s=lat) for c, lat in zip(self.chunks, self.latencies_s)],
        }

    def write_json(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json_dict(), indent=2, allow_nan=True) + "\n")

    def format_table(self) -> str:
        """Plain-text per-chunk table plus the summary lines (labelled measured)."""
        lines = [
            f"per-chunk latency ({self.kind}, {self.clock}); real-time deadline "
            f"{self.deadline_s * 1e3:.0f} ms per chunk at {self.fps:g} fps",
            f"{'chunk':>5} {'frames':>6} {'latency ms':>10} {'gen ms':>8} {'decode ms':>9} {'write ms':>8}"
            "  deadline",
        ]
        for i, (c, lat) in enumerate(zip(self.chunks, self.latencies_s)):
            verdict = "first (warm-up)" if i == 0 else ("MISS" if lat > self.deadline_s else "ok")
            lines.append(
                f"{c.block:>5} {c.video_frames:>6} {lat * 1e3:>10.1f} {c.generate_s * 1e3:>8.1f} "
                f"{c.decode_s * 1e3:>9.1f} {c.write_s * 1e3:>8.1f}  {verdict}"
            )
        s = self.summary()
        lines += [
            f"time to first frame: {s['time_to_first_frame_s'] * 1e3:.1f} ms",
            f"steady-state chunk latency: p50 {s['p50_chunk_latency_s'] * 1e3:.1f} ms, "
            f"p99 {s['p99_chunk_latency_s'] * 1e3:.1f} ms, max {s['max_chunk_latency_s'] * 1e3:.1f} ms",
            f"deadline misses: {s['deadline_misses']}/{s['steady_chunks']}; headroom at p50 "
            f"{s['headroom_p50'] * 100:+.0f}%, at p99 {s['headroom_p99'] * 100:+.0f}%; "
            f"playback stalls: {s['playback_stalls']}",
            f"throughput: {s['throughput_fps']:.1f} video frames/s (target {self.fps:g})",
        ]
        return "\n".join(lines)


class ChunkTimer:
    """Collects :class:`ChunkTiming` rows against one start time (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.rows: list[ChunkTiming] = []

    def now(self) -> float:
        return time.perf_counter() - self.start

    def add(
        self, block: int, video_frames: int, *, generate_s: float, decode_s: float, write_s: float
    ) -> None:
        self.rows.append(ChunkTiming(block, self.now(), video_frames, generate_s, decode_s, write_s))

    def report(self, deadline: float, fps: float, meta: dict[str, Any] | None = None) -> LatencyReport:
        return LatencyReport(deadline, fps, tuple(self.rows), dict(meta or {}))
