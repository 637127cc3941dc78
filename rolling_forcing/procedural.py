"""Procedural video scenes for a demo model: coloured shapes bouncing off the walls, with a text prompt.

A :class:`Scene` is 1-3 shapes (circle, square, triangle) of named colours on a plain background, each
moving with a constant velocity and bouncing off the frame's walls. Everything is a pure function of the
scene and the frame index: :func:`positions` gives any frame's shape centres in closed form (a triangle
wave per axis), so a stream is unbounded, needs no files and can start at any frame; :func:`render` draws
frames ``[T, H, W, 3]`` uint8. :func:`sample_scene` draws a scene from a ``numpy.random.Generator`` (seeded:
the same seed gives the same scene); :func:`scene_prompt` writes its prompt from the fixed vocabulary
(:data:`COLORS`, :data:`SHAPES`, :data:`BACKGROUNDS`), e.g. ``"a red circle and a blue square bouncing on a
gray background"``; :func:`prompt_words` checks a prompt against the vocabulary (an unknown word raises,
listing the vocabulary).

Sizes are in pixels of the configured frame (:class:`SceneConfig`, at least 16 x 16); velocities in pixels
per frame.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

__all__ = [
    "BACKGROUNDS",
    "COLORS",
    "SHAPES",
    "Scene",
    "SceneConfig",
    "Shape",
    "positions",
    "prompt_words",
    "check_sizes",
    "format_sizes",
    "parse_sizes",
    "check_speed",
    "render",
    "sample_scene",
    "scene_prompt",
    "vocabulary",
]

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 230),
    "yellow": (235, 215, 40),
    "white": (245, 245, 245),
    "purple": (150, 60, 200),
}
"""Shape colours (RGB) and their prompt words."""

BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (10, 10, 10),
    "gray": (110, 110, 110),
    "navy": (15, 25, 70),
}
"""Background colours (RGB) and their prompt words (distinct from every shape colour)."""

SHAPES = ("circle", "square", "triangle")
"""Shape kinds."""

_GLUE = ("a", "and", "bouncing", "on", "background")


def vocabulary() -> tuple[str, ...]:
    """Every word a prompt may use, sorted."""
    return tuple(sorted({*COLORS, *BACKGROUNDS, *SHAPES, *_GLUE}))


@dataclass(frozen=True)
class SceneConfig:
    """Frame size and scene ranges. ``height``, ``width`` >= 16; ``max_shapes`` in [1, 3]; shape sizes
    (the radius, half side or circumradius) between ``min_size`` and ``max_size`` pixels, at most a quarter
    of the smaller side; speeds between ``min_speed`` and ``max_speed`` pixels per frame."""

    height: int = 64
    width: int = 64
    max_shapes: int = 3
    min_size: float = 5.0
    max_size: float = 11.0
    min_speed: float = 0.5
    max_speed: float = 2.5

    def __post_init__(self) -> None:
        if self.height < 16 or self.width < 16:
            raise ValueError(f"SceneConfig: height and width must be >= 16, got {self.height}x{self.width}")
        if not 1 <= self.max_shapes <= 3:
            raise ValueError(f"SceneConfig.max_shapes must be in [1, 3], got {self.max_shapes}")
        if not 0 < self.min_size <= self.max_size <= min(self.height, self.width) / 4:
            raise ValueError(
                f"SceneConfig: need 0 < min_size <= max_size <= min(height, width) / 4, got "
                f"{self.min_size}, {self.max_size}"
            )
        if not 0 < self.min_speed <= self.max_speed:
            raise ValueError(
                f"SceneConfig: need 0 < min_speed <= max_speed, got {self.min_speed}, {self.max_speed}"
            )


@dataclass(frozen=True)
class Shape:
    """One shape: ``kind`` in :data:`SHAPES`, ``color`` in :data:`COLORS`, ``size`` (pixels), centre at
    frame 0 ``(x0, y0)`` and velocity ``(vx, vy)`` (pixels per frame)."""

    kind: str
    color: str
    size: float
    x0: float
    y0: float
    vx: float
    vy: float

    def __post_init__(self) -> None:
        if self.kind not in SHAPES:
            raise ValueError(f"Shape.kind must be one of {SHAPES}, got {self.kind!r}")
        if self.color not in COLORS:
            raise ValueError(f"Shape.color must be one of {tuple(COLORS)}, got {self.color!r}")
        if not self.size > 0:
            raise ValueError(f"Shape.size must be > 0, got {self.size}")


@dataclass(frozen=True)
class Scene:
    """Shapes (drawn in order, the last on top) on a background in :data:`BACKGROUNDS`."""

    shapes: tuple[Shape, ...]
    background: str
    config: SceneConfig = SceneConfig()

    def __post_init__(self) -> None:
        if not 1 <= len(self.shapes) <= 3:
            raise ValueError(f"Scene.shapes must hold 1-3 shapes, got {len(self.shapes)}")
        if self.background not in BACKGROUNDS:
            raise ValueError(f"Scene.background must be one of {tuple(BACKGROUNDS)}, got {self.background!r}")
        for s in self.shapes:
            lo_x, hi_x = s.size, self.config.width - s.size
            lo_y, hi_y = s.size, self.config.height - s.size
            if not (lo_x <= s.x0 <= hi_x and lo_y <= s.y0 <= hi_y):
                raise ValueError(f"Scene: shape {s.kind} starts at ({s.x0}, {s.y0}), outside its walls")


def sample_scene(rng: np.random.Generator, config: SceneConfig = SceneConfig()) -> Scene:
    """A random scene: 1..``max_shapes`` shapes of distinct (kind, colour) pairs, random sizes, start points
    and velocities; a random background. Pure given ``rng``'s state."""
    n = int(rng.integers(1, config.max_shapes + 1))
    pairs = [(k, c) for k in SHAPES for c in COLORS]
    picks = rng.choice(len(pairs), size=n, replace=False)
    shapes = []
    for i in picks:
        kind, color = pairs[int(i)]
        size = float(rng.uniform(config.min_size, config.max_size))
        x0 = float(rng.uniform(size, config.width - size))
        y0 = float(rng.uniform(size, config.height - size))
        speed = float(rng.uniform(config.min_speed, config.max_speed))
        angle = float(rng.uniform(0, 2 * np.pi))
        shapes.append(Shape(kind, color, size, x0, y0, speed * np.cos(angle), speed * np.sin(angle)))
    background = list(BACKGROUNDS)[int(rng.integers(len(BACKGROUNDS)))]
    return Scene(tuple(shapes), background, config)


