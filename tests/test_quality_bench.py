"""perf/quality/compare.py (PSNR), perf/quality/sheet.py (contact sheet PNG), perf/quality/streams.py (the
stream runner: frame counts, a switch, ground-truth streams) and perf/bench_quality.py's summary lines."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from perf.quality.compare import psnr
from perf.quality.metrics import prompt_objects
from perf.quality.sheet import contact_sheet, pick_frames, sheet_size, write_png
from perf.quality.streams import StreamSpec, load_model, run_stream, scene_for_prompt, truth_stream
from tests.pipeline_helpers import one_thread as one_thread

PROMPT = "a red circle and a blue square bouncing on a gray background"


def test_psnr_known_values() -> None:
    a = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    assert psnr(a, a) == math.inf
    b = a.copy()
    b[0, 0, 0, 0] = 255  # one of 96 values off by 255: MSE = 255^2 / 96
    assert psnr(a, b) == pytest.approx(10 * math.log10(96))
    c = np.full_like(a, 10)  # every value off by 10: 20 log10(255 / 10)
    assert psnr(a, c) == pytest.approx(20 * math.log10(25.5))
    with pytest.raises(ValueError, match="same shape"):
        psnr(a, a[:1])
    with pytest.raises(ValueError, match="uint8"):
        psnr(a.astype(np.float32), a)


def test_contact_sheet_size_and_tiles(tmp_path: Path) -> None:
    frames = np.zeros((40, 64, 64, 3), dtype=np.uint8)
    frames[:, :, :, 0] = np.arange(40, dtype=np.uint8)[:, None, None] * 5  # frame index in the red channel
    img = contact_sheet(frames, cols=4, count=8, scale=2)
    assert img.shape[:2] == sheet_size((64, 64), 2, 4, 2) == (2 * (128 + 14 + 4) + 4, 4 * (128 + 4) + 4)
    idx = pick_frames(40, 8)
    assert idx[0] == 0 and idx[-1] == 39 and idx.size == 8
    # the third tile (row 0, col 2) shows frame idx[2], upscaled: its top-left block has that frame's red
    x0, y0 = 4 + 2 * 132, 4
    assert img[y0 + 5, x0 + 5, 0] == idx[2] * 5
    path = write_png(tmp_path / "sub" / "sheet.png", img)
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (img.shape[1], img.shape[0])
    with pytest.raises(ValueError, match="uint8"):
        contact_sheet(frames.astype(np.float32))


def test_truth_stream_frames_and_switch() -> None:
    res = truth_stream(
        StreamSpec(PROMPT, 6, switch=("a yellow triangle bouncing on a navy background", 3, "continue"))
    )
    assert res.frames.shape == (9 + 5 * 12, 64, 64, 3) and res.chunk_frames == (9, 12, 12, 12, 12, 12)
    assert res.switch_frame == 9 + 2 * 12
    assert (res.frames[res.switch_frame] == (15, 25, 70)).all(axis=-1).mean() > 0.5  # navy from the switch on
    scene = scene_for_prompt(PROMPT, np.random.default_rng(0))
    assert [(s.color, s.kind) for s in scene.shapes] == list(prompt_objects(PROMPT))
    assert scene.background == "gray"


def test_tiny_stream_runner_frame_counts_and_determinism() -> None:
    sm = load_model("tiny")
    spec = StreamSpec(PROMPT, 5, merged=False, switch=(PROMPT.replace("red", "green"), 2, "recache"))
    a = run_stream(sm, spec)
    assert a.frames.dtype == np.uint8 and a.frames.shape == (57, 64, 64, 3)
    assert a.chunk_frames == (9, 12, 12, 12, 12) and a.switch_frame == 21
    b = run_stream(sm, spec)
    np.testing.assert_array_equal(a.frames, b.frames)  # same seed, same frames
    c = run_stream(sm, StreamSpec(PROMPT, 5, merged=False))
    assert psnr(a.frames[:21], c.frames[:21]) == math.inf  # the switch changes nothing before its block
    assert psnr(a.frames[21:33], c.frames[21:33]) < 60  # ... and changes the switch block itself


def test_model_names_are_checked() -> None:
    with pytest.raises(ValueError, match="model must be one of"):
        load_model("huge")
    with pytest.raises(ValueError, match="applies to model 'demo' only"):
        load_model("tiny", weights="rolling_forcing/demo/weights")
    with pytest.raises(ValueError, match="switch block"):
        StreamSpec(PROMPT, 5, switch=(PROMPT, 5, "continue"))
    with pytest.raises(ValueError, match="switch mode must be one of"):
        StreamSpec(PROMPT, 5, switch=(PROMPT, 2, "cut"))
    with pytest.raises(ValueError, match="has no restart"):
        StreamSpec(PROMPT, 5, cores=2, switch=(PROMPT, 2, "restart"))


def test_bench_main_prints_targets_and_writes_the_sheet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from perf import bench_quality
    from perf.quality.sheet import CAPTION, GAP

    monkeypatch.chdir(tmp_path)  # --no-save puts the sheet under ./build/perf
    skip = ["detector", "drift", "switch", "compare"]
    assert (
        bench_quality.main(["--quick", "--no-save", "--model", "tiny", "--blocks", "5", "--skip", *skip]) == 0
    )
    out = capsys.readouterr().out
    # the ideal stream moves smoothly across chunks ((a) dips when one shape hides another: 0.895 over
    # these 5 blocks); the tiny model's random mosaic misses both targets
    assert "stream ground_truth [" + PROMPT + "]: (a) presence" in out
    lines = [line for line in out.splitlines() if line.startswith("stream ")]
    assert len(lines) == 2 and "(target <= 2: met)" in lines[0] and lines[1].count("MISSED") == 2
    png = tmp_path / "build" / "perf" / "quality_quick_sheet.png"
    from PIL import Image

    with Image.open(png) as im:  # 16 frames, 8 per row, scale 2
        assert im.size == (8 * (128 + GAP) + GAP, 2 * (128 + CAPTION + GAP) + GAP)
    assert not (tmp_path / "perf").exists()


def test_evaluate_on_the_ideal_stream() -> None:
    from perf.quality.compare import evaluate

    res = truth_stream(StreamSpec("a yellow triangle bouncing on a navy background", 6), seed=3)
    m = evaluate(res, "a yellow triangle bouncing on a navy background")
    # one shape, nothing to hide it: present in every frame; constant speed, so every ratio is ~1
    # (a bounce shortens one step: the ratios move by at most one step's share of the mean)
    assert m["presence"] == 1.0
    assert m["continuity_ratio"] == pytest.approx(1.0, abs=0.15)
    assert m["latent_boundary_ratio"] == pytest.approx(1.0, abs=0.15)
    assert evaluate(res, "a yellow triangle bouncing on a gray background")["presence"] == 0.0  # wrong bg


def test_evaluate_reads_the_motion_of_the_stream() -> None:
    """The prompt layout moves every shape at 0.3 px/frame: ``evaluate`` reads that speed for each object
    over the stream's tail, and a stream whose frames stand still (its first frame repeated) as 0, not
    moving; a tail of one window reads the same speeds as the whole 69-frame stream."""
    from dataclasses import replace

    from perf.quality.compare import evaluate
    from perf.quality.metrics import MIN_SPEED
    from perf.quality.streams import PromptLayout

    prompt = "a red circle and a blue square bouncing on a gray background"
    res = truth_stream(StreamSpec(prompt, 6), seed=0, layout=PromptLayout())
    m = evaluate(res, prompt)
    # the detected centroid of a rendered shape is within a fraction of a pixel of its true centre, so a
    # 12-frame displacement of 3.6 px reads within 0.5 px: 0.3 +- 0.04 px/frame
    assert m["moving"] and m["tail_speeds_px_per_frame"] == [pytest.approx(0.3, abs=0.04)] * 2
    assert (
        evaluate(res, prompt, motion_tail_frames=13)["tail_speeds_px_per_frame"]
        == [pytest.approx(0.3, abs=0.04)] * 2
    )  # one window of 12 frames
    still = replace(res, frames=np.repeat(res.frames[:1], res.frames.shape[0], axis=0))
    m0 = evaluate(still, prompt)
    assert m0["tail_speeds_px_per_frame"] == [0.0, 0.0] and not m0["moving"] and MIN_SPEED > 0
    short = evaluate(res, prompt, motion_tail_frames=12)  # no two frames a chunk apart: unknown, not moving
    assert short["tail_speeds_px_per_frame"] == [None, None] and not short["moving"]
    with pytest.raises(ValueError, match="motion_tail_frames must be >= 1, got 0"):
        evaluate(res, prompt, motion_tail_frames=0)


def test_switch_rows_from_each_start_prompt() -> None:
    """The full plan switches from a two-object and from a one-object prompt (the case that asks the model
    to draw an object its context does not show); each start gives the ideal stream's row and the model's
    in each switch mode (continuing, re-cached, restarting). The ideal stream shows the new prompt from the
    switch block on: 0 frames."""
    from dataclasses import replace

    from perf import bench_quality as bq

    assert bq.FULL.switch_from == bq.PROMPTS[:2] and len(prompt_objects(bq.PROMPTS[1])) == 1
    plan = replace(bq.QUICK, switch_blocks=6, switch_block=3, switch_from=bq.PROMPTS[:2])
    rows = bq.switch_rows(load_model("tiny"), plan, seed=0)
    got = [(r.variant, r.config["from"], r.config["switch"], r.config["recache"]) for r in rows]
    assert got == [
        (who, src, mode, mode == "recache")
        for src in bq.PROMPTS[:2]
        for who, mode in (
            ("ground_truth", "continue"), ("tiny", "continue"), ("tiny", "recache"), ("tiny", "restart")
        )
    ]  # fmt: skip
    assert all(r.config["to"] == bq.SWITCH_TO and r.status == "ok" for r in rows)
    assert [r.extra["switch_frames"] for r in rows if r.variant == "ground_truth"] == [0, 0]
    lines = bq.summary(rows)
    assert sum("from 2 object(s)" in line for line in lines) == 4
    assert sum("from 1 object(s)" in line for line in lines) == 4
    assert sum("restarting" in line for line in lines) == 2
