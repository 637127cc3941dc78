"""``rolling-forcing`` command line (typer): ``generate``, ``plan``, ``bench kernels``, ``bench e2e``.

``rolling-forcing generate --preset tiny --seconds 10 --out demo.mp4`` streams a video on CPU with no
download: random seeded weights for the tiny DiT, seeded prompt embeddings and the preview decoder
(see :mod:`rolling_forcing.decode`), writes an MP4 chunk by chunk and prints the per-chunk latency
report against the real-time deadline (all figures *measured*, CPU wall clock). Real weights come in
through ``--checkpoint`` (Wan / RF / diffusers key layouts), ``--vae`` (diffusers ``AutoencoderKLWan``
directory), ``--text-encoder`` (umT5 directory) or ``--prompt-embeds`` (``.safetensors``). Local paths
only.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from rolling_forcing.serve.command import register_serve

app = typer.Typer(
    name="rolling-forcing",
    help="Rolling Forcing streaming video generation (Wan2.1 causal DiT) with NKI kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
bench_app = typer.Typer(help="Benchmarks (perf/): kernels on the emulator + cost model, end-to-end model.")
app.add_typer(bench_app, name="bench")
register_serve(app)


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
) -> None:
    """Rolling Forcing streaming video generation (Wan2.1 causal DiT) with NKI kernels."""


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


@dataclass(frozen=True)
class GenerateOptions:
    """Everything ``generate`` needs; the typer command only fills this in."""

    out: Path
    preset: str = "tiny"
    seconds: float = 10.0
    blocks: int | None = None
    prompt: str = "a red fox running through fresh snow, cinematic"
    seed: int = 0
    checkpoint: Path | None = None
    use_ema: bool = False
    vae: Path | None = None
    text_encoder: Path | None = None
    prompt_embeds: Path | None = None
    backend: str = "reference"
    positions: str = "absolute"
    dtype: str = "float32"
    report_json: Path | None = None
    progress: bool = True
    threads: int | None = None
    warmup: bool = True
    cores: int = 1
    merged: bool | None = None
    compile: bool = False
    method: str = "rolling-forcing"
    lora: Path | None = None
    prompt_schedule: Path | None = None
    switch_frames: str | None = None


def command_line(opts: GenerateOptions) -> str:
    """The ``rolling-forcing generate`` command that reproduces ``opts`` (recorded in the report)."""
    import shlex

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
    ):
        if value is not None:
            parts += [flag, str(value)]
    parts += ["--use-ema"] if opts.use_ema else []
    parts += [] if opts.warmup else ["--no-warmup"]
    parts += ["--cores", str(opts.cores)] if opts.cores != 1 else []
    parts += [] if opts.merged is None else ["--merged" if opts.merged else "--two-pass"]
    parts += ["--compile"] if opts.compile else []
    parts += ["--method", opts.method] if opts.method != "rolling-forcing" else []
    return shlex.join(parts)


def _fail(msg: str) -> typer.Exit:
    typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
    return typer.Exit(code=2)


def _build_text(opts: GenerateOptions, model_cfg: Any) -> tuple[Any, str]:
    from rolling_forcing import text as text_mod

    if opts.prompt_embeds is not None and opts.text_encoder is not None:
        raise ValueError("give at most one of --prompt-embeds and --text-encoder")
    if opts.prompt_embeds is not None:
        emb = text_mod.load_prompt_embeds(opts.prompt_embeds, model_cfg.text_len, model_cfg.text_dim, batch=1)
        return emb, f"precomputed embeddings {opts.prompt_embeds}"
    if opts.text_encoder is not None:
        enc = text_mod.UMT5TextEncoder(opts.text_encoder, model_cfg.text_len)
        emb = enc.encode([opts.prompt])
        return text_mod.validate_prompt_embeds(
            emb, model_cfg.text_len, model_cfg.text_dim, batch=1, name="umT5 output"
        ), f"umT5 from {opts.text_encoder}"
    if opts.preset != "tiny":
        raise ValueError(
            f"preset {opts.preset!r} needs real text conditioning: pass --text-encoder DIR (umT5) or "
            f"--prompt-embeds FILE.safetensors (seeded embeddings are only for the tiny preset)"
        )
    enc_s = text_mod.SeededTextEncoder(model_cfg.text_len, model_cfg.text_dim)
    return enc_s.encode([opts.prompt]), "seeded embeddings (tiny preset; SHA-256 of the prompt)"


def _build_decoder(opts: GenerateOptions, model_cfg: Any, spec: Any) -> tuple[Any, str]:
    from rolling_forcing.decode import PreviewDecoder, WanVAEStreamingDecoder

    if opts.vae is not None:
        dec = WanVAEStreamingDecoder.from_pretrained(opts.vae)
        if dec.channels != model_cfg.out_channels:
            raise ValueError(
                f"--vae has z_dim={dec.channels} but the model outputs {model_cfg.out_channels} channels"
            )
        return dec, f"AutoencoderKLWan from {opts.vae} (streaming, causal cache)"
    dec_p = PreviewDecoder(
        model_cfg.out_channels,
        spatial_stride=spec.spatial_stride,
        temporal_stride=spec.temporal_stride,
        seed=opts.seed,
    )
    return dec_p, "preview decoder (fixed linear latent->RGB, not a trained VAE)"


def _read_schedule(opts: GenerateOptions) -> Any:
    """The --prompt-schedule of ``opts`` (None without one), checked before any model is built."""
    from rolling_forcing.prompts import parse_switch_frames, read_prompt_schedule

    if opts.prompt_schedule is None:
        if opts.switch_frames is not None:
            raise ValueError("--switch-frames needs --prompt-schedule")
        return None
    if opts.prompt_embeds is not None:
        raise ValueError("--prompt-schedule encodes its prompts: it cannot be combined with --prompt-embeds")
    sw = None if opts.switch_frames is None else parse_switch_frames(opts.switch_frames)
    return read_prompt_schedule(opts.prompt_schedule, sw)


def _check_sequential(opts: GenerateOptions, method: Any, num_blocks: int) -> None:
    """Refuse what a sequential method (Self-Forcing, CausVid, LongLive) cannot run, before any build."""
    from rolling_forcing.sequential import check_length

    if opts.compile:
        raise ValueError(
            f"--compile: generate compiles --method rolling-forcing only; drop it with --method "
            f"{method.name} (--merged batches each block's cache update; the static, compilable sequential "
            "forward is RollingForcingPipeline(static=True))"
        )
    if opts.merged and opts.cores != 1:
        raise ValueError(f"--merged with --method {method.name} runs on one core only (--cores 1)")
    check_length(method, num_blocks, opts.positions)


def run_generate(opts: GenerateOptions, *, echo: Any = print) -> dict[str, Any]:
    """Stream a video to ``opts.out`` and return the JSON report dict (also written to ``report_json``).

    The torch intra-op thread count chosen for the run is restored afterwards (no lasting side effect
    when called in-process, e.g. from tests).
    """
    import torch

    saved_threads = torch.get_num_threads()
    try:
        return _run_generate(opts, echo)
    finally:
        torch.set_num_threads(saved_threads)


def _run_generate(opts: GenerateOptions, echo: Any) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from rolling_forcing.checkpoint import load_checkpoint
    from rolling_forcing.config import PipelineConfig, get_preset
    from rolling_forcing.decode import to_uint8_frames
    from rolling_forcing.methods import get_method
    from rolling_forcing.model import CausalWanModel
    from rolling_forcing.pipeline import RollingForcingPipeline
    from rolling_forcing.report import ChunkTimer, deadline_s
    from rolling_forcing.video import VideoSpec, VideoWriter

    # The tiny preset's matrices are too small to gain from intra-op threads; on a shared machine extra
    # threads only add contention (measured p50 chunk latency: 71 ms with 1 thread vs 153 ms with 2).
    threads = opts.threads if opts.threads is not None else (1 if opts.preset == "tiny" else None)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    # Other processes on the machine distort wall-clock figures: record the load next to them.
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    model_cfg = get_preset(opts.preset)
    method = get_method(opts.method)  # every check below runs before any model is built
    pipe_cfg = PipelineConfig(dtype=opts.dtype, positions=opts.positions)
    spec = VideoSpec()
    num_blocks = (
        opts.blocks
        if opts.blocks is not None
        else spec.blocks_for_seconds(opts.seconds, pipe_cfg.frames_per_block)
    )
    warm_blocks = pipe_cfg.window_blocks
    if method.sequential:
        _check_sequential(opts, method, num_blocks)
        warm_blocks = 1
    elif num_blocks < pipe_cfg.window_blocks:
        min_s = spec.video_frames(pipe_cfg.window_blocks, pipe_cfg.frames_per_block) / spec.fps
        raise ValueError(
            f"the stream needs at least window_blocks={pipe_cfg.window_blocks} blocks (Rolling Forcing's "
            f"window schedule breaks with fewer); got {num_blocks} blocks - ask for --seconds >= {min_s:g} "
            f"or --blocks >= {pipe_cfg.window_blocks}"
        )
    schedule = _read_schedule(opts)
    if opts.lora is not None and opts.checkpoint is None:
        raise ValueError("--lora needs --checkpoint (the base weights the LoRA is merged into)")
    if opts.checkpoint is None and opts.preset != "tiny":
        raise ValueError(
            f"preset {opts.preset!r} needs --checkpoint (random weights only for the tiny preset)"
        )

    torch.manual_seed(opts.seed)
    model = CausalWanModel(model_cfg)
    weights = f"random (torch.manual_seed({opts.seed}))"
    if opts.checkpoint is not None:
        fmt = load_checkpoint(model, opts.checkpoint, use_ema=opts.use_ema, lora=opts.lora)
        weights = f"{opts.checkpoint} ({fmt} key layout{', EMA' if opts.use_ema else ''})"
        weights += f" + LoRA {opts.lora} merged" if opts.lora is not None else ""
    model = model.to(pipe_cfg.torch_dtype).eval()

    text_embeds, text_src = _build_text(opts, model_cfg)
    switches: dict[int, Any] = {}  # block -> embeddings of the prompt that starts there
    if schedule is not None:
        segs = schedule.segments(pipe_cfg.frames_per_block, num_blocks)
        switches = {b: _build_text(replace(opts, prompt=p), model_cfg)[0] for b, p in segs[1:]}
        text_embeds = _build_text(replace(opts, prompt=segs[0][1]), model_cfg)[0]
        starts = [b for b, _ in segs]
        text_src += f"; prompt schedule {opts.prompt_schedule}: segments start at blocks {starts}"
    decoder, dec_src = _build_decoder(opts, model_cfg, spec)
    pipe: Any
    if opts.cores != 1 and opts.compile:
        raise ValueError(
            "--compile applies to the single-process pipeline: the sharded stream (--cores > 1) runs "
            "eager forwards on its ranks; drop --compile or use --cores 1"
        )
    if opts.cores != 1:  # TP x SP over spawned CPU ranks (sharding.pipeline); rank 0 streams the chunks
        from sharding.pipeline import ShardedRollingForcingPipeline

        pipe = ShardedRollingForcingPipeline(
            model, model_cfg, pipe_cfg, cores=opts.cores, backend=opts.backend, positions=opts.positions,
            merged=opts.merged, method=method,
        )  # fmt: skip
        echo(f"sharded over {opts.cores} ranks (gloo, spawned processes): plan {pipe.plan.name}")
    else:
        pipe = RollingForcingPipeline(
            model, model_cfg, pipe_cfg, backend=opts.backend, positions=opts.positions,
            merged=opts.merged, compile=True if opts.compile else None, method=method,
        )  # fmt: skip
    generator = torch.Generator().manual_seed(opts.seed)

    total_frames = spec.video_frames(num_blocks, pipe_cfg.frames_per_block)
    echo(
        f"rolling-forcing generate: preset={opts.preset} blocks={num_blocks} "
        f"({total_frames} frames = {total_frames / spec.fps:.2f} s at {spec.fps:g} fps) "
        f"method={method.name} backend={opts.backend} positions={opts.positions} dtype={opts.dtype}\n"
        f"  forward: {'merged (1 per chunk)' if getattr(pipe, 'merged', False) else 'two-pass'}"
        f"{', torch.compile' if opts.compile else ''}\n"
        f"  weights: {weights}\n  text: {text_src}\n  decoder: {dec_src}\n  out: {opts.out}"
    )
    deadline = deadline_s(pipe_cfg.frames_per_block, spec.temporal_stride, spec.fps)
    if opts.warmup:
        # One untimed minimal stream (window_blocks blocks, other seed) so one-time costs (lazy op
        # registration, allocator growth, first-call dispatch) do not land in the first chunk's latency.
        t0 = time.perf_counter()
        with torch.inference_mode():
            warm_gen = torch.Generator().manual_seed(opts.seed + 1)
            for chunk in pipe.stream(text_embeds.to(pipe_cfg.torch_dtype), warm_blocks, generator=warm_gen):
                decoder.decode(chunk.latents.float())
        echo(
            f"warm-up stream ({warm_blocks} blocks, not in the report): measured "
            f"{time.perf_counter() - t0:.2f} s wall clock"
        )
    decoder.reset()
    timer = ChunkTimer()
    bar = tqdm(total=num_blocks, unit="chunk", desc="streaming", disable=not opts.progress, file=sys.stderr)
    with torch.inference_mode(), VideoWriter(opts.out, spec.fps) as writer:
        if opts.cores != 1:  # the sharded stream takes its switches up front, at the window they act
            for b, emb in switches.items():
                w = b * method.steps if method.sequential else b + pipe_cfg.window_blocks - 1
                pipe.set_prompt(emb.to(pipe_cfg.torch_dtype), method.recache == "window", window=w)
        stream = pipe.stream(text_embeds.to(pipe_cfg.torch_dtype), num_blocks, generator=generator)
        t_prev = time.perf_counter()
        for chunk in stream:
            t_gen = time.perf_counter()
            video = decoder.decode(chunk.latents.float())
            t_dec = time.perf_counter()
            frames = to_uint8_frames(video)
            writer.write(frames)
            t_wr = time.perf_counter()
            timer.add(
                int(chunk.block),
                frames.shape[0],
                generate_s=t_gen - t_prev,
                decode_s=t_dec - t_gen,
                write_s=t_wr - t_dec,
            )
            bar.update(1)
            if opts.cores == 1 and chunk.block + 1 in switches:  # LongLive re-caches; others: text k/v
                emb = switches[chunk.block + 1].to(pipe_cfg.torch_dtype)
                pipe.set_prompt(emb, recache=method.recache == "window")
            t_prev = time.perf_counter()
    bar.close()
    if writer.frames_written != total_frames:
        raise RuntimeError(f"wrote {writer.frames_written} frames, expected {total_frames}")
    meta = {
        "command": command_line(opts),
        "preset": opts.preset,
        "method": method.name,
        "num_blocks": num_blocks,
        "backend": opts.backend,
        "positions": opts.positions,
        "dtype": opts.dtype,
        "seed": opts.seed,
        "weights": weights,
        "text": text_src,
        "decoder": dec_src,
        "out": str(opts.out),
        "torch_threads": torch.get_num_threads(),
        "warmup": opts.warmup,
        "cores": opts.cores,
        "merged": bool(getattr(pipe, "merged", False)),
        "merged_option": opts.merged,
        "compile": opts.compile,
        "cpu_count": os.cpu_count(),
        "loadavg_1m_at_start": load_at_start,
    }
    report = timer.report(deadline, spec.fps, meta)
    echo(report.format_table())
    echo(
        f"machine: {meta['cpu_count']} CPUs, torch threads {meta['torch_threads']}, 1-min load average at "
        f"start {load_at_start} (wall-clock figures include any contention)"
    )
    if opts.report_json is not None:
        report.write_json(opts.report_json)
        echo(f"report written to {opts.report_json}")
    echo(f"video written to {opts.out} ({writer.frames_written} frames)")
    return report.to_json_dict()


@app.command()
def generate(
    out: Annotated[Path, typer.Option("--out", "-o", help="output .mp4 path")] = Path("demo.mp4"),
    preset: Annotated[str, typer.Option(help="model preset: tiny | wan2.1-1.3b")] = "tiny",
    seconds: Annotated[float, typer.Option(help="video length; rounded up to whole blocks")] = 10.0,
    blocks: Annotated[
        int | None, typer.Option(help="number of 3-latent-frame blocks (overrides --seconds)")
    ] = None,
    prompt: Annotated[str, typer.Option(help="text prompt")] = GenerateOptions.prompt,
    seed: Annotated[int, typer.Option(help="seed of the noise (and of the tiny preset's weights)")] = 0,
    checkpoint: Annotated[
        Path | None, typer.Option(help="DiT weights: .safetensors (preferred), shard dir or weights-only .pt")
    ] = None,
    use_ema: Annotated[bool, typer.Option(help="RF training checkpoint: use generator_ema")] = False,
    vae: Annotated[Path | None, typer.Option(help="local diffusers AutoencoderKLWan directory")] = None,
    text_encoder: Annotated[Path | None, typer.Option(help="local umT5 directory (transformers)")] = None,
    prompt_embeds: Annotated[
        Path | None, typer.Option(help="precomputed [1, text_len, text_dim] embeddings (.safetensors)")
    ] = None,
    backend: Annotated[
        Backend, typer.Option(help="kernel backend for rope/attention/KV cache")
    ] = Backend.reference,
    positions: Annotated[Positions, typer.Option(help="RoPE positions: absolute (original) or relative")] = (
        Positions.absolute
    ),
    dtype: Annotated[DType, typer.Option(help="weights and activations dtype")] = DType.float32,
    report_json: Annotated[Path | None, typer.Option(help="write the latency report as JSON")] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
    threads: Annotated[
        int | None, typer.Option(help="torch CPU threads (default: 1 for the tiny preset, else torch's)")
    ] = None,
    warmup: Annotated[
        bool,
        typer.Option(help="run an untimed minimal stream first so one-time costs stay out of the report"),
    ] = True,
    cores: Annotated[
        int, typer.Option(help="ranks (CPU processes) sharing each forward, TP x SP (sharding.pipeline)")
    ] = 1,
    merged: Annotated[
        bool | None,
        typer.Option(
            "--merged/--two-pass",
            help="one static-shape forward per chunk, or the original's two passes "
            "(default: merged where the backend has the block-table attention, i.e. reference)",
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
) -> None:
    """Stream a video and print the per-chunk latency report (measured, CPU wall clock)."""
    opts = GenerateOptions(
        out=out,
        preset=preset,
        seconds=seconds,
        blocks=blocks,
        prompt=prompt,
        seed=seed,
        checkpoint=checkpoint,
        use_ema=use_ema,
        vae=vae,
        text_encoder=text_encoder,
        prompt_embeds=prompt_embeds,
        backend=backend.value,
        positions=positions.value,
        dtype=dtype.value,
        report_json=report_json,
        progress=progress,
        threads=threads,
        warmup=warmup,
        cores=cores,
        merged=merged,
        compile=compile,
        method=method.value,
        lora=lora,
        prompt_schedule=prompt_schedule,
        switch_frames=switch_frames,
    )
    try:
        run_generate(opts, echo=typer.echo)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError) as exc:
        raise _fail(str(exc)) from exc


@app.command()
def plan(
    preset: Annotated[str, typer.Option(help="model preset, as for generate")] = GenerateOptions.preset,
    cores: Annotated[int, typer.Option(help="NeuronCores (ranks), as for generate --cores")] = 8,
    dtype: Annotated[
        DType, typer.Option(help="weights and activations dtype, as for generate")
    ] = DType.float32,
) -> None:
    """Print the TP x SP plan of generate's stream on --cores and its alternatives (modelled comm).

    The layout is the one generate --preset P --cores N --dtype D runs: both take it from
    sharding.pipeline.pipeline_plan on the preset's stream shape.
    """
    try:
        from rolling_forcing.config import PipelineConfig, get_preset
        from sharding.pipeline import pipeline_plan
        from sharding.plan import plan_table
    except ImportError as exc:
        raise _fail(f"sharding is not available ({exc})") from exc
    try:
        model_cfg = get_preset(preset)
        p = pipeline_plan(model_cfg, PipelineConfig(dtype=dtype.value), cores)
        typer.echo(plan_table(p.num_heads, cores, shape=p.shape, model=p.model))
    except (ValueError, TypeError) as exc:
        raise _fail(str(exc).replace("num_cores", "--cores")) from exc


_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _run_module_main(module: str, args: Sequence[str]) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            raise _fail(
                f"{module} is not available in this checkout ({exc}); see perf/ in the README"
            ) from exc
        raise
    main_fn = getattr(mod, "main", None)
    if main_fn is None:
        raise _fail(f"{module} has no main() entry point")
    result = main_fn(list(args))
    # a benchmark's main() returns its exit status (an int) or what it produced (rows: success)
    if isinstance(result, int) and not isinstance(result, bool) and result != 0:
        raise typer.Exit(code=result)


@bench_app.command("kernels", context_settings=_PASS_THROUGH)
def bench_kernels(ctx: typer.Context) -> None:
    """Kernel benchmarks (``perf.bench_kernels``); extra arguments are passed through."""
    _run_module_main("perf.bench_kernels", ctx.args)


@bench_app.command("e2e", context_settings=_PASS_THROUGH)
def bench_e2e(ctx: typer.Context) -> None:
    """End-to-end model (``perf.e2e``); extra arguments are passed through."""
    _run_module_main("perf.e2e", ctx.args)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point ``rolling-forcing``."""
    app(args=list(argv) if argv is not None else None, prog_name="rolling-forcing")


if __name__ == "__main__":  # pragma: no cover
    main()
