"""``rolling-forcing train-demo``: retrain the demo model (autoencoder, then DiT + text encoder) on CPU.

Options are checked before anything is built (one ``error: <option>: <rule>`` line, exit 2); the run
itself is :func:`rolling_forcing.demo.train.train_demo`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nki_ardiff.cli_checks import CliError
from nki_ardiff.cli_errors import reported_errors
from rolling_forcing.procedural import PROMPT_SIZES, PROMPT_SPEED, format_sizes, parse_sizes

LATE_STEPS = 1500
"""Default ``--late-steps`` (``rolling_forcing.demo.train.LATE_STAGE.steps``; a test keeps them equal)."""


def check_train_demo(
    out: Path,
    seed: int,
    threads: int,
    autoencoder: Path | None,
    prompt_speed: float | None = None,
    late_steps: int | None = None,
    prompt_sizes: str | None = None,
) -> dict[str, float] | None:
    """Raise :class:`CliError` naming the option for a bad value (before any work); returns the parsed
    ``--prompt-sizes`` (None when not given)."""
    if late_steps is not None and late_steps < 0:
        raise CliError("--late-steps", f"must be >= 0 (0: no late stage), got {late_steps}")
    if prompt_speed is not None and not 0 < prompt_speed < float("inf"):
        raise CliError("--prompt-speed", f"must be a finite number > 0 (pixels/frame), got {prompt_speed}")
    if out.exists() and not out.is_dir():
        raise CliError("--out", f"{str(out)!r} exists and is not a directory")
    if seed < 0:
        raise CliError("--seed", f"must be >= 0, got {seed}")
    if threads < 1:
        raise CliError("--threads", f"must be >= 1, got {threads}")
    if autoencoder is not None:
        if not autoencoder.is_file():
            raise CliError("--autoencoder", f"{str(autoencoder)!r} does not exist (local file)")
        if not autoencoder.name.endswith(".safetensors"):
            raise CliError("--autoencoder", f"must be a .safetensors file, got {str(autoencoder)!r}")
    if prompt_sizes is None:
        return None
    try:
        return parse_sizes(prompt_sizes, "--prompt-sizes")
    except ValueError as exc:
        raise CliError("--prompt-sizes", str(exc).removeprefix("--prompt-sizes").lstrip(": ")) from None


def train_demo_cmd(
    ctx: typer.Context,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="directory for the weights, loss plot and log")
    ] = Path("build/demo-weights"),
    smoke: Annotated[bool, typer.Option("--smoke", help="a few steps of each stage (seconds; CI)")] = False,
    seed: Annotated[int, typer.Option(help="seed of every stage")] = 0,
    threads: Annotated[
        int, typer.Option(help="torch CPU threads (reproducibility: same count, same bits)")
    ] = 2,
    autoencoder: Annotated[
        Path | None, typer.Option(help="use this autoencoder.safetensors instead of retraining one")
    ] = None,
    progress: Annotated[bool, typer.Option(help="tqdm progress bars on stderr")] = True,
    prompt_speed: Annotated[
        float | None,
        typer.Option(
            help=f"the training videos' shape speed, pixels per frame at 64x64 (default {PROMPT_SPEED})"
        ),
    ] = None,
    prompt_sizes: Annotated[
        str | None,
        typer.Option(
            help="the training videos' shape sizes, px at 64x64 (radius, half side, circumradius; default "
            + format_sizes(PROMPT_SIZES)
            + ")"
        ),
    ] = None,
    late_steps: Annotated[
        int | None,
        typer.Option(
            help=f"steps of the late stage (default {LATE_STEPS}; 0: none, as the weights before 2026-12-06)"
        ),
    ] = None,
) -> None:
    """Retrain the demo model from scratch (measured CPU wall clock in OUT/train_log.json)."""
    with reported_errors("train-demo", ctx):
        sizes = check_train_demo(out, seed, threads, autoencoder, prompt_speed, late_steps, prompt_sizes)
        from dataclasses import replace

        from rolling_forcing.demo.train import default_late, train_demo

        rep = train_demo(
            out,
            seed,
            smoke=smoke,
            threads=threads,
            progress=progress,
            autoencoder=autoencoder,
            prompt_speed=prompt_speed,
            prompt_sizes=sizes,
            late=None if late_steps is None else replace(default_late(smoke), steps=late_steps),
        )
        typer.echo(
            f"train-demo: wrote {', '.join(p.name for p in rep.files)} to {out} (measured: autoencoder "
            f"{rep.ae_seconds:.0f} s, clips {rep.clips_seconds:.0f} s, DiT {rep.dit_seconds:.0f} s + stage 2 "
            f"{rep.stage2_seconds:.0f} s + late {rep.late_seconds:.0f} s)"
        )


__all__ = ["check_train_demo", "train_demo_cmd"]
