"""Quality metrics of a decoded stream: pure functions over per-frame detections (perf/quality/detect.py).

An *object* is a ``(colour, kind)`` pair a prompt names (:func:`prompt_objects`). ``detections`` is a
sequence over frames of sequences of objects with attributes ``color``, ``kind``, ``x``, ``y``, ``area``
(a :class:`~perf.quality.detect.Detection` or anything shaped like it). Frames are pixel frames of the
stream at ``fps``; chunk ``c`` of a Rolling Forcing stream decodes to 9 frames for ``c = 0`` and 12 after
(:func:`chunk_starts`).

Metrics (the demo model's quality targets, :data:`TARGETS`; docs/quality.md):

(a) :func:`presence`: the fraction of frames in which every prompt object is detected (right colour and
    kind; a detection in contact with another object of the prompt, ``contact``, is matched by colour
    alone: an overlap hides part of one shape and its kind cannot be read) and, when the frames'
    backgrounds are given (:func:`~perf.quality.detect.read_backgrounds`), the background is the
    prompt's (a mosaic of random colours holds squares of every colour by chance, never a gray
    background). Target >= 0.9.
(b) :func:`continuity`: the mean displacement of the objects from the last frame of a chunk to the first
    frame of the next, over the mean displacement between consecutive frames inside a chunk. A stream
    that jumps at chunk boundaries has a ratio >> 1; smooth motion has ~1. Target <= 2.
(c) :func:`drift`: (a) over the last ``tail_seconds`` (30 s) of a long stream, and the objects' median
    speed there (:func:`speeds`, px per frame; "still moving" = every object at least ``min_speed``).
    Target >= 0.8.
Motion (no target; the prompt layout moves 0.3 px/frame): :func:`speeds`, each object's median
    displacement over one chunk (12 frames) per frame; :data:`MIN_SPEED` tells a moving object from one
    that stands (the detector's centroid jitters by a fraction of a pixel from frame to frame, so a
    standing blob has a per-frame median step of ~0.2 px; over 12 frames that averages out).
(d) :func:`switch_latency`: frames from a prompt switch until the new prompt's objects are detected in
    ``hold`` consecutive frames. Target <= 2 chunks (24 frames).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rolling_forcing.procedural import BACKGROUNDS, COLORS, SHAPES, prompt_words

__all__ = [
    "TARGETS",
    "Check",
    "check",
    "Continuity",
    "Drift",
    "DetectionLike",
    "Obj",
    "chunk_starts",
    "continuity",
    "drift",
    "longest_vanish",
    "presence",
    "presence_mask",
    "prompt_background",
    "prompt_objects",
    "switch_latency",
    "speeds",
    "track",
    "MIN_SPEED",
    "SPEED_LAG",
]

Obj = tuple[str, str]
"""An object a prompt names: ``(colour, kind)``."""

TARGETS: dict[str, tuple[str, float]] = {
    "presence": (">=", 0.9),
    "continuity_ratio": ("<=", 2.0),
    "tail_presence": (">=", 0.8),
    "switch_frames": ("<=", 24.0),
    "vanish_frames": ("<=", 12.0),
}
"""The demo model's quality targets: metric -> (sense, bound). ``switch_frames`` = 2 chunks of 12 frames."""

SPEED_LAG = 12
"""Frames over which :func:`speeds` measures a displacement: one chunk."""

MIN_SPEED = 0.15
"""px per frame: half the prompt layout's speed (``rolling_forcing.procedural.PROMPT_SPEED`` = 0.3); an
object whose median :func:`speeds` is lower stands still (a standing blob reads ~0.06, measured)."""


