"""perf/serve_switch.py's measurement of a switch on screen, on frames built from the procedural generator
(the ground truth is known by construction: which chunk first shows the new background, its colours, its
shapes)."""

from __future__ import annotations

import numpy as np
import pytest

from perf.serve_switch import TARGETS, switch_on_screen
from rolling_forcing.procedural import BACKGROUNDS, Scene, Shape, render

NEW = "a yellow triangle bouncing on a navy background"


def _scene(background: str, *shapes: tuple[str, str]) -> Scene:
    return Scene(
        tuple(Shape(k, c, 9.0, 18.0 + 28 * i, 32.0, 0.3, 0.2) for i, (c, k) in enumerate(shapes)), background
    )


def _chunks(*scenes: Scene | str, per: int = 12) -> tuple[np.ndarray, list[int]]:
    """Frames of consecutive chunks from block 7 on: a scene each, or a bare background (a str)."""
    frames, blocks = [], []
    for c, sc in enumerate(scenes):
        if isinstance(sc, str):
            f = np.empty((per, 64, 64, 3), np.uint8)
            f[:] = BACKGROUNDS[sc]
        else:
            f = render(sc, 12 * c, per)
        frames.append(f)
        blocks += [7 + c] * per
    return np.concatenate(frames), blocks


def test_each_criterion_counts_the_chunk_where_it_first_holds() -> None:
    """Chunks: the old scene; the new colour on the old background (counts for nothing); the new background
    alone; the new colour as the wrong shape; the new prompt."""
    old = _scene("gray", ("red", "circle"), ("blue", "square"))
    frames, blocks = _chunks(
        old,
        _scene("gray", ("yellow", "triangle")),
        "navy",
        _scene("navy", ("yellow", "square")),
        _scene("navy", ("yellow", "triangle")),
    )
    got = switch_on_screen(frames, blocks, NEW, applied_block=7)
    assert (got.background, got.colours, got.shapes, got.chunks_seen, got.frames) == (3, 4, 5, 5, 60)
    assert got.done_frames == {"background": 24 + 3, "colours": 36 + 3, "shapes": 48 + 3}
    assert got.met() == {"background": False, "colours": False, "shapes": False}
    frames, blocks = _chunks(
        "navy", _scene("navy", ("yellow", "square")), _scene("navy", ("yellow", "triangle"))
    )
    got = switch_on_screen(frames, blocks, NEW, applied_block=7)
    assert (got.background, got.colours, got.shapes) == (1, 2, 3)
    assert got.met() == {"background": True, "colours": True, "shapes": True}
    assert TARGETS == {"background": 2, "colours": 2, "shapes": 4}


def test_a_run_shorter_than_hold_or_a_missing_object_does_not_count() -> None:
    new = _scene("navy", ("yellow", "triangle"))
    frames, blocks = _chunks(new, new)
    frames[3:] = BACKGROUNDS["black"]  # 3 frames of the new prompt, then a wrong background
    got = switch_on_screen(frames, blocks, NEW, applied_block=7)
    assert (got.background, got.colours, got.shapes) == (None, None, None)
    assert switch_on_screen(frames, blocks, NEW, applied_block=7, hold=3).shapes == 1
    two = "a yellow triangle and a green square bouncing on a navy background"
    frames, blocks = _chunks(new, _scene("navy", ("yellow", "triangle"), ("green", "circle")))
    got = switch_on_screen(frames, blocks, two, applied_block=7)  # the green one is a circle
    assert (got.background, got.colours, got.shapes) == (1, 2, None)


def test_bad_input_names_the_rule() -> None:
    frames, blocks = _chunks("navy")
    with pytest.raises(ValueError, match="hold"):
        switch_on_screen(frames, blocks, NEW, 7, hold=0)
    with pytest.raises(ValueError, match="non-decreasing block >= applied_block"):
        switch_on_screen(frames, blocks, NEW, 8)
    with pytest.raises(ValueError, match="non-decreasing"):
        switch_on_screen(frames, blocks[::-1][:-1] + [3], NEW, 3)
