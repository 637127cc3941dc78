"""The video the demo model is trained to draw, as the quality bench scores it: ``truth_stream(layout=)``
against the training data's own path (``make_clips(layout="prompt")``), the training layout read from a
weights directory (``trained_layout``), and the bench's ``decoder_roundtrip`` row on it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from perf.quality.streams import PromptLayout, StreamSpec, trained_layout, truth_stream
from rolling_forcing.procedural import PROMPT_SIZES, PROMPT_SPEED, SceneConfig, sample_scene, scene_prompt

TRIANGLE = "a yellow triangle bouncing on a navy background"
TWO = "a red circle and a blue square bouncing on a gray background"
WEIGHTS = Path(__file__).resolve().parents[1] / "rolling_forcing" / "demo" / "weights"


def _training_clip(prompt: str, seed: int = 1, frames: int = 57) -> np.ndarray:
    """uint8 ``[frames, 64, 64, 3]``: the first prompt-layout training clip of ``seed`` whose scene has
    ``prompt`` (``make_clips``, the data path ``train-demo`` encodes; scenes are drawn per clip, cheaply)."""
    from rolling_forcing.decode import to_uint8_frames
    from rolling_forcing.demo.data import make_clips

    for i in range(4096):
        if scene_prompt(sample_scene(np.random.default_rng([seed, i]), SceneConfig())) == prompt:
            video, prompts, _ = make_clips(1, frames, seed=seed, first=i, layout="prompt")
            assert prompts == [prompt]
            return to_uint8_frames(video)
    raise AssertionError(f"no clip of seed {seed} has {prompt!r}")


@pytest.mark.parametrize("prompt", [TRIANGLE, TWO])
def test_prompt_layout_stream_is_the_training_clip(prompt: str) -> None:
    """The bench's ideal stream of the prompt layout is, frame for frame, the clip the DiT trains on for
    that prompt (the data path ``train-demo`` encodes), whatever the seed; the random layout is not."""
    want = _training_clip(prompt)
    for seed in (0, 5):
        got = truth_stream(StreamSpec(prompt, 5), seed=seed, layout=PromptLayout())
        assert got.frames.shape == (57, 64, 64, 3) and got.chunk_frames == (9, 12, 12, 12, 12)
        np.testing.assert_array_equal(got.frames, want)
    assert not np.array_equal(truth_stream(StreamSpec(prompt, 5), seed=0).frames, want)
    # another speed is another video
    slow = truth_stream(StreamSpec(prompt, 5), layout=PromptLayout(speed=PROMPT_SPEED / 2))
    assert np.array_equal(slow.frames[0], want[0]) and not np.array_equal(slow.frames[-1], want[-1])


def test_prompt_layout_switch_starts_the_new_prompt_video() -> None:
    """After a switch the new prompt's layout plays from its own frame 0 (what a restart asks for)."""
    spec = StreamSpec(TWO, 6, switch=(TRIANGLE, 3, "restart"))
    res = truth_stream(spec, layout=PromptLayout())
    alone = truth_stream(StreamSpec(TRIANGLE, 6), layout=PromptLayout())
    first = truth_stream(StreamSpec(TWO, 6), layout=PromptLayout())
    assert res.switch_frame == 33
    np.testing.assert_array_equal(res.frames[:33], first.frames[:33])
    np.testing.assert_array_equal(res.frames[33:], alone.frames[: 69 - 33])


def test_trained_layout_reads_the_weights_log(tmp_path: Path) -> None:
    shipped = trained_layout(None)
    assert shipped == PromptLayout(PROMPT_SPEED, PROMPT_SIZES)
    # the shipped weights' own training log agrees with the defaults they stand for
    log = json.loads((WEIGHTS / "dit_train_log.json").read_text())
    assert log["prompt_speed"] == shipped.speed
    assert log.get("prompt_sizes", dict(PROMPT_SIZES)) == dict(shipped.sizes)
    assert trained_layout(WEIGHTS) == shipped  # the shipped directory, named: its dit_train_log.json
    assert trained_layout(tmp_path) is None  # no log: unknown, not guessed
    (tmp_path / "train_log.json").write_text(json.dumps({"seed": 0}))
    assert trained_layout(tmp_path) is None  # a log from before the speed was recorded
    sizes = {"circle": 8.0, "square": 9.0, "triangle": 9.0}
    (tmp_path / "train_log.json").write_text(json.dumps({"prompt_speed": 0.5, "prompt_sizes": sizes}))
    assert trained_layout(tmp_path) == PromptLayout(0.5, sizes)
    (tmp_path / "train_log.json").write_text(json.dumps({"prompt_speed": 0.25}))
    assert trained_layout(str(tmp_path)) == PromptLayout(0.25, PROMPT_SIZES)
    (tmp_path / "train_log.json").write_text(json.dumps({"prompt_speed": -1}))
    with pytest.raises(ValueError, match="PromptLayout.speed"):
        trained_layout(tmp_path)
    with pytest.raises(ValueError, match="PromptLayout.sizes"):
        PromptLayout(sizes={"circle": 8.0})


def test_bench_decoder_roundtrip_scores_the_trained_layout() -> None:
    """The bench's ``decoder_roundtrip`` row is the demo autoencoder's round trip of the prompt layout's
    video (recomputed here from the training data path), and names the reason when the layout is unknown."""
    from perf import bench_quality as bq
    from perf.quality.compare import evaluate
    from perf.quality.streams import load_model

    sm = load_model("demo")
    assert sm.layout == PromptLayout()
    plan = replace(bq.QUICK, prompts=(TWO,), blocks=5)
    rows, _ = bq.stream_rows(sm, plan, seed=0)
    row = next(r for r in rows if r.variant == "decoder_roundtrip")
    assert row.status == "ok", row.message
    want = evaluate(replace(truth_stream(StreamSpec(TWO, 5)), frames=sm.roundtrip(_training_clip(TWO))), TWO)
    assert row.extra["presence"] == want["presence"] and row.extra["vanish_frames"] == want["vanish_frames"]
    rows, _ = bq.stream_rows(replace(sm, layout=None), plan, seed=0)
    row = next(r for r in rows if r.variant == "decoder_roundtrip")
    assert row.status != "ok" and "training layout is unknown" in row.message