class DetectionLike(Protocol):
    """What the metrics read of a detection (:class:`~perf.quality.detect.Detection` has it all)."""

    @property
    def color(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def x(self) -> float: ...
    @property
    def y(self) -> float: ...
    @property
    def area(self) -> int: ...
    @property
    def contact(self) -> tuple[str, ...]: ...


Frames = Sequence[Sequence[DetectionLike]]


@dataclass(frozen=True)
class Check:
    """A metric against its target: ``value`` (None = not measurable, e.g. no frames), ``sense`` ``">="``
    or ``"<="``, ``target``; ``met`` is False when ``value`` is None."""

    name: str
    value: float | None
    sense: str
    target: float

    @property
    def met(self) -> bool:
        if self.value is None:
            return False
        return self.value >= self.target if self.sense == ">=" else self.value <= self.target

    def describe(self) -> str:
        v = "n/a" if self.value is None else f"{self.value:.3g}"
        return f"{self.name} = {v} (target {self.sense} {self.target:g}: {'met' if self.met else 'MISSED'})"


def check(name: str, value: float | None) -> Check:
    """:class:`Check` of ``value`` against :data:`TARGETS` ``[name]``."""
    sense, target = TARGETS[name]
    return Check(name, value, sense, target)


def prompt_background(prompt: str) -> str:
    """The background a prompt names (``"... on a gray background"`` -> ``"gray"``); ``ValueError`` if it
    names none."""
    words = prompt_words(prompt)
    bgs = [a for a, b in zip(words, words[1:]) if b == "background" and a in BACKGROUNDS]
    if len(bgs) != 1:
        raise ValueError(f"prompt {prompt!r} must name one '<{'|'.join(BACKGROUNDS)}> background'")
    return bgs[0]


def prompt_objects(prompt: str) -> tuple[Obj, ...]:
    """The ``(colour, kind)`` pairs a prompt names, in order: ``"a red circle and a blue square bouncing
    on a gray background"`` -> ``(("red", "circle"), ("blue", "square"))``. Raises ``ValueError`` for a
    word outside the vocabulary or a prompt naming no object."""
    words = prompt_words(prompt)
    out = [(a, b) for a, b in zip(words, words[1:]) if a in COLORS and b in SHAPES]
    if not out:
        raise ValueError(f"prompt {prompt!r} names no '<colour> <shape>' object")
    return tuple(out)


def _check_objects(objects: Sequence[Obj]) -> None:
    if not objects:
        raise ValueError("objects must name at least one (colour, kind) pair")
    for o in objects:
        if len(o) != 2 or o[0] not in COLORS or o[1] not in SHAPES:
            raise ValueError(f"objects: {o!r} is not a (colour, kind) pair of {tuple(COLORS)} x {SHAPES}")


def track(detections: Frames, objects: Sequence[Obj]) -> np.ndarray:
    """Positions ``[T, n_objects, 2]`` (x, y; NaN where absent): per frame and object, the largest
    detection of its colour and kind, else the largest of its colour in ``contact`` with the colour of
    another of ``objects`` (partly hidden: kind unreadable); a detection serves one object only."""
    _check_objects(objects)
    out = np.full((len(detections), len(objects), 2), np.nan)
    colors = {c for c, _ in objects}
    for t, dets in enumerate(detections):
        used: set[int] = set()
        for j, (color, kind) in enumerate(objects):
            best, best_key = None, (False, 0)
            for i, d in enumerate(dets):
                hidden = any(c != color and c in colors for c in d.contact)
                if i in used or d.color != color or not (d.kind == kind or hidden):
                    continue
                key = (d.kind == kind, d.area)  # an exact kind first, then the largest
                if best is None or key > best_key:
                    best, best_key = i, key
            if best is not None:
                used.add(best)
                out[t, j] = dets[best].x, dets[best].y
    return out


def longest_vanish(detections: Frames, objects: Sequence[Obj]) -> list[int]:
    """Metric (e), per object of ``objects``: the longest run of consecutive frames in which *no* detection
    has the object's colour (it vanished; a wrong kind is (a)'s business, not this one). Two objects of
    one colour vanish together only when no detection of it is left. Target: at most one chunk (12)."""
    _check_objects(objects)
    out = []
    for color, _ in objects:
        best = run = 0
        for dets in detections:
            run = 0 if any(d.color == color for d in dets) else run + 1
            best = max(best, run)
        out.append(best)
    return out


def presence_mask(
    detections: Frames,
    objects: Sequence[Obj],
    backgrounds: Sequence[str | None] | None = None,
    background: str | None = None,
) -> np.ndarray:
    """bool ``[T]``: every object of ``objects`` is detected in the frame and, if ``backgrounds`` (one per
    frame, :func:`~perf.quality.detect.read_backgrounds`) and ``background`` (the prompt's) are given,
    the frame's background is ``background``. Give both or neither."""
    ok = ~np.isnan(track(detections, objects)).any(axis=(1, 2))
    if (backgrounds is None) != (background is None):
        raise ValueError(
            "presence: give both backgrounds (per frame) and background (the prompt's) or neither"
        )
    if backgrounds is not None:
        if len(backgrounds) != len(detections):
            raise ValueError(f"backgrounds has {len(backgrounds)} frames, detections {len(detections)}")
        ok &= np.array([b == background for b in backgrounds], dtype=bool)
    return ok


def presence(
    detections: Frames,
    objects: Sequence[Obj],
    backgrounds: Sequence[str | None] | None = None,
    background: str | None = None,
) -> float | None:
    """Metric (a): the fraction of frames passing :func:`presence_mask` (None for zero frames)."""
    if len(detections) == 0:
        return None
    return float(presence_mask(detections, objects, backgrounds, background).mean())


def chunk_starts(num_frames: int, first: int = 9, per: int = 12) -> np.ndarray:
    """Pixel-frame indices where a new chunk starts: ``first, first + per, ...`` below ``num_frames``
    (Wan's causal decode of 3-latent-frame chunks: 9 frames for the first, 12 after)."""
    if num_frames < 0 or first < 1 or per < 1:
        raise ValueError(
            f"chunk_starts: need num_frames >= 0, first >= 1, per >= 1, got {num_frames}, {first}, {per}"
        )
    return np.arange(first, num_frames, per)


@dataclass(frozen=True)
class Continuity:
    """Metric (b): mean displacement (px per frame, over objects) at chunk boundaries and inside chunks,
    the number of (frame, object) samples of each, and ``ratio`` = boundary / within (None when there is
    no sample or the within-chunk displacement is 0)."""

    boundary: float | None
    within: float | None
    n_boundary: int
    n_within: int

    @property
    def ratio(self) -> float | None:
        if self.boundary is None or self.within is None or self.within == 0:
            return None
        return self.boundary / self.within


def continuity(positions: np.ndarray, starts: Sequence[int] | np.ndarray) -> Continuity:
    """Metric (b) from tracked ``positions`` ``[T, n, 2]`` (:func:`track`; NaN = absent) and the chunks'
    first frames ``starts`` (:func:`chunk_starts`): displacement ``|p[t] - p[t-1]|`` for ``t >= 1`` where
    the object is present in both frames, averaged separately over ``t`` in ``starts`` and the rest."""
    if positions.ndim != 3 or positions.shape[-1] != 2:
        raise ValueError(f"positions must be [T, n, 2], got shape {positions.shape}")
    if positions.shape[0] < 2:
        return Continuity(None, None, 0, 0)
    step = np.linalg.norm(positions[1:] - positions[:-1], axis=-1)  # [T-1, n]; row i is frame i + 1
    is_start = np.zeros(positions.shape[0], dtype=bool)
    s = np.asarray(starts, dtype=np.int64)
    is_start[s[(s >= 1) & (s < positions.shape[0])]] = True
    at = is_start[1:]
    ok = ~np.isnan(step)
    b, w = step[at][ok[at]], step[~at][ok[~at]]
    return Continuity(
        float(b.mean()) if b.size else None, float(w.mean()) if w.size else None, int(b.size), int(w.size)
    )


def speeds(positions: np.ndarray, lag: int = SPEED_LAG) -> tuple[float, ...]:
    """Per object of tracked ``positions`` ``[T, n, 2]`` (:func:`track`; NaN = absent): the median over
    ``t`` of ``|p[t + lag] - p[t]| / lag`` where the object is present at both (px per frame; NaN when it
    never is). ``lag`` >= 1; a wall bounce inside a window shortens that window's displacement."""
    if positions.ndim != 3 or positions.shape[-1] != 2:
        raise ValueError(f"positions must be [T, n, 2], got shape {positions.shape}")
    if lag < 1:
        raise ValueError(f"speeds: lag must be >= 1, got {lag}")
    if positions.shape[0] <= lag:
        return tuple(float("nan") for _ in range(positions.shape[1]))
    step = np.linalg.norm(positions[lag:] - positions[:-lag], axis=-1) / lag  # [T - lag, n]
    return tuple(
        float(np.median(col[~np.isnan(col)])) if (~np.isnan(col)).any() else float("nan") for col in step.T
    )


@dataclass(frozen=True)
class Drift:
    """Metric (c): ``tail_presence`` (metric (a) over the last ``tail_frames`` frames), each object's speed
    there (``speeds``: :func:`speeds`, px per frame; NaN when it was never seen twice :data:`SPEED_LAG`
    frames apart) and ``moving``: every object's speed at least ``min_speed``."""

    tail_frames: int
    tail_presence: float | None
    speeds: tuple[float, ...]
    min_speed: float

    @property
    def moving(self) -> bool:
        return all(s >= self.min_speed for s in self.speeds)  # NaN compares False


def drift(
    detections: Frames,
    objects: Sequence[Obj],
    fps: float,
    *,
    tail_seconds: float = 30.0,
    min_speed: float = MIN_SPEED,
    backgrounds: Sequence[str | None] | None = None,
    background: str | None = None,
) -> Drift:
    """Metric (c) over the last ``tail_seconds`` (> 0) of a stream at ``fps`` (> 0); the whole stream if
    it is shorter. ``min_speed`` (px per frame, >= 0): :data:`MIN_SPEED`, half the prompt layout's speed.
    ``backgrounds``, ``background``: as :func:`presence_mask`."""
    if not fps > 0 or not tail_seconds > 0 or min_speed < 0:
        raise ValueError(
            f"drift: need fps > 0, tail_seconds > 0, min_speed >= 0, got {fps}, {tail_seconds}, {min_speed}"
        )
    n = min(len(detections), int(round(tail_seconds * fps)))
    tail = detections[len(detections) - n :]
    v = speeds(track(tail, objects))
    tail_bg = None if backgrounds is None else backgrounds[len(backgrounds) - n :]
    return Drift(n, presence(tail, objects, tail_bg, background), v, min_speed)


def switch_latency(
    detections: Frames,
    objects: Sequence[Obj],
    switch_frame: int,
    *,
    hold: int = 4,
    backgrounds: Sequence[str | None] | None = None,
    background: str | None = None,
) -> int | None:
    """Metric (d): ``t - switch_frame`` for the first frame ``t >= switch_frame`` from which ``objects``
    (the new prompt's) are all present in ``hold`` (>= 1) consecutive frames; None if that never happens.
    ``switch_frame``: the first pixel frame of the first chunk generated under the new prompt.
    ``backgrounds``, ``background`` (the new prompt's): as :func:`presence_mask`."""
    if hold < 1 or switch_frame < 0:
        raise ValueError(f"switch_latency: need hold >= 1 and switch_frame >= 0, got {hold}, {switch_frame}")
    bgs = None if backgrounds is None else backgrounds[switch_frame:]
    ok = presence_mask(detections[switch_frame:], objects, bgs, background)
    run = 0
    for i, v in enumerate(ok):
        run = run + 1 if v else 0
        if run == hold:
            return i - hold + 1
    return None
