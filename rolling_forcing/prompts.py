"""Prompt schedules in LongLive's format, for every method's ``set_prompt``; the demo model's prompt rules.

LongLive 1.0 (github.com/NVlabs/LongLive, branch v1.0 @ e52d9ef: ``utils/dataset.py``,
``example/interactive_example.jsonl``, ``configs/longlive_interactive_inference.yaml``) reads a JSONL file,
one object per video, ``{"prompts": [p0, p1, ..., pN]}`` with the same number of segments on every line,
and takes the switch points from its config as latent-frame indices (``switch_frame_indices: 40, 80,
...``): prompt ``i`` starts at the first block whose start frame is at or after switch ``i - 1`` (blocks
start at multiples of 3, so a switch at frame 40 takes effect at frame 42). Here a line may also carry
its own ``"switch_frame_indices"``; an explicit list given to :func:`read_prompt_schedule` wins.

:func:`check_scene_prompt` checks a prompt for the demo model by role, not only by vocabulary: the model
was trained on prompts of the procedural scenes (``rolling_forcing.procedural.scene_prompt``), 1 to
:data:`MAX_OBJECTS` distinct ``<colour> <shape>`` objects on one ``<background colour> background``. A prompt
outside that (a shape colour as the background, a shape without a colour, too many objects) would be
drawn as something else, so it is refused with the rule and the words allowed in that role.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rolling_forcing.procedural import BACKGROUNDS, COLORS, SHAPES, SceneConfig, prompt_words

SWITCH_MODES = ("continue", "recache", "restart")
"""How a prompt switch is taken (``RollingForcingPipeline.set_prompt``): the stream continues under the new
prompt, continues with its KV cache re-encoded under it (``recache=True``), or restarts under it
(``restart=True``)."""


DEMO_SWITCH = "restart"
"""The demo model's default switch (the served page's, ``generate --prompt-schedule``'s): a model that
continues its context cannot draw an object the context does not show (measured, docs/demo_model.md
"Switches"), so its stream restarts under the new prompt."""


def switch_options(mode: str) -> dict[str, bool]:
    """``set_prompt``'s keyword options of a mode of :data:`SWITCH_MODES` (``{"recache": ..., "restart":
    ...}``); ``ValueError`` naming the modes for another."""
    if mode not in SWITCH_MODES:
        raise ValueError(f"switch mode must be one of {SWITCH_MODES}, got {mode!r}")
    return {"recache": mode == "recache", "restart": mode == "restart"}


MAX_OBJECTS = SceneConfig().max_shapes
"""Most objects in a demo prompt: the demo model's training scenes hold 1 to 3 shapes
(``rolling_forcing.demo.data`` samples them with the default
:class:`~rolling_forcing.procedural.SceneConfig`)."""


@dataclass(frozen=True)
class PromptSchedule:
    """Prompts of one video and the latent frames where prompts 1.. start.

    ``switch_frames`` are strictly increasing positive ints, one fewer than ``prompts``.
    """

    prompts: tuple[str, ...]
    switch_frames: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.prompts or not all(isinstance(p, str) and p for p in self.prompts):
            raise ValueError(f"prompts must be non-empty strings, got {self.prompts!r}")
        if len(self.switch_frames) != len(self.prompts) - 1:
            raise ValueError(
                f"switch_frames needs one index per prompt after the first: {len(self.prompts)} prompts, "
                f"got {len(self.switch_frames)} switch frames {self.switch_frames}"
            )
        sw = self.switch_frames
        if any(isinstance(f, bool) or not isinstance(f, int) or f < 1 for f in sw) or list(sw) != sorted(
            set(sw)
        ):
            raise ValueError(f"switch_frames must be strictly increasing ints >= 1, got {sw}")

    def switch_blocks(self, frames_per_block: int) -> tuple[int, ...]:
        """Block at which each switch takes effect: the first block starting at or after its frame."""
        return tuple(-(-f // frames_per_block) for f in self.switch_frames)

    def segments(self, frames_per_block: int, num_blocks: int) -> list[tuple[int, str]]:
        """``(first block, prompt)`` of each segment that starts before ``num_blocks``."""
        starts = (0, *self.switch_blocks(frames_per_block))
        return [(b, p) for b, p in zip(starts, self.prompts) if b < num_blocks]


def parse_switch_frames(text: str) -> tuple[int, ...]:
    """``"40, 80,120"`` -> ``(40, 80, 120)`` (LongLive's comma string); ValueError naming the bad item."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit():
            raise ValueError(f"switch frames must be comma-separated non-negative ints, got item {item!r}")
        out.append(int(item))
    return tuple(out)


def read_prompt_schedule(
    path: str | Path, switch_frames: Sequence[int] | None = None, *, line: int = 0
) -> PromptSchedule:
    """Read line ``line`` (0-based) of a LongLive prompt JSONL as a :class:`PromptSchedule`.

    Every non-empty line must be an object with a ``"prompts"`` list of strings, all lines with the same
    count. ``switch_frames`` None: the line's ``"switch_frame_indices"`` (list or comma string).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt schedule {str(p)!r} is not a file")
    rows = []
    for n, raw in enumerate(p.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompts"), list):
            raise ValueError(f'{p}:{n}: each line must be an object {{"prompts": [...]}}')
        rows.append(obj)
    if not rows:
        raise ValueError(f"prompt schedule {str(p)!r} holds no lines")
    counts = {len(r["prompts"]) for r in rows}
    if len(counts) != 1:
        raise ValueError(f"{p}: every line must have the same number of prompts, got {sorted(counts)}")
    if not 0 <= line < len(rows):
        raise ValueError(f"line must be in [0, {len(rows)}), got {line}")
    row = rows[line]
    if switch_frames is None:
        sw = row.get("switch_frame_indices", [])
        switch_frames = parse_switch_frames(sw) if isinstance(sw, str) else tuple(sw)
    return PromptSchedule(tuple(row["prompts"]), tuple(switch_frames))


@dataclass(frozen=True)
class ScenePrompt:
    """A demo prompt read by role: its objects ``(colour, shape)`` in order and its background colour."""

    objects: tuple[tuple[str, str], ...]
    background: str


def _words(names: Sequence[str]) -> str:
    return ", ".join(names)


def check_scene_prompt(text: str, max_words: int | None = None) -> ScenePrompt:
    """Read a demo-model prompt by role; ``ValueError`` with the broken rule and the words allowed in that
    role (one line). Rules, in order:

    * every word is in the vocabulary (:func:`rolling_forcing.procedural.prompt_words`);
    * a shape (circle, square, triangle) follows its colour, one of the shape colours
      (:data:`~rolling_forcing.procedural.COLORS`), and a shape colour is followed by a shape;
    * ``background`` follows its colour, one of :data:`~rolling_forcing.procedural.BACKGROUNDS` (white is
      a shape colour only), and a background colour is followed by ``background``; exactly one background;
    * 1 to :data:`MAX_OBJECTS` objects, no object named twice;
    * at most ``max_words`` words (the text encoder's ``text_len``; None: no limit).
    """
    words = prompt_words(text)
    shape_colours, backgrounds, shapes = _words(tuple(COLORS)), _words(tuple(BACKGROUNDS)), _words(SHAPES)
    objects: list[tuple[str, str]] = []
    bgs: list[str] = []
    for i, w in enumerate(words):
        prev = words[i - 1] if i > 0 else None
        nxt = words[i + 1] if i + 1 < len(words) else None
        if w in SHAPES:
            if prev in BACKGROUNDS:
                raise ValueError(
                    f"'{prev} {w}': {prev} is a background colour only; a shape's colour is one of "
                    f"{shape_colours}"
                )
            if prev not in COLORS:
                raise ValueError(
                    f"'{w}' has no colour: every shape is '<colour> <shape>' with a colour of {shape_colours}"
                )
            objects.append((prev, w))
        elif w == "background":
            if prev in COLORS:
                raise ValueError(
                    f"'{prev} background': {prev} is a shape colour only; the background is one of "
                    f"{backgrounds}"
                )
            if prev not in BACKGROUNDS:
                raise ValueError(f"'background' has no colour: the background is one of {backgrounds}")
            bgs.append(prev)
        elif w in COLORS and nxt not in SHAPES and nxt != "background":
            raise ValueError(f"'{w}' names no shape: a shape colour is followed by one of {shapes}")
        elif w in BACKGROUNDS and nxt != "background" and nxt not in SHAPES:
            raise ValueError(
                f"'{w}' is a background colour: write '{w} background' (backgrounds: {backgrounds})"
            )
    if not objects:
        raise ValueError(
            f"names no object: 1 to {MAX_OBJECTS} '<colour> <shape>' objects, colours {shape_colours}; "
            f"shapes {shapes}"
        )
    if len(objects) > MAX_OBJECTS:
        raise ValueError(
            f"{len(objects)} objects: the demo model was trained on 1 to {MAX_OBJECTS} '<colour> <shape>' "
            f"objects (colours {shape_colours}; shapes {shapes})"
        )
    twice = [o for j, o in enumerate(objects) if o in objects[:j]]
    if twice:
        raise ValueError(
            f"'{' '.join(twice[0])}' is named twice: the demo model's scenes hold distinct "
            "'<colour> <shape>' objects"
        )
    if len(bgs) != 1:
        got = "none" if not bgs else _words(bgs)
        raise ValueError(f"needs one '<colour> background' with a colour of {backgrounds}, got {got}")
    if max_words is not None and len(words) > max_words:
        raise ValueError(f"{len(words)} words: the demo text encoder reads at most {max_words}")
    return ScenePrompt(tuple(objects), bgs[0])


__all__ = [
    "MAX_OBJECTS",
    "DEMO_SWITCH",
    "SWITCH_MODES",
    "PromptSchedule",
    "ScenePrompt",
    "check_scene_prompt",
    "parse_switch_frames",
    "read_prompt_schedule",
    "switch_options",
]
