"""Read the procedural scenes' shapes back from decoded frames: colour, kind, centroid and area.

Frames are uint8 ``[T, H, W, 3]`` (RGB), e.g. a decoded stream (``rolling_forcing.decode.to_uint8_frames``)
or ``rolling_forcing.procedural.render``. Per pixel the nearest colour of the palette (the shape colours
:data:`~rolling_forcing.procedural.COLORS` and the backgrounds
:data:`~rolling_forcing.procedural.BACKGROUNDS`) is found; a pixel belongs to shape colour ``c`` when ``c``
is its nearest palette colour within ``max_distance`` (Euclidean RGB). Pixels of one colour are grouped
into 4-connected components (a vectorised min-label propagation with pointer jumping over all frames at
once; no scipy). Each component large enough (``min_area``, ``min_side``: the blurred seams between two
shapes, whose mixed colour can land near a third palette colour, are thin and small) becomes a
:class:`Detection` with its centroid (pixel centres at ``i + 0.5``, the generator's convention), area and
kind:

* the skewness of the rows' distribution, ``E[(y - ȳ)^3] / E[(y - ȳ)^2]^1.5`` (y downwards): the
  generator's upward triangle widens linearly towards its base, a linear density whose skewness is
  -2 sqrt(2) / 5 = -0.566, while circles and squares are symmetric (0). A blur that eats the apex moves it
  towards 0 but keeps it well apart (measured: below -0.2 in 99.5 % of triangle-frames at blur sigma 1 px
  + noise 10, above -0.1 for circles and squares);
* circle vs square: the fill ratio ``area / bbox area`` (1 for an axis-aligned square, pi/4 = 0.785 for a
  circle) and the spread ``area / d95^2`` (``d95``: the 95th percentile of the pixels' distances from the
  centroid; a disc's is ``r sqrt(0.95)``, so pi / 0.95 = 3.3, a square's 2.9) pull in opposite directions
  under blur (a blur rounds a square's corners: its fill drops, its spread rises), so their difference
  ``roundness = spread / 2 - fill`` separates the two better than either (measured balanced accuracy
  between circles and squares: 1.0 clean, 0.996 at blur sigma 1 px + noise 10, 0.97 at sigma 1.5 + noise
  16, against 0.94 and 0.88 for the fill ratio alone).

Kind rule: ``triangle`` if the skewness is below ``-triangle_skew`` (0.18); else ``circle`` if the
roundness is at least ``circle_roundness`` (0.75); else ``square``. The thresholds were chosen on
synthetic degradations (seeds 0-59) and on the demo autoencoder's reconstructions (seeds 3000-3023), where
a real decoder's blur moves the optimum from 0.78 / 0.2 to 0.75 / 0.18 at no cost on the synthetic ones.
Accuracy against the generator's ground truth (clean and degraded renders) is measured by
:func:`score_against_truth` (``tests/test_quality_detect.py``, docs/quality.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rolling_forcing.procedural import BACKGROUNDS, COLORS, Scene, positions, render

__all__ = [
    "Detection",
    "DetectorConfig",
    "TruthScore",
    "blur",
    "classify_pixels",
    "degrade",
    "detect",
    "label_components",
    "read_backgrounds",
    "score_against_truth",
    "touching_same_color",
    "visible_fractions",
]

_SHAPE_COLORS = tuple(COLORS)
_PALETTE = np.array([*COLORS.values(), *BACKGROUNDS.values()], dtype=np.float32)  # [P, 3]


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds of the detector (pixels, RGB units, ratios); see the module docstring for the rule.

    ``max_distance`` > 0; ``min_area`` >= 1; ``min_side`` >= 1; ``circle_roundness`` finite;
    ``triangle_skew`` > 0; ``batch_frames`` >= 1 (frames labelled at once: bounds the memory).
    """

    max_distance: float = 90.0
    min_area: int = 12
    min_side: int = 4
    circle_roundness: float = 0.75
    triangle_skew: float = 0.18
    batch_frames: int = 256

    def __post_init__(self) -> None:
        if not self.max_distance > 0:
            raise ValueError(f"DetectorConfig.max_distance must be > 0, got {self.max_distance}")
        if self.min_area < 1 or self.min_side < 1:
            raise ValueError(
                f"DetectorConfig.min_area and min_side must be >= 1, got {self.min_area}, {self.min_side}"
            )
        if not np.isfinite(self.circle_roundness):
            raise ValueError(f"DetectorConfig.circle_roundness must be finite, got {self.circle_roundness}")
        if not self.triangle_skew > 0:
            raise ValueError(f"DetectorConfig.triangle_skew must be > 0, got {self.triangle_skew}")
        if self.batch_frames < 1:
            raise ValueError(f"DetectorConfig.batch_frames must be >= 1, got {self.batch_frames}")


