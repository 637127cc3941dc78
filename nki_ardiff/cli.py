"""``rolling-forcing`` command line (typer): ``generate``, ``plan``, ``train-demo``, ``serve``,
``bench kernels|e2e``.

``rolling-forcing generate --seconds 10 --out demo.mp4`` streams a video on CPU with no download: the
shipped trained demo model (``--preset demo``, the default: DiT, text encoder and autoencoder of
:mod:`rolling_forcing.demo`); ``--preset tiny`` uses random seeded weights for the tiny DiT, seeded
prompt embeddings and the preview decoder (see :mod:`rolling_forcing.decode`). It writes an MP4 chunk
by chunk and prints the per-chunk latency report against the real-time deadline (all figures
*measured*, CPU wall clock). Real weights come in
through ``--checkpoint`` (Wan / RF / diffusers key layouts), ``--vae`` (diffusers ``AutoencoderKLWan``
directory), ``--text-encoder`` (umT5 directory) or ``--prompt-embeds`` (``.safetensors``). Local paths
only.

Layout: the options record and its command line (:mod:`nki_ardiff.cli_options`), the checks that run
before any model is built (:mod:`nki_ardiff.cli_checks`), the run itself
(:mod:`nki_ardiff.cli_run`), error reporting (:mod:`nki_ardiff.cli_errors`), the live server
(:mod:`nki_ardiff.cli_serve`) and the benchmarks (:mod:`nki_ardiff.cli_bench`). Subcommands are
registered from the tables at the end of this file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from nki_ardiff.cli_bench import bench_app
from nki_ardiff.cli_checks import MAX_SECONDS
from nki_ardiff.cli_errors import click_exceptions, fail, reported_errors, usage_error_line
from nki_ardiff.cli_options import (
    Backend,
    DType,
    GenerateOptions,
    Method,
    Noise,
    Positions,
    Preset,
    Switch,
    command_line,
)
from nki_ardiff.cli_run import run_generate
from nki_ardiff.cli_serve import serve
from nki_ardiff.cli_train import train_demo_cmd

app = typer.Typer(
    name="rolling-forcing",
    help="Rolling Forcing streaming video generation (Wan2.1 causal DiT) with NKI kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 80},
)


def _version_callback(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("nki-ardiff")
        except PackageNotFoundError:  # a source checkout on PYTHONPATH, not installed
            v = "unknown (not installed)"
        typer.echo(f"rolling-forcing (nki-ardiff) {v}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="print the version and exit"
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option("--debug", help="show tracebacks instead of one error line (or NKI_ARDIFF_DEBUG=1)"),
    ] = False,
) -> None:
    """Rolling Forcing streaming video generation (Wan2.1 causal DiT) with NKI kernels."""


def generate(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", "-o", help="output .mp4 path")] = Path("demo.mp4"),
    preset: Annotated[
        Preset, typer.Option(help="model preset (demo: the shipped trained model; tiny: random weights)")
    ] = Preset.demo,
    seconds: Annotated[
        float, typer.Option(help=f"video length, rounded up to whole blocks; finite, <= {MAX_SECONDS:g}")
    ] = 10.0,
    blocks: Annotated[
        int | None, typer.Option(help="number of 3-latent-frame blocks (overrides --seconds)")
    ] = None,
    prompt: Annotated[str, typer.Option(help="text prompt")] = GenerateOptions.prompt,
    seed: Annotated[int, typer.Option(help="seed of the noise (and of the tiny preset's weights)")] = 0,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            help="DiT weights: .safetensors (preferred), shard dir or weights-only .pt; "
            "--preset demo: the directory train-demo --out wrote"
        ),
    ] = None,
    use_ema: Annotated[bool, typer.Option(help="RF training checkpoint: use generator_ema")] = False,
    vae: Annotated[
        Path | None, typer.Option(help="local diffusers AutoencoderKLWan directory (hf extra)")
    ] = None,
    text_encoder: Annotated[
        Path | None, typer.Option(help="local umT5 directory (transformers; hf extra)")
    ] = None,
    prompt_embeds: Annotated[
        Path | None, typer.Option(help="precomputed [1, text_len, text_dim] embeddings (.safetensors)")
    ] = None,
    backend: Annotated[
        Backend,
        typer.Option(envvar="NKI_ARDIFF_BACKEND", help="kernel backend for rope/attention/KV cache"),
    ] = Backend.reference,
    positions: Annotated[
        Positions, typer.Option(help="RoPE positions: absolute (original, <= 1024 frames) or relative")
    ] = Positions.absolute,
    dtype: Annotated[DType, typer.Option(help="weights and activations dtype")] = DType.float32,
    report_json: Annotated[
        Path | None, typer.Option(help="write the latency report as JSON (.json, not --out)")
    ] = None,
    progress: Annotated[
        bool | None, typer.Option(help="progress bars on stderr (default: only on a terminal)")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no bars or tables, only the result")] = False,
    threads: Annotated[
        int | None, typer.Option(help="torch CPU threads (default: 1 for tiny and demo, else torch's)")
    ] = None,
    warmup: Annotated[
        bool, typer.Option(help="run an untimed minimal stream first (one-time costs out of the report)")
    ] = True,
    cores: Annotated[
        int, typer.Option(help="ranks (CPU processes) sharing each forward, TP x SP (sharding.pipeline)")
    ] = 1,
    merged: Annotated[
        bool | None,
        typer.Option(
            "--merged/--two-pass",
            help="one static-shape forward per chunk, or the original's two passes "
            "(default: merged where the backend has the block-table attention)",
        ),
    ] = None,
    compile: Annotated[
        bool, typer.Option(help="torch.compile(fullgraph=True) the merged forward (inductor; merged only)")
    ] = False,
    method: Annotated[
        Method, typer.Option(help="streaming loop (docs/methods.md); the sequential ones run two-pass")
    ] = Method.rolling_forcing,
    lora: Annotated[
        Path | None, typer.Option(help="PEFT LoRA file merged into --checkpoint at load (LongLive's lora.pt)")
    ] = None,
    prompt_schedule: Annotated[
        Path | None,
        typer.Option(help='LongLive prompt JSONL ({"prompts": [...]} per line; the first line is used)'),
    ] = None,
    switch_frames: Annotated[
        str | None, typer.Option(help="latent frames where prompts 2.. start, e.g. '40,80' (LongLive's)")
    ] = None,
    noise: Annotated[
        Noise,
        typer.Option(
            help="initial noise: auto = up front (the original's RNG order) while the stream fits the "
            "absolute RoPE table, per block beyond (constant memory)"
        ),
    ] = Noise.auto,
    guidance: Annotated[
        float | None,
        typer.Option(
            help="classifier-free guidance scale, >= 1 (1: none; default: the preset's, 3 on the three "
            "noisiest levels for demo, 1 for the others)"
        ),
    ] = None,
    switch: Annotated[
        Switch | None,
        typer.Option(
            help="how the --prompt-schedule switches are taken: continue the stream, recache its KV cache "
            "(LongLive), or restart the stream under the new prompt (default: restart for demo, the "
            "method's original for the others)"
        ),
    ] = None,
) -> None:
    """Stream a video and print the per-chunk latency report (measured, CPU wall clock)."""
    opts = GenerateOptions(
        out=out, preset=preset.value, seconds=seconds, blocks=blocks, prompt=prompt, seed=seed,
        checkpoint=checkpoint, use_ema=use_ema, vae=vae, text_encoder=text_encoder,
        prompt_embeds=prompt_embeds, backend=backend.value, positions=positions.value, dtype=dtype.value,
        report_json=report_json, progress=progress, quiet=quiet, threads=threads, warmup=warmup,
        cores=cores, merged=merged, compile=compile, method=method.value, lora=lora,
        prompt_schedule=prompt_schedule, switch_frames=switch_frames, noise=noise.value, guidance=guidance,
        switch=None if switch is None else switch.value,
    )  # fmt: skip
    with reported_errors("generate", ctx):
        run_generate(opts, echo=typer.echo)


def plan(
    preset: Annotated[Preset, typer.Option(help="model preset, as for generate")] = Preset.tiny,
    cores: Annotated[int, typer.Option(help="NeuronCores (ranks), as for generate --cores")] = 8,
    dtype: Annotated[
        DType, typer.Option(help="weights and activations dtype, as for generate")
    ] = DType.float32,
) -> None:
    """Print the TP x SP plan of generate's stream on --cores and its alternatives (modelled comm).

    The layout is the one generate --preset P --cores N --dtype D runs: both take it from
    sharding.pipeline.pipeline_plan on the preset's stream shape.
    """
    from rolling_forcing.config import PipelineConfig, get_preset
    from sharding.pipeline import pipeline_plan
    from sharding.plan import plan_table

    try:
        model_cfg = get_preset(preset.value)
        p = pipeline_plan(model_cfg, PipelineConfig(dtype=dtype.value), cores)
        typer.echo(plan_table(p.num_heads, cores, shape=p.shape, model=p.model))
    except (ValueError, TypeError) as exc:
        raise fail("--cores", str(exc).replace("num_cores", "--cores")) from exc


# Subcommands: name -> function (commands) and name -> typer app (groups). Registering one more is one line.
COMMANDS: dict[str, Callable[..., Any]] = {
    "generate": generate,
    "plan": plan,
    "train-demo": train_demo_cmd,
    "serve": serve,  # nki_ardiff/cli_serve.py (needs the serve extra only when run)
}
GROUPS: dict[str, typer.Typer] = {"bench": bench_app}
for _name, _fn in COMMANDS.items():
    app.command(_name)(_fn)
for _name, _group in GROUPS.items():
    app.add_typer(_group, name=_name)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point ``rolling-forcing``: exits 0, or 2 with one ``error:`` line for a usage error.

    Click's own usage errors (unknown option, a value not in a choice list, a non-number) are printed as
    one ``error: <option>: <rule>`` line too, instead of click's three-line usage block.
    """
    exc_mod = click_exceptions()
    args = list(argv) if argv is not None else sys.argv[1:]
    try:
        rv = app(args=args, prog_name="rolling-forcing", standalone_mode=False)
    except exc_mod.NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help() if exc.ctx is not None else str(exc))
        raise SystemExit(0) from None
    except exc_mod.UsageError as exc:
        sys.stderr.write(usage_error_line(exc) + "\n")
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:
        sys.stderr.write("aborted\n")
        raise SystemExit(130) from None
    raise SystemExit(rv if isinstance(rv, int) else 0)


__all__ = ["COMMANDS", "GROUPS", "GenerateOptions", "app", "command_line", "main", "run_generate"]

if __name__ == "__main__":  # pragma: no cover
    main()
