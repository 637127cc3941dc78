"""perf.demo_chain: the three ways run what they say on the shipped demo model (6 blocks, one prompt)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from perf import demo_chain
from perf.quality.detect import detect, read_backgrounds
from perf.quality.metrics import presence, prompt_background, prompt_objects
from rolling_forcing.config import PipelineConfig
from rolling_forcing.decode import to_uint8_frames
from rolling_forcing.demo import load_demo
from rolling_forcing.demo.autoencoder import load_autoencoder

PROMPT = "a yellow triangle bouncing on a navy background"


def test_ways_and_roundtrip_on_the_demo_model() -> None:
    demo, ae = load_demo(with_decoder=False), load_autoencoder()
    rows = demo_chain.measure_prompt(demo, ae, PROMPT, 6, 0)
    assert [r["way"] for r in rows] == ["roundtrip", "teacher", "chain", "stream"]
    truth = demo_chain._truth_latents(ae, PROMPT, 18, 0)
    frames = to_uint8_frames(ae.decode(truth))
    want = presence(
        detect(frames), prompt_objects(PROMPT), read_backgrounds(frames), prompt_background(PROMPT)
    )
    assert rows[0]["presence"] == want
    levels = [str(i) for i in range(len(PipelineConfig().timesteps))]
    for r in rows[1:]:
        assert sorted(r["x0_mse"]) == levels and 0.0 <= r["presence"] <= 1.0
    # teacher: a block's input holds (1 - sigma) of its true latent, so the lowest-noise level's x0 error is
    # the smallest; the chain's level-0 input is pure noise whatever the way: the same level-0 error
    teacher, chain = rows[1]["x0_mse"], rows[2]["x0_mse"]
    assert teacher[levels[-1]] < teacher["0"]
    assert chain["0"] == pytest.approx(teacher["0"], rel=0.2)


def test_truth_latents_render_the_prompt_layout() -> None:
    from perf.quality.streams import scene_for_prompt
    from rolling_forcing.procedural import prompt_layout, render

    ae = load_autoencoder()
    z = demo_chain._truth_latents(ae, PROMPT, 3, 0)
    video = render(prompt_layout(scene_for_prompt(PROMPT, np.random.default_rng(0))), 0, 9)
    x = torch.from_numpy(video).permute(0, 3, 1, 2).float()[None] / 127.5 - 1.0
    torch.testing.assert_close(z, ae.encode(x), rtol=0, atol=0)


def test_blocks_below_a_full_window_are_refused() -> None:
    with pytest.raises(ValueError, match="--blocks must be >= 6"):
        demo_chain.run(None, (PROMPT,), 5, 0)


def test_truth_latents_follow_the_prompt_speed() -> None:
    """``prompt_speed`` renders the reference at that speed (the weights' training speed): equal to the
    layout rendered at 0.3 px/frame, different from the 1.5 px/frame reference after frame 0, and the
    default is :data:`rolling_forcing.procedural.PROMPT_SPEED`."""
    from perf.quality.streams import scene_for_prompt
    from rolling_forcing.procedural import PROMPT_SPEED, prompt_layout, render

    ae = load_autoencoder()
    z = demo_chain._truth_latents(ae, PROMPT, 3, 0, 0.3)
    video = render(prompt_layout(scene_for_prompt(PROMPT, np.random.default_rng(0)), 0.3), 0, 9)
    x = torch.from_numpy(video).permute(0, 3, 1, 2).float()[None] / 127.5 - 1.0
    torch.testing.assert_close(z, ae.encode(x), rtol=0, atol=0)
    fast = demo_chain._truth_latents(ae, PROMPT, 3, 0, 1.5)
    assert torch.equal(z[:, :1], fast[:, :1]) and not torch.equal(z[:, 1:], fast[:, 1:])
    assert PROMPT_SPEED == 0.3 and torch.equal(demo_chain._truth_latents(ae, PROMPT, 3, 0), z)
    with pytest.raises(ValueError, match="--prompt-speed must be a finite number > 0"):
        demo_chain.run(None, (PROMPT,), 6, 0, 0.0)


def test_truth_latents_follow_the_prompt_sizes() -> None:
    """``prompt_sizes`` renders the reference with the weights' training sizes: equal to the layout rendered
    with that table, different from the default sizes; a bad ``--prompt-sizes`` is refused before any
    model is loaded."""
    from perf.quality.streams import scene_for_prompt
    from rolling_forcing.procedural import prompt_layout, render

    ae = load_autoencoder()
    table = {"circle": 8.0, "square": 7.0, "triangle": 7.0}  # the bench prompt is a triangle
    z = demo_chain._truth_latents(ae, PROMPT, 3, 0, None, table)
    video = render(prompt_layout(scene_for_prompt(PROMPT, np.random.default_rng(0)), None, table), 0, 9)
    x = torch.from_numpy(video).permute(0, 3, 1, 2).float()[None] / 127.5 - 1.0
    torch.testing.assert_close(z, ae.encode(x), rtol=0, atol=0)
    assert not torch.equal(z, demo_chain._truth_latents(ae, PROMPT, 3, 0))
    with pytest.raises(
        ValueError, match="--prompt-sizes must give a size for each of circle, square, triangle"
    ):
        demo_chain.run("/nonexistent", (PROMPT,), 6, 0, None, "circle=8")


def test_run_reads_the_layout_from_the_weights_log(tmp_path, monkeypatch) -> None:
    """Without ``--prompt-speed`` / ``--prompt-sizes`` the reference video is the layout the weights' log
    records (a ``train-demo`` run at 1.5 px/frame and square 9: those, not the defaults); a log without
    ``prompt_speed`` is refused naming both flags; the flags, when given, win."""
    import json
    import shutil

    from rolling_forcing.demo import WEIGHTS_DIR

    seen: list[tuple[object, object]] = []

    def spy(demo, ae, prompt, blocks, seed, speed=None, sizes=None):  # type: ignore[no-untyped-def]
        seen.append((speed, sizes))
        return []

    monkeypatch.setattr(demo_chain, "measure_prompt", spy)
    w = tmp_path / "w"
    shutil.copytree(WEIGHTS_DIR, w)
    (w / "dit_train_log.json").unlink(missing_ok=True)
    sizes = {"circle": 8.0, "square": 9.0, "triangle": 9.0}
    (w / "train_log.json").write_text(json.dumps({"prompt_speed": 1.5, "prompt_sizes": sizes}))
    demo_chain.run(str(w), (PROMPT,), 6, 0)
    demo_chain.run(str(w), (PROMPT,), 6, 0, 0.3)  # a flag given: the flags decide, the others default
    demo_chain.run(None, (PROMPT,), 6, 0)  # the shipped weights: the defaults
    assert seen == [(1.5, sizes), (0.3, None), (None, None)]
    (w / "train_log.json").write_text(json.dumps({"steps": 10}))
    with pytest.raises(ValueError, match="pass --prompt-speed and --prompt-sizes"):
        demo_chain.run(str(w), (PROMPT,), 6, 0)