@dataclass(frozen=True)
class Detection:
    """One detected shape: ``frame`` index, ``color`` (a key of COLORS), ``kind`` (circle / square /
    triangle), centroid ``(x, y)`` in pixels (pixel centres at ``i + 0.5``), ``area`` in pixels, ``fill``
    (area over bounding-box area), ``skew`` (skewness of the pixels' rows; 0 for a single row) and ``spread``
    (area over the squared 95th-percentile distance of its pixels from the centroid); ``contact``: the
    other shape colours that come within 2 px of it (an overlap: one of the two may be partly hidden, its
    kind unreadable)."""

    frame: int
    color: str
    kind: str
    x: float
    y: float
    area: int
    fill: float
    skew: float
    spread: float
    contact: tuple[str, ...] = ()


def _check_frames(frames: np.ndarray) -> None:
    if not isinstance(frames, np.ndarray) or frames.ndim != 4 or frames.shape[-1] != 3:
        got = frames.shape if isinstance(frames, np.ndarray) else type(frames).__name__
        raise ValueError(f"frames must be a numpy array [T, H, W, 3], got {got}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (RGB 0..255), got dtype {frames.dtype}")


def classify_pixels(frames: np.ndarray, max_distance: float = DetectorConfig.max_distance) -> np.ndarray:
    """Per pixel the index into ``tuple(COLORS)`` of its shape colour, or -1 (background / no colour within
    ``max_distance`` / nearest to a background colour). ``frames`` uint8 ``[T, H, W, 3]`` -> int8
    ``[T, H, W]``."""
    _check_frames(frames)
    px = frames.astype(np.float32)
    d2 = ((px[..., None, :] - _PALETTE) ** 2).sum(-1)  # [T, H, W, P]
    near = d2.argmin(-1)
    dist2 = np.take_along_axis(d2, near[..., None], -1)[..., 0]
    ok = (near < len(_SHAPE_COLORS)) & (dist2 <= max_distance**2)
    return np.where(ok, near, -1).astype(np.int8)


def label_components(cls: np.ndarray) -> np.ndarray:
    """4-connected components of equal non-negative class per frame: ``cls`` int ``[T, H, W]`` (-1 = none)
    -> int64 labels ``[T, H, W]``: -1 outside, else the smallest flat index (into ``cls``) of the
    component's pixels (components never cross frames)."""
    if cls.ndim != 3:
        raise ValueError(f"cls must be [T, H, W], got shape {cls.shape}")
    n = cls.size
    valid = cls >= 0
    lab = np.where(valid, np.arange(n, dtype=np.int64).reshape(cls.shape), n)
    # neighbour pairs of equal class, along H and along W
    same_h = valid[:, 1:, :] & (cls[:, 1:, :] == cls[:, :-1, :])
    same_w = valid[:, :, 1:] & (cls[:, :, 1:] == cls[:, :, :-1])
    while True:
        new = lab.copy()
        down = np.where(same_h, np.minimum(new[:, 1:, :], new[:, :-1, :]), n)
        new[:, 1:, :] = np.minimum(new[:, 1:, :], down)
        new[:, :-1, :] = np.minimum(new[:, :-1, :], down)
        right = np.where(same_w, np.minimum(new[:, :, 1:], new[:, :, :-1]), n)
        new[:, :, 1:] = np.minimum(new[:, :, 1:], right)
        new[:, :, :-1] = np.minimum(new[:, :, :-1], right)
        flat = new.reshape(-1)
        for _ in range(4):  # pointer jumping: a label is a pixel of the same component, follow it
            flat[valid.reshape(-1)] = flat[flat[valid.reshape(-1)]]
        if np.array_equal(new, lab):
            break
        lab = new
    return np.where(valid, lab, -1)