PROMPT_SIZES: Mapping[str, float] = MappingProxyType({"circle": 8.0, "square": 7.0, "triangle": 9.0})
"""Sizes of :func:`prompt_layout` (radius, half side, circumradius in pixels at 64 x 64; read-only): the
shipped demo weights' (``train-demo --prompt-sizes`` trains on another table; a square of half side 9 was
measured and not shipped, docs/demo_model.md "Why the kinds blur, and bigger squares")."""

PROMPT_SPEED = 0.3
"""Speed of :func:`prompt_layout` in pixels per frame (at 64 x 64; scaled with the frame size). The
demo model ships trained at 0.3 (weights before 2026-12-06: 1.5, an object 18 px per block, too far for
the stream's first levels to extrapolate; docs/demo_model.md "Slower motion")."""


def check_speed(speed: object, name: str) -> float:
    """``speed`` (pixels per frame) as a float if it is a finite number > 0 (not a bool), else ``ValueError``
    naming it as ``name``: the one check of every prompt-layout speed (layout, clips, training, benches)."""
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0 (pixels/frame), got {speed!r}")
    return float(speed)


def check_sizes(sizes: object, name: str) -> dict[str, float]:
    """``sizes`` as a ``{kind: pixels}`` dict if it is a mapping with exactly the keys :data:`SHAPES`, each a
    finite number in (0, 16] (pixels at 64 x 64: at most a quarter of the frame, as :class:`SceneConfig`),
    else ``ValueError`` naming it as ``name``: the one check of every prompt-layout size table."""
    if not isinstance(sizes, Mapping) or set(sizes) != set(SHAPES):
        got = sorted(map(str, sizes)) if isinstance(sizes, Mapping) else repr(sizes)
        raise ValueError(f"{name} must give a size for each of {', '.join(SHAPES)} (no other key), got {got}")
    out = {}
    for kind in SHAPES:
        v = sizes[kind]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 16:
            raise ValueError(
                f"{name}: the {kind}'s size must be a finite number in (0, 16] (pixels), got {v!r}"
            )
        out[kind] = float(v)
    return out


