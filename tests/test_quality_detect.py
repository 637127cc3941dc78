"""perf/quality/detect.py: the shape detector against the procedural generator's ground truth (clean and
degraded renders), its connected components against a breadth-first search, and its input checks."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from perf.quality.detect import (
    DetectorConfig,
    blur,
    degrade,
    detect,
    label_components,
    read_backgrounds,
    score_against_truth,
    touching_same_color,
    visible_fractions,
)
from rolling_forcing.procedural import Scene, SceneConfig, Shape, render, sample_scene

SCENES = [sample_scene(np.random.default_rng(100 + i)) for i in range(16)]
FRAMES = 24


def _bfs_components(cls: np.ndarray) -> np.ndarray:
    """Independent reference: breadth-first search, labels = smallest flat index of the component."""
    t, h, w = cls.shape
    lab = np.full(cls.shape, -1, dtype=np.int64)
    for f in range(t):
        for y in range(h):
            for x in range(w):
                if cls[f, y, x] < 0 or lab[f, y, x] >= 0:
                    continue
                root = (f * h + y) * w + x  # row-major first pixel reached = smallest index
                lab[f, y, x] = root
                q = deque([(y, x)])
                while q:
                    cy, cx = q.popleft()
                    for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                        inside = 0 <= ny < h and 0 <= nx < w
                        if inside and lab[f, ny, nx] < 0 and cls[f, ny, nx] == cls[f, y, x]:
                            lab[f, ny, nx] = root
                            q.append((ny, nx))
    return lab


def test_components_match_a_breadth_first_search() -> None:
    rng = np.random.default_rng(0)
    cls = rng.integers(-1, 3, size=(3, 17, 23)).astype(np.int8)
    cls[1, 2:9, 3:15] = 2  # one big blob next to random speckle
    cls[2] = -1
    np.testing.assert_array_equal(label_components(cls), _bfs_components(cls))


def test_known_shapes_are_read_exactly() -> None:
    # shapes at rest (zero velocity) far apart: kinds, colours and centres are known in closed form
    shapes = (
        Shape("square", "red", 6.0, 14.0, 14.0, 0.0, 0.0),
        Shape("circle", "green", 7.0, 46.0, 18.0, 0.0, 0.0),
        Shape("triangle", "yellow", 9.0, 30.0, 46.0, 0.0, 0.0),
    )
    frames = render(Scene(shapes, "navy"), 0, 1)
    dets = sorted(detect(frames)[0], key=lambda d: d.color)
    kinds = [(d.color, d.kind) for d in dets]
    assert kinds == [("green", "circle"), ("red", "square"), ("yellow", "triangle")]
    for d, s in zip(dets, (shapes[1], shapes[0], shapes[2])):
        # a pixelated shape's centroid differs from its exact centre by < 0.5 px (triangle: rows of
        # quantised width); the square covers 12 x 12 pixel centres exactly
        assert abs(d.x - s.x0) < 0.5 and abs(d.y - s.y0) < 0.5, (d, s)
    assert dets[1].area == 144 and dets[1].fill == 1.0
    assert dets[2].skew < -0.4  # the triangle's rows: a linear density, skewness -0.566 in the continuum


def test_clean_renders_against_ground_truth() -> None:
    # the thresholds were set on scenes of seeds 0-59; these (seeds 100-115) are held out. Measured here:
    # see the assertion message; over seeds 0-39 x 48 frames 0.9997. Floor 0.98
    dets = [detect(render(s, 0, FRAMES)) for s in SCENES]
    score = score_against_truth(SCENES, dets, 0)
    assert score.shapes > 500
    assert score.accuracy >= 0.98, score
    assert score.color_accuracy == 1.0, score
    assert score.mean_error < 0.5 and score.spurious == 0, score


def test_degraded_renders_against_ground_truth() -> None:
    # decoder-like blur (sigma 1 px) + noise (std 10): measured 0.995 over seeds 0-39 x 48 frames; floor 0.97
    frames = [degrade(render(s, 0, FRAMES), sigma=1.0, noise=10.0, seed=i) for i, s in enumerate(SCENES)]
    dets = [detect(f) for f in frames]
    score = score_against_truth(SCENES, dets, 0)
    assert score.accuracy >= 0.97, score
    assert score.color_accuracy >= 0.98, score
    assert score.mean_error < 0.6 and score.spurious == 0, score


def test_scoring_sees_a_wrong_kind_and_a_moved_object() -> None:
    scene = Scene(
        (
            Shape("square", "red", 6.0, 14.0, 14.0, 1.0, 0.5),
            Shape("triangle", "white", 9.0, 30.0, 46.0, -1.0, 0.0),
        ),
        "gray",
    )
    dets = detect(render(scene, 0, 4))
    good = score_against_truth([scene], [dets], 0)
    assert good.found == good.shapes
    from dataclasses import replace

    other = {"circle": "square", "square": "triangle", "triangle": "circle"}
    wrong = [[replace(d, kind=other[d.kind]) for d in fr] for fr in dets]
    assert score_against_truth([scene], [wrong], 0).found == 0
    moved = [[replace(d, x=d.x + 3.0) for d in fr] for fr in dets]
    assert score_against_truth([scene], [moved], 0).color_found == 0


def test_occlusion_and_same_colour_contact_are_computed() -> None:
    cfg = SceneConfig()
    a = Shape("square", "red", 8.0, 20.0, 20.0, 0.0, 0.0)
    b = Shape("circle", "blue", 8.0, 28.0, 20.0, 0.0, 0.0)  # drawn on top, covers the square's right part
    c = Shape("circle", "red", 6.0, 50.0, 50.0, 0.0, 0.0)
    vis = visible_fractions(Scene((a, b, c), "black", cfg), 0, 1)[0]
    assert vis[1] == 1.0 and vis[2] == 1.0 and 0.4 < vis[0] < 0.9
    near = Shape("circle", "red", 6.0, 34.0, 20.0, 0.0, 0.0)  # touches the red square
    assert touching_same_color(Scene((a, near), "black", cfg), 0, 1)[0].tolist() == [True, True]
    assert touching_same_color(Scene((a, c), "black", cfg), 0, 1)[0].tolist() == [False, False]


def test_blur_keeps_a_flat_image_and_the_mean() -> None:
    flat = np.full((2, 16, 16, 3), 77, dtype=np.uint8)
    np.testing.assert_array_equal(blur(flat, 1.3), flat)
    img = render(SCENES[1], 0, 1)
    b = blur(img, 1.0)
    # edge replication and rounding move the mean by well under one grey level
    assert abs(float(b.mean()) - float(img.mean())) < 1.0


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="uint8"):
        detect(np.zeros((1, 8, 8, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"\[T, H, W, 3\]"):
        detect(np.zeros((8, 8, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="max_distance"):
        DetectorConfig(max_distance=0)
    with pytest.raises(ValueError, match="sigma"):
        blur(np.zeros((1, 8, 8, 3), dtype=np.uint8), 0.0)


def test_backgrounds_are_read() -> None:
    frames = render(SCENES[2], 0, 2)
    assert read_backgrounds(frames) == [SCENES[2].background] * 2
    mosaic = np.random.default_rng(0).integers(0, 256, size=(1, 64, 64, 3), dtype=np.uint8)
    assert read_backgrounds(mosaic) == [None]  # no background colour covers 30 % of random pixels
