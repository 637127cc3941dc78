"""perf/quality/metrics.py on synthetic detections with known answers, and end to end on the procedural
ground truth (detector + metrics meet every target on the generator's own frames)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from perf.quality.detect import detect, read_backgrounds
from perf.quality.metrics import (
    check,
    chunk_starts,
    continuity,
    drift,
    longest_vanish,
    presence,
    prompt_background,
    prompt_objects,
    speeds,
    switch_latency,
    track,
)
from rolling_forcing.procedural import Scene, Shape, render, scene_prompt


@dataclass(frozen=True)
class D:
    color: str
    kind: str
    x: float
    y: float
    area: int = 50
    contact: tuple[str, ...] = ()


RED, BLUE = ("red", "circle"), ("blue", "square")


def test_prompt_objects() -> None:
    p = "a red circle and a blue square bouncing on a gray background"
    assert prompt_objects(p) == (RED, BLUE)
    assert prompt_background(p) == "gray"
    with pytest.raises(ValueError, match="background"):
        prompt_background("a red circle")
    with pytest.raises(ValueError, match="names no"):
        prompt_objects("bouncing on a gray background")
    with pytest.raises(ValueError, match="'cat' is not in the vocabulary"):
        prompt_objects("a red cat")


def test_presence_counts_frames_with_every_object() -> None:
    frames = [
        [D("red", "circle", 1, 1), D("blue", "square", 5, 5)],  # both
        [D("red", "circle", 1, 1)],  # blue missing
        [D("red", "square", 1, 1), D("blue", "square", 5, 5)],  # red has the wrong kind
        [D("red", "circle", 1, 1), D("blue", "square", 5, 5), D("green", "triangle", 9, 9)],  # extra is fine
    ]
    assert presence(frames, [RED, BLUE]) == 0.5
    assert presence(frames, [BLUE]) == 0.75
    assert presence([], [RED]) is None
    # with backgrounds: a frame counts only on the prompt's background
    assert presence(frames, [BLUE], ["gray", "gray", None, "navy"], "gray") == 0.25  # frame 0 only
    with pytest.raises(ValueError, match="both"):
        presence(frames, [BLUE], ["gray"] * 4)


def test_track_takes_the_largest_and_uses_a_detection_once() -> None:
    frames = [[D("red", "circle", 1, 2, area=10), D("red", "circle", 7, 8, area=40)]]
    np.testing.assert_array_equal(track(frames, [RED])[0, 0], [7, 8])
    both = track(frames, [RED, RED])[0]  # a prompt naming the same object twice needs two detections
    np.testing.assert_array_equal(both, [[7, 8], [1, 2]])
    assert np.isnan(track(frames, [BLUE])).all()


def test_a_partly_hidden_object_counts_by_colour_only_in_contact() -> None:
    # a red circle half behind a blue square reads as another kind; only in contact is colour enough
    hidden = [[D("red", "triangle", 1, 1, contact=("blue",)), D("blue", "square", 5, 5, contact=("red",))]]
    assert presence(hidden, [RED, BLUE]) == 1.0
    alone = [[D("red", "triangle", 1, 1), D("blue", "square", 5, 5)]]
    assert presence(alone, [RED, BLUE]) == 0.0
    # contact with a colour the prompt does not name (a random mosaic) earns nothing
    stray = [[D("red", "triangle", 1, 1, contact=("green",)), D("blue", "square", 5, 5)]]
    assert presence(stray, [RED, BLUE]) == 0.0
    # an exact kind wins over a larger detection matched by colour only
    both = [[D("red", "square", 9, 9, area=90, contact=("blue",)), D("red", "circle", 2, 2, area=30)]]
    np.testing.assert_array_equal(track(both, [RED])[0, 0], [2, 2])


def test_continuity_known_ratio() -> None:
    # one object moving 1 px/frame inside chunks and jumping 5 px at each chunk start (frames 9, 21)
    starts = chunk_starts(30)
    np.testing.assert_array_equal(starts, [9, 21])
    x = np.zeros(30)
    for t in range(1, 30):
        x[t] = x[t - 1] + (5.0 if t in (9, 21) else 1.0)
    pos = np.stack([x, np.zeros(30)], axis=-1)[:, None, :]
    c = continuity(pos, starts)
    assert (c.boundary, c.within, c.n_boundary, c.n_within) == (5.0, 1.0, 2, 27)
    assert c.ratio == 5.0
    smooth = continuity(np.stack([np.arange(30.0), np.zeros(30)], -1)[:, None], starts)
    assert smooth.ratio == 1.0


def test_continuity_skips_absent_frames_and_frozen_video() -> None:
    pos = np.stack([np.arange(30.0), np.zeros(30)], axis=-1)[:, None, :]
    pos[9] = np.nan  # absent at the boundary: no boundary sample from frames 8-9 or 9-10
    c = continuity(pos, chunk_starts(30))
    assert c.n_boundary == 1 and c.n_within == 29 - 3
    frozen = continuity(np.zeros((30, 1, 2)), chunk_starts(30))
    assert frozen.within == 0.0 and frozen.ratio is None
    assert not check("continuity_ratio", frozen.ratio).met


def test_drift_tail_presence_and_speed() -> None:
    fps, n = 4.0, 200  # tail of 30 s = 120 frames
    frames = []
    for t in range(n):
        x = float(min(t, 100)) * 0.5  # moves 0.5 px/frame, stops at frame 100
        dets = [D("red", "circle", x, 3.0)] if t % 4 else []  # absent every 4th frame
        frames.append(dets)
    d = drift(frames, [RED], fps)
    assert d.tail_frames == 120
    assert d.tail_presence == pytest.approx(0.75)
    # tail frames 80..199: 0.5 px steps until 100, then still; median of the present-present steps = 0
    assert d.speeds == (0.0,) and not d.moving
    d2 = drift(frames[:100], [RED], fps)
    assert d2.speeds == (0.5,) and d2.moving
    with pytest.raises(ValueError, match="fps"):
        drift(frames, [RED], 0.0)


def test_speeds_over_a_chunk_average_out_the_centroid_jitter() -> None:
    """A track at 0.3 px/frame with +-0.3 px of jitter per frame and a standing one with the same jitter:
    a 12-frame displacement is off by at most 2 x 0.3 px, so the speeds are within 0.05 px/frame of 0.3 and
    of 0 (the per-frame steps of the standing one are as large as the moving one's: lag 1 cannot tell
    them apart)."""
    rng = np.random.default_rng(0)
    t = np.arange(200.0)
    pos = np.zeros((200, 2, 2))
    pos[:, 0, 0] = 10 + 0.3 * t
    pos[:, 1, 0] = 30.0
    pos[:, :, :] += rng.uniform(-0.3, 0.3, size=pos.shape) / np.sqrt(2)  # |jitter| <= 0.3 px
    moving, standing = speeds(pos)
    assert moving == pytest.approx(0.3, abs=0.05) and standing <= 0.05
    assert speeds(pos, lag=1)[1] > 0.15  # per frame, the standing track looks as fast as MIN_SPEED
    gaps = pos.copy()
    gaps[::4] = np.nan  # absent every 4th frame: only the pairs present at both ends count
    assert speeds(gaps) == pytest.approx((moving, standing), abs=0.02)
    assert all(math.isnan(v) for v in speeds(pos[:12]))  # no two frames 12 apart
    with pytest.raises(ValueError, match="lag must be >= 1"):
        speeds(pos, lag=0)
    with pytest.raises(ValueError, match=r"\[T, n, 2\]"):
        speeds(pos[..., :1])


def test_switch_latency() -> None:
    old = [D("red", "circle", 1, 1)]
    new = [D("blue", "square", 5, 5)]
    frames = [old] * 30 + [old] * 7 + [new] * 2 + [old] + [new] * 10
    # switch at frame 30: new objects appear at 37 (2 frames), flicker, then hold from 40
    assert switch_latency(frames, [BLUE], 30) == 10
    assert switch_latency(frames, [BLUE], 30, hold=2) == 7
    assert switch_latency(frames, [("green", "triangle")], 30) is None
    with pytest.raises(ValueError, match="hold"):
        switch_latency(frames, [BLUE], 30, hold=0)


def test_longest_vanish_counts_frames_without_the_colour() -> None:
    r, b, rs = D("red", "circle", 1, 1), D("blue", "square", 5, 5), D("red", "square", 1, 1)
    # red: present (a wrong kind still counts as there), gone 3 frames, back, gone 1 frame at the end
    frames = [[r, b], [rs], [b], [b], [], [r, b], [b]]
    assert longest_vanish(frames, [RED, BLUE]) == [3, 1]
    assert longest_vanish([], [RED]) == [0]
    assert longest_vanish([[r]] * 5, [RED]) == [0]
    with pytest.raises(ValueError):
        longest_vanish(frames, [])
    assert check("vanish_frames", 12).met and not check("vanish_frames", 13).met


def test_check_against_targets() -> None:
    assert check("presence", 0.95).met and not check("presence", 0.85).met
    assert check("continuity_ratio", 1.9).met and not check("continuity_ratio", 2.1).met
    assert check("switch_frames", 24).met and not check("switch_frames", 25).met
    assert not check("presence", None).met
    assert "MISSED" in check("tail_presence", 0.5).describe()


def test_ground_truth_meets_every_target() -> None:
    # the generator's own frames are the ideal stream: detector + metrics must report targets met
    scene = Scene(
        (
            Shape("circle", "red", 8.0, 20.0, 20.0, 1.2, 0.7),
            Shape("triangle", "yellow", 9.0, 44.0, 44.0, -0.8, 1.1),
        ),
        "navy",
    )
    frames = render(scene, 0, 9 + 12 * 8)
    dets = detect(frames)
    objs = prompt_objects(scene_prompt(scene))
    pres = presence(dets, objs, read_backgrounds(frames), "navy")
    assert pres is not None and pres >= 0.9
    c = continuity(track(dets, objs), chunk_starts(len(dets)))
    assert c.ratio is not None and math.isfinite(c.ratio) and c.ratio <= 2.0
    assert max(longest_vanish(dets, objs)) <= 12
    # a switch at frame 33 to another scene: detected at once
    other = Scene(
        (
            Shape("square", "blue", 7.0, 15.0, 45.0, 0.9, -0.6),
            Shape("triangle", "green", 8.0, 45.0, 15.0, 0.5, 1.4),
        ),
        "black",
    )
    mixed = np.concatenate([frames[:33], render(other, 33, 30)])
    lat = switch_latency(detect(mixed), prompt_objects(scene_prompt(other)), 33)
    assert lat is not None and lat <= 2