def format_sizes(sizes: Mapping[str, float]) -> str:
    """A size table as a command line spells it, ``"circle=8,square=7,triangle=9"`` (what
    :func:`parse_sizes` reads back)."""
    return ",".join(f"{k}={v:g}" for k, v in sizes.items())


def parse_sizes(text: str, name: str) -> dict[str, float]:
    """``"circle=8,square=9,triangle=9"`` -> ``{kind: pixels}`` (each kind once, :func:`check_sizes`), else
    ``ValueError`` naming it as ``name`` (a command-line option's spelling of a size table)."""
    sizes: dict[str, float] = {}
    for part in text.split(","):
        kind, eq, value = part.strip().partition("=")
        try:
            if not eq or kind in sizes:
                raise ValueError
            sizes[kind] = float(value)
        except ValueError:
            form = ",".join(f"{k}=PIXELS" for k in SHAPES)
            raise ValueError(f"{name} must be {form} (each kind once), got {text!r}") from None
    return check_sizes(sizes, name)


def prompt_layout(
    scene: Scene, speed: float | None = None, sizes: Mapping[str, float] | None = None
) -> Scene:
    """The same objects and background with sizes, start points and velocities that are a pure function of
    the prompt (each shape's kind, colour and index), so that a prompt names exactly one video.

    Shape ``i`` of ``n`` starts at ``x = W (i + 1) / (n + 1)``, ``y = H * (0.35, 0.65)[i % 2]``, has the size
    :data:`PROMPT_SIZES` of its kind and moves at :data:`PROMPT_SPEED` in a direction set by its
    (colour, kind) pair: ``angle = 2 pi (3 c + k + 0.5) / (3 len(COLORS))`` (c, k: indices in
    :data:`COLORS` and :data:`SHAPES`). Sizes and speed scale with ``min(H, W) / 64``. ``speed``: pixels per
    frame at 64 x 64 instead of :data:`PROMPT_SPEED` (a finite float > 0); ``sizes``: a size per kind at
    64 x 64 instead of :data:`PROMPT_SIZES` (:func:`check_sizes`).
    """
    base = PROMPT_SPEED if speed is None else check_speed(speed, "prompt_layout: speed")
    table = PROMPT_SIZES if sizes is None else check_sizes(sizes, "prompt_layout: sizes")
    cfg = scene.config
    n = len(scene.shapes)
    unit = min(cfg.height, cfg.width) / 64.0
    colors = list(COLORS)
    shapes = []
    for i, s in enumerate(scene.shapes):
        size = table[s.kind] * unit
        x0 = min(max(cfg.width * (i + 1) / (n + 1), size), cfg.width - size)
        y0 = min(max(cfg.height * (0.35, 0.65)[i % 2], size), cfg.height - size)
        pair = 3 * colors.index(s.color) + SHAPES.index(s.kind)
        angle = 2 * np.pi * (pair + 0.5) / (3 * len(colors))
        v = base * unit
        shapes.append(
            Shape(s.kind, s.color, size, x0, y0, float(v * np.cos(angle)), float(v * np.sin(angle)))
        )
    return Scene(tuple(shapes), scene.background, cfg)


