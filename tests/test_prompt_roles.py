"""The demo model's prompts checked by role (rolling_forcing/prompts.py ``check_scene_prompt``): every
training prompt is read back to its scene; a background colour that is no background, a shape without a
colour, more objects than the model was trained on are refused with the rule and the words allowed in that
role, as one CLI line (exit 2, before any model is built) for ``--prompt`` and ``--prompt-schedule``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rolling_forcing.procedural import SceneConfig, sample_scene, scene_prompt
from rolling_forcing.prompts import MAX_OBJECTS, ScenePrompt, check_scene_prompt

SHAPE_COLOURS = "red, green, blue, yellow, white, purple"  # written out: procedural.COLORS' order
BACKGROUNDS = "black, gray, navy"


def test_every_training_prompt_reads_back_to_its_scene() -> None:
    """The demo data's prompts (``scene_prompt`` of ``sample_scene``, 1-3 shapes) pass, naming the scene's
    shapes in order and its background."""
    rng = np.random.default_rng(7)
    counts = set()
    for _ in range(200):
        scene = sample_scene(rng)
        got = check_scene_prompt(scene_prompt(scene), max_words=16)
        assert got == ScenePrompt(tuple((s.color, s.kind) for s in scene.shapes), scene.background)
        counts.add(len(scene.shapes))
    assert counts == {1, 2, 3} and MAX_OBJECTS == SceneConfig().max_shapes == 3


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (
            "a red circle on a white background",
            f"'white background': white is a shape colour only; the background is one of {BACKGROUNDS}",
        ),
        (
            "a navy circle on a gray background",
            f"'navy circle': navy is a background colour only; a shape's colour is one of {SHAPE_COLOURS}",
        ),
        (
            "a circle bouncing on a gray background",
            f"'circle' has no colour: every shape is '<colour> <shape>' with a colour of {SHAPE_COLOURS}",
        ),
        (
            "a red circle and a blue square and a green triangle and a white circle on a gray background",
            "4 objects: the demo model was trained on 1 to 3 '<colour> <shape>' objects (colours "
            f"{SHAPE_COLOURS}; shapes circle, square, triangle)",
        ),
        (
            "a red and a blue square on a gray background",
            "'red' names no shape: a shape colour is followed by one of circle, square, triangle",
        ),
        (
            "a red circle on navy",
            f"'navy' is a background colour: write 'navy background' (backgrounds: {BACKGROUNDS})",
        ),
        (
            "a red circle on a background",
            f"'background' has no colour: the background is one of {BACKGROUNDS}",
        ),
        ("a red circle", f"needs one '<colour> background' with a colour of {BACKGROUNDS}, got none"),
        (
            "a red circle on a gray background and a black background",
            f"needs one '<colour> background' with a colour of {BACKGROUNDS}, got gray, black",
        ),
        (
            "a red circle and a red circle on a gray background",
            "'red circle' is named twice: the demo model's scenes hold distinct '<colour> <shape>' objects",
        ),
        ("on a gray background", "names no object: 1 to 3 '<colour> <shape>' objects, colours"),
        ("a pink circle on a gray background", "prompt word 'pink' is not in the vocabulary: a, and,"),
    ],
)
def test_roles_are_refused_with_the_rule_and_the_allowed_words(prompt: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        check_scene_prompt(prompt)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_word_limit_is_the_text_encoders() -> None:
    p = "a red circle and a blue square and a green triangle bouncing on a gray background"
    assert len(p.split()) == 16 and check_scene_prompt(p, max_words=16).background == "gray"
    longer = p.replace("bouncing", "bouncing and bouncing")
    assert check_scene_prompt(longer).background == "gray"  # the roles hold; only the length does not
    with pytest.raises(ValueError, match="^18 words: the demo text encoder reads at most 16$"):
        check_scene_prompt(longer, 16)


@pytest.fixture
def no_demo_build(monkeypatch) -> None:
    """Loading the demo model fails loudly: a refusal must come before any build."""
    import rolling_forcing.demo as demo_pkg

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("the demo model was loaded before the prompt was checked")

    monkeypatch.setattr(demo_pkg, "load_demo", boom)


@pytest.mark.parametrize(
    "prompt",
    [
        "a red circle on a white background",
        "a circle bouncing on a gray background",
        "a red circle and a blue square and a green triangle and a white circle on a gray background",
    ],
)
def test_cli_prompt_refused_in_one_line_before_any_build(
    prompt: str, no_demo_build, capsys, tmp_path
) -> None:
    from nki_ardiff.cli import main

    with pytest.raises(ValueError) as rule:
        check_scene_prompt(prompt)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--blocks", "5", "--out", str(tmp_path / "a.mp4"), "--prompt", prompt])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: --prompt: demo preset: {rule.value}\n"
    assert not (tmp_path / "a.mp4").exists()


def test_cli_prompt_schedule_prompts_are_checked_by_role(no_demo_build, capsys, tmp_path) -> None:
    from nki_ardiff.cli import main

    sched = tmp_path / "p.jsonl"
    good = "a red circle bouncing on a gray background"
    sched.write_text(json.dumps({"prompts": [good, "a blue circle on a white background"]}) + "\n")
    args = ["generate", "--blocks", "6", "--out", str(tmp_path / "a.mp4"), "--prompt-schedule", str(sched)]
    with pytest.raises(SystemExit) as e:
        main([*args, "--switch-frames", "9"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err == (
        "error: --prompt-schedule: demo preset: 'white background': white is a shape colour only; the "
        f"background is one of {BACKGROUNDS}\n"
    )