def _kind(fill: float, skew: float, spread: float, cfg: DetectorConfig) -> str:
    if skew < -cfg.triangle_skew:
        return "triangle"
    return "circle" if spread / 2 - fill >= cfg.circle_roundness else "square"


def _near(cls: np.ndarray, c: int, reach: int = 2) -> np.ndarray:
    """bool ``[T, H, W]``: a pixel of class ``c`` lies within ``reach`` px (Chebyshev)."""
    t, h, w = cls.shape
    pad = np.pad(cls == c, ((0, 0), (reach, reach), (reach, reach)))
    out = np.zeros(cls.shape, dtype=bool)
    for dy in range(2 * reach + 1):
        for dx in range(2 * reach + 1):
            out |= pad[:, dy : dy + h, dx : dx + w]
    return out


def _detect_batch(frames: np.ndarray, first: int, cfg: DetectorConfig) -> list[list[Detection]]:
    t, h, w = frames.shape[:3]
    cls = classify_pixels(frames, cfg.max_distance)
    lab = label_components(cls)
    out: list[list[Detection]] = [[] for _ in range(t)]
    sel = lab.reshape(-1) >= 0
    if not sel.any():
        return out
    flat_idx = np.nonzero(sel)[0]
    reps, inv = np.unique(lab.reshape(-1)[sel], return_inverse=True)
    ys = (flat_idx // w) % h
    xs = flat_idx % w
    area = np.bincount(inv)
    cx = np.bincount(inv, weights=xs) / area + 0.5
    cy = np.bincount(inv, weights=ys) / area + 0.5
    k = reps.size
    x0, y0 = np.full(k, w), np.full(k, h)
    x1, y1 = np.full(k, -1), np.full(k, -1)
    np.minimum.at(x0, inv, xs)
    np.minimum.at(y0, inv, ys)
    np.maximum.at(x1, inv, xs)
    np.maximum.at(y1, inv, ys)
    bw, bh = x1 - x0 + 1, y1 - y0 + 1
    fill = area / (bw * bh)
    dy = ys + 0.5 - cy[inv]
    m2 = np.bincount(inv, weights=dy**2) / area
    m3 = np.bincount(inv, weights=dy**3) / area
    skew = np.where(m2 > 0, m3 / np.maximum(m2, 1e-12) ** 1.5, 0.0)
    dist2 = (xs + 0.5 - cx[inv]) ** 2 + dy**2
    order = np.lexsort((dist2, inv))
    starts = np.concatenate([[0], np.cumsum(area)[:-1]])
    d95 = dist2[order][starts + np.floor(0.95 * (area - 1)).astype(np.int64)]
    spread = area / np.maximum(d95, 1e-9)
    own = cls.reshape(-1)[sel]
    touch = np.zeros((k, len(_SHAPE_COLORS)), dtype=bool)
    for c in np.unique(own):
        near_c = _near(cls, int(c)).reshape(-1)[sel] & (own != c)
        touch[:, c] = np.bincount(inv, weights=near_c, minlength=k) > 0
    for i in range(k):
        if area[i] < cfg.min_area or min(bw[i], bh[i]) < cfg.min_side:
            continue
        f = int(reps[i] // (h * w))
        color = _SHAPE_COLORS[int(cls.reshape(-1)[reps[i]])]
        kind = _kind(float(fill[i]), float(skew[i]), float(spread[i]), cfg)
        near = tuple(_SHAPE_COLORS[c] for c in np.nonzero(touch[i])[0])
        out[f].append(
            Detection(first + f, color, kind, float(cx[i]), float(cy[i]), int(area[i]), float(fill[i]),
                      float(skew[i]), float(spread[i]), near)
        )  # fmt: skip
    for dets in out:
        dets.sort(key=lambda d: -d.area)
    return out


def read_backgrounds(
    frames: np.ndarray, config: DetectorConfig = DetectorConfig(), *, min_share: float = 0.3
) -> list[str | None]:
    """Per frame of uint8 ``[T, H, W, 3]``, the background (a key of BACKGROUNDS) whose colour is nearest
    (within ``max_distance``) to the most pixels, or None if no background colour holds at least
    ``min_share`` of the frame."""
    _check_frames(frames)
    out: list[str | None] = []
    names = list(BACKGROUNDS)
    bg = _PALETTE[len(_SHAPE_COLORS) :]
    for s in range(0, frames.shape[0], config.batch_frames):
        px = frames[s : s + config.batch_frames].astype(np.float32)
        d2 = ((px[..., None, :] - _PALETTE) ** 2).sum(-1)
        near = d2.argmin(-1)
        ok = np.take_along_axis(d2, near[..., None], -1)[..., 0] <= config.max_distance**2
        counts = np.stack(
            [((near == len(_SHAPE_COLORS) + b) & ok).sum(axis=(1, 2)) for b in range(len(bg))], 1
        )
        share = counts / (frames.shape[1] * frames.shape[2])
        best = share.argmax(1)
        out += [names[b] if share[i, b] >= min_share else None for i, b in enumerate(best)]
    return out


def detect(frames: np.ndarray, config: DetectorConfig = DetectorConfig()) -> list[list[Detection]]:
    """Shapes in each frame of uint8 ``[T, H, W, 3]``: a list per frame of :class:`Detection` (largest
    first). ``Detection.frame`` is the index into ``frames``."""
    _check_frames(frames)
    out: list[list[Detection]] = []
    for s in range(0, frames.shape[0], config.batch_frames):
        out.extend(_detect_batch(frames[s : s + config.batch_frames], s, config))
    return out


# ---- degradations and ground truth (the detector's own tests and the accuracy in docs/quality.md) --------


def blur(frames: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur (per channel, edge-replicated) of uint8 ``[T, H, W, 3]``; ``sigma`` > 0 in
    pixels; returns uint8 of the same shape."""
    _check_frames(frames)
    if not sigma > 0:
        raise ValueError(f"blur: sigma must be > 0, got {sigma}")
    r = int(np.ceil(3 * sigma))
    k = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    k /= k.sum()
    x = frames.astype(np.float64)
    for axis in (1, 2):
        pad = [(0, 0)] * 4
        pad[axis] = (r, r)
        xp = np.pad(x, pad, mode="edge")
        n = x.shape[axis]
        x = sum(k[i] * np.take(xp, np.arange(i, i + n), axis=axis) for i in range(2 * r + 1))
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def degrade(frames: np.ndarray, *, sigma: float, noise: float, seed: int = 0) -> np.ndarray:
    """A decoder-like degradation: :func:`blur` (``sigma`` px) then additive Gaussian noise of std ``noise``
    (RGB units, >= 0, seeded), clipped to uint8."""
    if noise < 0:
        raise ValueError(f"degrade: noise must be >= 0, got {noise}")
    x = blur(frames, sigma).astype(np.float64)
    x += np.random.default_rng(seed).normal(0.0, noise, size=x.shape)
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def _shape_masks(scene: Scene, start: int, count: int) -> list[np.ndarray]:
    bg = np.array(BACKGROUNDS[scene.background], dtype=np.uint8)
    alone = [Scene((s,), scene.background, scene.config) for s in scene.shapes]
    return [(render(one, start, count) != bg).any(-1) for one in alone]


def visible_fractions(scene: Scene, start: int, count: int) -> np.ndarray:
    """Fraction of each shape's pixels not covered by a later (drawn on top) shape: float ``[count,
    n_shapes]`` (1.0 = fully visible), from single-shape renders of the generator."""
    masks = _shape_masks(scene, start, count)
    out = np.ones((count, len(masks)))
    for j, m in enumerate(masks):
        cover = np.zeros_like(m)
        for later in masks[j + 1 :]:
            cover |= later
        own = m.sum(axis=(1, 2))
        out[:, j] = (m & ~cover).sum(axis=(1, 2)) / np.maximum(own, 1)
    return out


def touching_same_color(scene: Scene, start: int, count: int) -> np.ndarray:
    """bool ``[count, n_shapes]``: the shape overlaps or 4-touches another shape of the same colour (one
    connected blob of that colour: no colour detector can tell them apart)."""
    masks = _shape_masks(scene, start, count)
    out = np.zeros((count, len(masks)), dtype=bool)
    for j, m in enumerate(masks):
        grown = m.copy()
        grown[:, 1:] |= m[:, :-1]
        grown[:, :-1] |= m[:, 1:]
        grown[:, :, 1:] |= m[:, :, :-1]
        grown[:, :, :-1] |= m[:, :, 1:]
        for i, other in enumerate(masks):
            if i != j and scene.shapes[i].color == scene.shapes[j].color:
                out[:, j] |= (grown & other).any(axis=(1, 2))
    return out


@dataclass(frozen=True)
class TruthScore:
    """Detector accuracy against ground truth: ``shapes`` scored (shape-frames at least ``min_visible``
    visible and not touching a shape of the same colour), ``found`` (a detection of the right colour and
    kind within ``tolerance`` px of the true centre), ``color_found`` (right colour within tolerance, any
    kind), ``mean_error`` (px, over found), ``spurious`` (detections of a colour the scene does not have)."""

    shapes: int
    found: int
    color_found: int
    mean_error: float
    spurious: int

    @property
    def accuracy(self) -> float:
        return self.found / self.shapes if self.shapes else float("nan")

    @property
    def color_accuracy(self) -> float:
        return self.color_found / self.shapes if self.shapes else float("nan")


def score_against_truth(
    scenes: Sequence[Scene],
    detections: Sequence[Sequence[Sequence[Detection]]],
    start: int,
    *,
    tolerance: float = 2.0,
    min_visible: float = 0.9,
) -> TruthScore:
    """Score ``detections[i]`` (per frame, frames ``start ..``) of ``scenes[i]`` against
    :func:`~rolling_forcing.procedural.positions`; shapes less than ``min_visible`` visible (occluded by a
    later shape) or touching a shape of the same colour (:func:`touching_same_color`) are not scored."""
    if len(scenes) != len(detections):
        raise ValueError(f"scenes ({len(scenes)}) and detections ({len(detections)}) must pair up")
    shapes = found = color_found = spurious = 0
    errs: list[float] = []
    for scene, dets in zip(scenes, detections):
        count = len(dets)
        pos = positions(scene, range(start, start + count))
        vis = visible_fractions(scene, start, count)
        merged = touching_same_color(scene, start, count)
        colors = {s.color for s in scene.shapes}
        for f in range(count):
            spurious += sum(d.color not in colors for d in dets[f])
            for j, s in enumerate(scene.shapes):
                if vis[f, j] < min_visible or merged[f, j]:
                    continue
                shapes += 1
                tx, ty = pos[f, j]
                near = [
                    d for d in dets[f] if d.color == s.color and np.hypot(d.x - tx, d.y - ty) <= tolerance
                ]
                if near:
                    color_found += 1
                hits = [d for d in near if d.kind == s.kind]
                if hits:
                    found += 1
                    errs.append(min(float(np.hypot(d.x - tx, d.y - ty)) for d in hits))
    mean_error = float(np.mean(errs)) if errs else float("nan")
    return TruthScore(shapes, found, color_found, mean_error, spurious)
