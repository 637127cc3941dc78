"""Options of ``rolling-forcing generate``: the choice enums, the frozen :class:`GenerateOptions` record and
the command line that reproduces it (recorded in the JSON report). No typer, no torch: pure data."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rolling_forcing.config import PositionMode


class Backend(str, Enum):
    reference = "reference"
    emulator = "emulator"
    neuron = "neuron"


class Positions(str, Enum):
    absolute = "absolute"
    relative = "relative"


class Method(str, Enum):
    rolling_forcing = "rolling-forcing"
    self_forcing = "self-forcing"
    causvid = "causvid"
    longlive = "longlive"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class Preset(str, Enum):
    """The model presets of :data:`rolling_forcing.config.PRESETS` (a test keeps the two in step)."""

    demo = "demo"
    tiny = "tiny"
    micro = "micro"
    mid = "mid"
    wan2_1_1_3b = "wan2.1-1.3b"


class Switch(str, Enum):
    continue_ = "continue"
    recache = "recache"
    restart = "restart"


NoiseMode = Literal["auto", "upfront", "per-block"]
"""The values of :class:`Noise` (what :class:`GenerateOptions` stores)."""


class Noise(str, Enum):
    """How the stream's initial noise is drawn (see :func:`nki_ardiff.cli_checks.noise_upfront`)."""

    auto = "auto"
    upfront = "upfront"
    per_block = "per-block"


@dataclass(frozen=True)
class GenerateOptions:
    """Everything ``generate`` needs; the typer command only fills this in.

    ``progress``: None = a bar only when stderr is a terminal. ``quiet``: no bar and no tables, only the
    one-line result (errors still go to stderr). ``noise``: ``auto`` (default; the original's up-front
    draw for streams the original could run, per block beyond), ``upfront`` or ``per-block``.
    ``guidance``: the classifier-free guidance scale (None: the preset's, ``ModelConfig.guidance_scale``).
    ``switch``: how the prompt schedule's switches are taken (``rolling_forcing.prompts.SWITCH_MODES``;
    None: :func:`default_switch`).
    """

    out: Path
    preset: str = "demo"
    seconds: float = 10.0
    blocks: int | None = None
    prompt: str = "a red circle and a blue square bouncing on a gray background"
    seed: int = 0
    checkpoint: Path | None = None
    use_ema: bool = False
    vae: Path | None = None
    text_encoder: Path | None = None
    prompt_embeds: Path | None = None
    backend: str = "reference"
    positions: PositionMode = "absolute"
    dtype: str = "float32"
    report_json: Path | None = None
    progress: bool | None = None
    threads: int | None = None
    warmup: bool = True
    cores: int = 1
    merged: bool | None = None
    compile: bool = False
    method: str = "rolling-forcing"
    lora: Path | None = None
    prompt_schedule: Path | None = None
    switch_frames: str | None = None
    noise: NoiseMode = "auto"
    quiet: bool = False
    guidance: float | None = None
    switch: str | None = None


def default_switch(preset: str, method_recache: str) -> str:
    """The switch mode without ``--switch`` (a prompt schedule's, the served page's preselected one): the
    demo preset's :data:`rolling_forcing.prompts.DEMO_SWITCH` (restart: it cannot draw an object its
    context does not show); otherwise the method's original: LongLive re-caches (``method_recache ==
    "window"``), the others continue."""
    from rolling_forcing.prompts import DEMO_SWITCH

    if preset == "demo":
        return DEMO_SWITCH
    return "recache" if method_recache == "window" else "continue"


def command_line(opts: GenerateOptions) -> str:
    """The ``rolling-forcing generate`` command that reproduces ``opts`` (recorded in the report)."""
    parts = ["rolling-forcing", "generate", "--preset", opts.preset]
    parts += ["--blocks", str(opts.blocks)] if opts.blocks is not None else ["--seconds", f"{opts.seconds:g}"]
    parts += ["--prompt", opts.prompt, "--seed", str(opts.seed), "--backend", opts.backend]
    parts += ["--positions", opts.positions, "--dtype", opts.dtype, "--out", str(opts.out)]
    for flag, value in (
        ("--checkpoint", opts.checkpoint),
        ("--vae", opts.vae),
        ("--text-encoder", opts.text_encoder),
        ("--prompt-embeds", opts.prompt_embeds),
        ("--report-json", opts.report_json),
        ("--threads", opts.threads),
        ("--lora", opts.lora),
        ("--prompt-schedule", opts.prompt_schedule),
        ("--switch-frames", opts.switch_frames),
        ("--guidance", opts.guidance),
        ("--switch", opts.switch),
    ):
        if value is not None:
            parts += [flag, str(value)]
    parts += ["--use-ema"] if opts.use_ema else []
    parts += [] if opts.warmup else ["--no-warmup"]
    parts += ["--cores", str(opts.cores)] if opts.cores != 1 else []
    parts += ["--noise", opts.noise] if opts.noise != "auto" else []
    parts += [] if opts.merged is None else ["--merged" if opts.merged else "--two-pass"]
    parts += ["--compile"] if opts.compile else []
    parts += ["--method", opts.method] if opts.method != "rolling-forcing" else []
    return shlex.join(parts)


__all__ = [
    "Backend",
    "DType",
    "GenerateOptions",
    "Method",
    "Noise",
    "Positions",
    "Preset",
    "Switch",
    "command_line",
    "default_switch",
]
