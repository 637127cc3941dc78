"""Procedural demo scenes (rolling_forcing/procedural.py): determinism, closed-form bouncing against a
step-by-step simulation, rendering, prompts and the vocabulary."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from rolling_forcing.procedural import (
    BACKGROUNDS,
    COLORS,
    Scene,
    SceneConfig,
    Shape,
    positions,
    prompt_words,
    render,
    sample_scene,
    scene_prompt,
    vocabulary,
)


def _simulate(s: Shape, cfg: SceneConfig, n: int) -> np.ndarray:
    """Step-by-step reference: move, reflect off each wall (independent of the closed form)."""
    x, y, vx, vy = s.x0, s.y0, s.vx, s.vy
    out = []
    for _ in range(n):
        out.append((x, y))
        x, y = x + vx, y + vy
        for lo, hi, axis in ((s.size, cfg.width - s.size, 0), (s.size, cfg.height - s.size, 1)):
            p = x if axis == 0 else y
            if p > hi:
                p, flip = 2 * hi - p, True
            elif p < lo:
                p, flip = 2 * lo - p, True
            else:
                flip = False
            if axis == 0:
                x, vx = p, (-vx if flip else vx)
            else:
                y, vy = p, (-vy if flip else vy)
    return np.array(out)


def test_closed_form_bouncing_matches_a_simulation() -> None:
    cfg = SceneConfig()
    scene = sample_scene(np.random.default_rng(3), cfg)
    pos = positions(scene, range(500))
    for j, s in enumerate(scene.shapes):
        np.testing.assert_allclose(pos[:, j], _simulate(s, cfg, 500), atol=1e-9)


def test_unbounded_and_random_access() -> None:
    scene = sample_scene(np.random.default_rng(0))
    far = positions(scene, [10**9, 10**9 + 1])
    cfg = scene.config
    for j, s in enumerate(scene.shapes):
        assert s.size - 1e-6 <= far[0, j, 0] <= cfg.width - s.size + 1e-6
        assert s.size - 1e-6 <= far[0, j, 1] <= cfg.height - s.size + 1e-6
        assert (
            math.hypot(*(far[1, j] - far[0, j])) <= math.hypot(s.vx, s.vy) + 1e-6
        )  # one step, or less at a wall
    np.testing.assert_array_equal(
        render(scene, 40, 3), render(scene, 38, 5)[2:]
    )  # a stream can start anywhere


def test_same_seed_same_scene_and_frames() -> None:
    a, b = (sample_scene(np.random.default_rng(7)) for _ in range(2))
    assert a == b
    np.testing.assert_array_equal(render(a, 0, 4), render(b, 0, 4))
    assert sample_scene(np.random.default_rng(8)) != a


def test_render_draws_each_shape_in_its_colour() -> None:
    cfg = SceneConfig(height=64, width=96)
    shapes = (
        Shape("circle", "red", 8.0, 20.0, 20.0, 0.0, 0.0),
        Shape("square", "blue", 8.0, 60.0, 20.0, 0.0, 0.0),
        Shape("triangle", "yellow", 10.0, 40.0, 48.0, 0.0, 0.0),
    )
    f = render(Scene(shapes, "gray", cfg), 0, 1)[0]
    assert f.shape == (64, 96, 3) and f.dtype == np.uint8
    for s in shapes:
        assert tuple(f[int(s.y0), int(s.x0)]) == COLORS[s.color]
    assert tuple(f[0, 0]) == BACKGROUNDS["gray"]
    # areas: circle pi r^2, square (2r)^2, triangle (3 sqrt(3) / 4) R^2, to within the pixel grid
    for s, area in zip(shapes, (math.pi * 64, 256.0, 3 * math.sqrt(3) / 4 * 100), strict=True):
        n = int((f == COLORS[s.color]).all(axis=-1).sum())
        assert abs(n - area) <= 0.12 * area, (s.kind, n, area)


def test_prompt_names_every_shape_and_uses_the_vocabulary() -> None:
    scene = sample_scene(np.random.default_rng(11), SceneConfig(max_shapes=3))
    text = scene_prompt(scene)
    for s in scene.shapes:
        assert f"a {s.color} {s.kind}" in text
    assert text.endswith(f"bouncing on a {scene.background} background")
    assert set(prompt_words(text)) <= set(vocabulary())
    with pytest.raises(ValueError, match="'dragon' is not in the vocabulary: a, and, background"):
        prompt_words("a red dragon")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"height": 8}, "height and width must be >= 16"),
        ({"max_shapes": 4}, r"max_shapes must be in \[1, 3\]"),
        ({"max_size": 40.0}, "max_size <= min"),
        ({"min_speed": 0.0}, "0 < min_speed"),
    ],
)
def test_config_rejects_bad_values(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SceneConfig(**kw)


def test_scene_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="Shape.kind must be one of"):
        Shape("star", "red", 5, 10, 10, 0, 0)
    with pytest.raises(ValueError, match="outside its walls"):
        Scene((Shape("circle", "red", 8, 2, 30, 0, 0),), "black")


def test_prompt_layout_is_a_function_of_the_prompt() -> None:
    """Two scenes with the same prompt get the same layout; the layout follows the documented formula
    (written out here independently) and keeps every shape inside its walls."""
    from rolling_forcing.procedural import COLORS, SHAPES, Scene, Shape, prompt_layout

    a = Scene(
        (
            Shape("circle", "red", 5.0, 20.0, 20.0, 2.0, 0.1),
            Shape("square", "blue", 9.0, 40.0, 30.0, -1.0, 1.0),
        ),
        "gray",
    )
    b = Scene(
        (
            Shape("circle", "red", 10.0, 50.0, 50.0, -0.3, 2.2),
            Shape("square", "blue", 6.0, 12.0, 40.0, 0.5, 0.5),
        ),
        "gray",
    )
    la, lb = prompt_layout(a), prompt_layout(b)
    assert la == lb
    assert scene_prompt(la) == scene_prompt(a)
    for i, s in enumerate(la.shapes):
        k = list(COLORS).index(s.color) * 3 + SHAPES.index(s.kind)
        angle = 2 * math.pi * (k + 0.5) / (3 * len(COLORS))
        assert s.x0 == pytest.approx(64 * (i + 1) / 3)
        assert s.y0 == pytest.approx(64 * (0.35, 0.65)[i % 2])
        assert (s.vx, s.vy) == pytest.approx((0.3 * math.cos(angle), 0.3 * math.sin(angle)))
    frames = render(la, 0, 40)
    assert frames.shape == (40, 64, 64, 3)
    # a different shape in the prompt moves differently
    c = Scene((Shape("triangle", "red", 5.0, 20.0, 20.0, 2.0, 0.1), a.shapes[1]), "gray")
    assert prompt_layout(c).shapes[0].vx != la.shapes[0].vx


def test_prompt_layout_speed_sets_only_the_velocity_magnitude() -> None:
    """``speed`` scales every velocity to ``speed x min(H, W) / 64`` along the same direction; start points
    and sizes are those of the default layout; bad speeds are refused; clips follow it
    (prompt layout only)."""
    from rolling_forcing.demo.data import make_clips
    from rolling_forcing.procedural import PROMPT_SPEED, Scene, SceneConfig, Shape, prompt_layout

    cfg = SceneConfig(height=96, width=128)
    a = Scene(
        (
            Shape("circle", "red", 5.0, 20.0, 20.0, 2.0, 0.1),
            Shape("triangle", "white", 9.0, 40.0, 30.0, -1.0, 1.0),
        ),
        "navy",
        cfg,
    )
    base, slow = prompt_layout(a), prompt_layout(a, 0.3)
    assert base == prompt_layout(a, PROMPT_SPEED)
    for s0, s1 in zip(base.shapes, slow.shapes):
        assert (s1.x0, s1.y0, s1.size, s1.kind, s1.color) == (s0.x0, s0.y0, s0.size, s0.kind, s0.color)
        assert math.hypot(s1.vx, s1.vy) == pytest.approx(0.3 * 96 / 64)
        assert math.hypot(s0.vx, s0.vy) == pytest.approx(PROMPT_SPEED * 96 / 64)
        assert math.atan2(s1.vy, s1.vx) == pytest.approx(math.atan2(s0.vy, s0.vx))
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="speed must be a finite number > 0"):
            prompt_layout(a, bad)
    _, _, scenes = make_clips(2, 5, seed=3, layout="prompt", prompt_speed=0.3)
    assert all(math.hypot(s.vx, s.vy) == pytest.approx(0.3) for sc in scenes for s in sc.shapes)
    with pytest.raises(ValueError, match="prompt_speed applies to layout='prompt' only"):
        make_clips(1, 5, seed=3, prompt_speed=0.3)


def test_prompt_layout_sizes_set_only_the_sizes() -> None:
    """``sizes`` gives each kind its size (scaled with ``min(H, W) / 64``); velocities are the default
    layout's and start points move only where a bigger shape must stay inside its walls; the default is
    :data:`PROMPT_SIZES` (read-only); the rendered square has the pixel area of its half side; bad tables
    are refused naming the rule; clips follow the table (prompt layout only)."""
    from rolling_forcing.demo.data import make_clips
    from rolling_forcing.procedural import PROMPT_SIZES, Scene, SceneConfig, Shape, check_sizes, prompt_layout

    cfg = SceneConfig(height=96, width=128)
    a = Scene(
        (
            Shape("square", "red", 5.0, 20.0, 20.0, 2.0, 0.1),
            Shape("circle", "white", 9.0, 40.0, 30.0, -1.0, 1.0),
        ),
        "navy",
        cfg,
    )
    table = {"circle": 6.0, "square": 10.5, "triangle": 4.0}
    base, big = prompt_layout(a), prompt_layout(a, sizes=table)
    assert base == prompt_layout(a, sizes=PROMPT_SIZES)
    for s0, s1 in zip(base.shapes, big.shapes):
        assert s0.size == PROMPT_SIZES[s0.kind] * 96 / 64 and s1.size == table[s1.kind] * 96 / 64
        assert (s1.vx, s1.vy, s1.kind, s1.color) == (s0.vx, s0.vy, s0.kind, s0.color)
        assert (s1.x0, s1.y0) == (
            min(max(s0.x0, s1.size), 128 - s1.size),
            min(max(s0.y0, s1.size), 96 - s1.size),
        )
    one = Scene((Shape("square", "blue", 5.0, 32.0, 32.0, 0.0, 0.0),), "black")
    for half in (7.0, 9.0):
        frame = render(prompt_layout(one, sizes={**table, "square": half}), 0, 1)[0]
        blue = (frame == np.array(COLORS["blue"], dtype=np.uint8)).all(axis=-1)
        assert int(blue.sum()) in range(int(2 * half) ** 2, (int(2 * half) + 2) ** 2)  # pixel centres inside
    with pytest.raises(TypeError):
        PROMPT_SIZES["square"] = 7.0  # type: ignore[index]
    bad_tables: list[object] = [
        {"circle": 8.0, "square": 9.0},
        {**table, "hexagon": 3.0},
        {**table, "square": 0.0},
        {**table, "square": 16.5},
        {**table, "square": float("nan")},
        {**table, "square": True},
        "circle=8",
    ]
    for bad in bad_tables:
        with pytest.raises(ValueError, match="sizes"):
            prompt_layout(a, sizes=bad)  # type: ignore[arg-type]
    assert check_sizes({**table, "square": 16}, "t") == {**table, "square": 16.0}
    _, _, scenes = make_clips(3, 5, seed=3, layout="prompt", prompt_sizes=table)
    assert all(s.size == table[s.kind] for sc in scenes for s in sc.shapes)
    with pytest.raises(ValueError, match="prompt_sizes applies to layout='prompt' only"):
        make_clips(1, 5, seed=3, prompt_sizes=table)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("circle=8,square=9", "must give a size for each of circle, square, triangle"),
        ("circle=8,square=9,triangle=9,hexagon=2", "must give a size for each of circle, square, triangle"),
        ("circle=8,square=nine,triangle=9", "must be circle=PIXELS,square=PIXELS,triangle=PIXELS"),
        ("circle=8,circle=8,square=9,triangle=9", "(each kind once)"),
        ("circle 8,square=9,triangle=9", "must be circle=PIXELS"),
        ("circle=8,square=17,triangle=9", "the square's size must be a finite number in (0, 16]"),
    ],
)
def test_parse_sizes_refuses_with_the_rule(text: str, message: str) -> None:
    from rolling_forcing.procedural import parse_sizes

    with pytest.raises(ValueError, match=re.escape(message)):
        parse_sizes(text, "--prompt-sizes")


def test_parse_sizes_reads_every_kind() -> None:
    """``parse_sizes`` reads any order and spacing, and reads back what ``format_sizes`` writes."""
    from rolling_forcing.procedural import PROMPT_SIZES, format_sizes, parse_sizes

    assert parse_sizes(" square=7, circle=8 ,triangle=9.5", "x") == {
        "circle": 8.0,
        "square": 7.0,
        "triangle": 9.5,
    }
    assert parse_sizes(format_sizes(PROMPT_SIZES), "x") == dict(PROMPT_SIZES)
    assert format_sizes({"circle": 8.0, "square": 8.5, "triangle": 9.0}) == "circle=8,square=8.5,triangle=9"
