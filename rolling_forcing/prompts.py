"""Prompt schedules in LongLive's format, for every method's ``set_prompt``.

LongLive 1.0 (github.com/NVlabs/LongLive, branch v1.0 @ e52d9ef: ``utils/dataset.py``,
``example/interactive_example.jsonl``, ``configs/longlive_interactive_inference.yaml``) reads a JSONL file,
one object per video, ``{"prompts": [p0, p1, ..., pN]}`` with the same number of segments on every line,
and takes the switch points from its config as latent-frame indices (``switch_frame_indices: 40, 80,
...``): prompt ``i`` starts at the first block whose start frame is at or after switch ``i - 1`` (blocks
start at multiples of 3, so a switch at frame 40 takes effect at frame 42). Here a line may also carry
its own ``"switch_frame_indices"``; an explicit list given to :func:`read_prompt_schedule` wins.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


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


__all__ = ["PromptSchedule", "parse_switch_frames", "read_prompt_schedule"]