def _bounce(p0: float, v: float, lo: float, hi: float, t: np.ndarray) -> np.ndarray:
    """Position at frames ``t`` of a point starting at ``p0`` with velocity ``v`` reflected by walls at
    ``lo`` and ``hi``: a triangle wave of period ``2 (hi - lo)`` (closed form, any ``t``)."""
    span = hi - lo
    if span <= 0:
        return np.full(t.shape, lo, dtype=np.float64)
    u = np.mod(p0 - lo + v * t, 2 * span)
    return lo + np.where(u <= span, u, 2 * span - u)


def positions(scene: Scene, frames: np.ndarray | list[int] | range) -> np.ndarray:
    """Shape centres ``[len(frames), n_shapes, 2]`` (x, y) at the given frame indices (any, also huge)."""
    t = np.asarray(list(frames) if isinstance(frames, range) else frames, dtype=np.float64)
    cfg = scene.config
    out = np.empty((t.shape[0], len(scene.shapes), 2))
    for j, s in enumerate(scene.shapes):
        out[:, j, 0] = _bounce(s.x0, s.vx, s.size, cfg.width - s.size, t)
        out[:, j, 1] = _bounce(s.y0, s.vy, s.size, cfg.height - s.size, t)
    return out


def _mask(kind: str, size: float, cx: float, cy: float, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    dx, dy = xs - cx, ys - cy
    if kind == "circle":
        return dx * dx + dy * dy <= size * size
    if kind == "square":
        return (np.abs(dx) <= size) & (np.abs(dy) <= size)
    # upward triangle inscribed in the circle of radius size: apex (0, -size), base at y = size / 2
    half = np.sqrt(3.0) / 2 * size
    below_apex = dy >= -size
    above_base = dy <= size / 2
    inside_sides = np.abs(dx) <= (dy + size) * half / (1.5 * size)  # half-width grows linearly to the base
    return below_apex & above_base & inside_sides


def render(scene: Scene, start: int, count: int) -> np.ndarray:
    """Frames ``start .. start + count - 1`` as uint8 ``[count, H, W, 3]`` (pixel centres at ``i + 0.5``)."""
    if start < 0 or count < 0:
        raise ValueError(f"render: start and count must be >= 0, got {start}, {count}")
    cfg = scene.config
    ys, xs = np.mgrid[0 : cfg.height, 0 : cfg.width].astype(np.float64) + 0.5
    frames = np.empty((count, cfg.height, cfg.width, 3), dtype=np.uint8)
    frames[:] = BACKGROUNDS[scene.background]
    pos = positions(scene, range(start, start + count))
    for i in range(count):
        for j, s in enumerate(scene.shapes):
            m = _mask(s.kind, s.size, pos[i, j, 0], pos[i, j, 1], xs, ys)
            frames[i][m] = COLORS[s.color]
    return frames


def scene_prompt(scene: Scene) -> str:
    """The scene's prompt: ``"a red circle and a blue square bouncing on a gray background"``."""
    things = " and ".join(f"a {s.color} {s.kind}" for s in scene.shapes)
    return f"{things} bouncing on a {scene.background} background"


def prompt_words(text: str) -> list[str]:
    """The prompt's words (lower-cased); raises ``ValueError`` naming the first unknown word and listing the
    vocabulary (the demo model's text encoder knows only these)."""
    words = re.findall(r"[a-z]+", text.lower())
    if not words:
        raise ValueError(f"prompt {text!r} has no words; vocabulary: {', '.join(vocabulary())}")
    known = set(vocabulary())
    for w in words:
        if w not in known:
            raise ValueError(f"prompt word {w!r} is not in the vocabulary: {', '.join(vocabulary())}")
    return words
