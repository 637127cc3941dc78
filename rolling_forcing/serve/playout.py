"""Playout buffer of one session: a bounded FIFO of encoded frames and the session's playback clock.

Pure index maths first (tested on their own), then :class:`PlayoutBuffer`, shared by the producer (the
scheduler thread pushes whole chunks) and the viewer's sender (the event loop polls due frames).

Rules (docs/serve.md):

* Depth: at most ``depth`` frames are held; the producer only generates a chunk for a session whose
  buffer has room for a whole chunk (back-pressure: nothing is dropped for lack of room).
* Start: the clock starts at the first poll that finds at least ``start_frames`` frames buffered
  (:func:`start_threshold`: enough frames to play through the measured p99 wait for the next chunk).
* Slots: frame ``n`` is due at ``t0 + (n - n0) / fps``. A frame polled more than one frame period after
  its slot (it was produced too late) missed its slot: it is dropped and counted in ``dropped``, never
  silently. ``late_chunks`` counts chunks whose first frame was pushed after its slot had passed.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass


def start_threshold(p99_wait_s: float, fps: float, depth: int) -> int:
    """Frames to buffer before playback starts: ``ceil(p99_wait_s * fps)`` clipped to ``[1, depth]``.

    ``p99_wait_s`` is the measured p99 time a session waits for its next chunk (its chunk cost times the
    sessions sharing the worker); the buffered frames then play through that wait without a gap.
    """
    if not (p99_wait_s >= 0 and math.isfinite(p99_wait_s)):
        raise ValueError(f"p99_wait_s must be a finite number >= 0, got {p99_wait_s}")
    if fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    return max(1, min(depth, math.ceil(p99_wait_s * fps - 1e-9)))


def first_frame_of_block(block: int, frames_per_block: int = 3, temporal_stride: int = 4) -> int:
    """Index of the first video frame of ``block`` in its stream (Wan's causal count: block 0 gives
    ``stride * fpb - (stride - 1)`` frames, every later block ``stride * fpb``)."""
    if block < 0:
        raise ValueError(f"block must be >= 0, got {block}")
    if block == 0:
        return 0
    return (
        temporal_stride * frames_per_block
        - (temporal_stride - 1)
        + temporal_stride * frames_per_block * (block - 1)
    )


def slot_time(t0: float, n0: int, index: int, fps: float) -> float:
    """Wall-clock slot of frame ``index`` on a clock started at ``t0`` with frame ``n0``."""
    return t0 + (index - n0) / fps


@dataclass(frozen=True)
class Frame:
    """One encoded video frame: its index in the stream, the block it came from, the image bytes."""

    index: int
    block: int
    data: bytes


class PlayoutBuffer:
    """Thread-safe bounded frame FIFO with the session's playback clock (see the module docstring).

    Args:
        depth: capacity in frames (>= 1).
        fps: playback rate (> 0).
        start_frames: frames to hold before the clock starts, in ``[1, depth]``.
    """

    def __init__(self, depth: int, fps: float, start_frames: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if fps <= 0:
            raise ValueError(f"fps must be > 0, got {fps}")
        if not 1 <= start_frames <= depth:
            raise ValueError(f"start_frames must be in [1, depth={depth}], got {start_frames}")
        self.depth, self.fps, self.start_frames = depth, fps, start_frames
        self._frames: deque[Frame] = deque()
        self._lock = threading.Lock()
        self.t0: float | None = None  # wall clock of the first slot
        self.n0 = 0  # index of the frame played at t0
        self.next_index = 0  # index the next pushed frame must carry
        self.sent = 0
        self.dropped = 0
        self.late_chunks = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._frames)

    def room(self) -> int:
        """Free frames of capacity."""
        with self._lock:
            return self.depth - len(self._frames)

    @property
    def started(self) -> bool:
        return self.t0 is not None

    def push(self, frames: list[Frame], now: float) -> None:
        """Append a chunk's frames (consecutive indices from ``next_index``); raises if it does not fit."""
        with self._lock:
            if len(self._frames) + len(frames) > self.depth:
                raise ValueError(
                    f"chunk of {len(frames)} frames does not fit: {len(self._frames)} of {self.depth} held"
                )
            for i, f in enumerate(frames):
                if f.index != self.next_index + i:
                    raise ValueError(f"frame index {f.index} out of order (expected {self.next_index + i})")
            if (
                frames
                and self.t0 is not None
                and now > slot_time(self.t0, self.n0, frames[0].index, self.fps)
            ):
                self.late_chunks += 1
            self._frames.extend(frames)
            self.next_index += len(frames)

    def lead_s(self, now: float) -> float:
        """Seconds of video buffered ahead of the clock (before the start: frames held / fps)."""
        with self._lock:
            if self.t0 is None:
                return len(self._frames) / self.fps
            return slot_time(self.t0, self.n0, self.next_index, self.fps) - now

    def poll(self, now: float) -> list[Frame]:
        """Frames due at ``now`` to show, oldest first; frames more than one period late are dropped
        (counted in ``dropped``). Starts the clock when ``start_frames`` are held."""
        with self._lock:
            if self.t0 is None:
                if len(self._frames) < self.start_frames:
                    return []
                self.t0, self.n0 = now, self._frames[0].index
            out: list[Frame] = []
            period = 1.0 / self.fps
            while self._frames and slot_time(self.t0, self.n0, self._frames[0].index, self.fps) <= now:
                f = self._frames.popleft()
                if now - slot_time(self.t0, self.n0, f.index, self.fps) > period:
                    self.dropped += 1
                else:
                    out.append(f)
            self.sent += len(out)
            return out

    def next_due(self) -> float | None:
        """Wall-clock slot of the oldest held frame (None before the start or when empty)."""
        with self._lock:
            if self.t0 is None or not self._frames:
                return None
            return slot_time(self.t0, self.n0, self._frames[0].index, self.fps)


__all__ = ["Frame", "PlayoutBuffer", "first_frame_of_block", "slot_time", "start_threshold"]
