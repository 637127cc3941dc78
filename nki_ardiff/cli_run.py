"""The body of ``rolling-forcing generate``: build, warm up, stream, write; nothing lost or half-written.

Order: :func:`nki_ardiff.cli_checks.check_generate` (every option, before any build), then the model,
weights, text conditioning and decoder (each load error names its option), the warm-up stream and the
timed stream. Outputs:

* the MP4 is written to a hidden temporary file in the target directory (``.demo.<pid>.tmp.mp4``) and
  renamed to ``--out`` only when the stream is complete; the JSON report likewise (temporary file, then
  rename), so a reader never sees a half-written file at a final path;
* on Ctrl-C (SIGINT) or SIGTERM the frames written so far are kept as ``demo.partial.mp4`` (a name that
  cannot be mistaken for a finished run; minutes of streamed video are not thrown away), the report is
  written with ``"interrupted": true`` and :class:`Interrupted` is raised (exit 130 / 143);
* a runtime failure (a non-finite latent, a rank that dies) removes the temporary video and writes the
  report with ``"error"``; a SIGKILL can leave only the hidden temporary file behind, never a file at
  ``--out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from nki_ardiff.cli_checks import CliError, RunPlan, check_generate
from nki_ardiff.cli_options import GenerateOptions, command_line, default_switch


class Interrupted(Exception):
    """The run was stopped by ``signum`` (SIGINT or SIGTERM); outputs were finalised before raising."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Received:
    """The first SIGINT/SIGTERM seen (a library may wrap the :class:`Interrupted` it raised, e.g. the
    video writer's pipe turns it into ``OSError``; this record still tells the run it was stopped)."""

    signum: int | None = None


class _Deferral:
    """Critical sections (:func:`_signals_deferred`) in progress and the signal that arrived during one.

    Python runs signal handlers in the main thread, but the OS may deliver a process-directed signal to
    any thread that does not block it (torch's and the video writer's threads), so masking the main
    thread alone does not keep a handler out of a critical section: the handler itself must defer."""

    depth: int = 0
    pending: int | None = None


_DEFER = _Deferral()


@contextlib.contextmanager
def _signals_raise() -> Iterator[_Received]:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread while the block runs."""
    got = _Received()
    if sys.platform == "win32" or not _in_main_thread():
        yield got
        return

    def handler(signum: int, frame: Any) -> None:
        if got.signum is None:
            got.signum = signum
        if _DEFER.depth > 0:  # inside a critical section: raise when it ends
            if _DEFER.pending is None:
                _DEFER.pending = signum
            return
        raise Interrupted(signum)

    saved = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _signals_deferred(raise_pending: bool = True) -> Iterator[None]:
    """A critical section: a SIGINT/SIGTERM arriving inside it takes effect when it ends (a chunk's frames
    and its report row, or the outputs' renames and the report, happen whole or not at all).

    ``raise_pending``: raise :class:`Interrupted` at the end if a signal arrived (the run stops there);
    ``False`` for the final write-out, after which the run ends anyway (the signal stays recorded)."""
    if sys.platform == "win32" or not _in_main_thread():
        yield
        return
    _DEFER.depth += 1
    try:
        yield
    finally:
        _DEFER.depth -= 1
        if _DEFER.depth == 0 and _DEFER.pending is not None:
            signum, _DEFER.pending = _DEFER.pending, None
            if raise_pending:
                raise Interrupted(signum)


def _stop_signal(exc: BaseException, got: _Received) -> int | None:
    """The signal that stopped the run, or None when ``exc`` is a failure.

    The handler's record first; else an :class:`Interrupted` (its signal) or a ``KeyboardInterrupt``
    (SIGINT) that ``exc`` is or wraps anywhere in its ``__cause__`` / ``__context__`` chain (a library may
    turn a stop into its own exception, e.g. an ``OSError`` from a pipe write)."""
    if got.signum is not None:
        return got.signum
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, Interrupted):
            return e.signum
        if isinstance(e, KeyboardInterrupt):
            return int(signal.SIGINT)
        todo += [e.__context__, e.__cause__]
    return None


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def temporary_path(path: Path) -> Path:
    """The hidden temporary file ``path`` is written to before the rename (same directory, same suffix)."""
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    try:
        tmp.write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run_generate(opts: GenerateOptions, *, echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Stream a video to ``opts.out`` and return the JSON report dict (also written to ``report_json``).

    Raises :class:`~nki_ardiff.cli_checks.CliError` for anticipated failures (before any build for
    option errors) and :class:`Interrupted` after SIGINT/SIGTERM (outputs finalised as described in the
    module docstring). The torch intra-op thread count is restored afterwards (no lasting side effect when
    called in-process, e.g. from tests).
    """
    import torch

    plan = check_generate(opts)
    saved_threads = torch.get_num_threads()
    try:
        return _run_generate(opts, plan, echo)
    finally:
        torch.set_num_threads(saved_threads)


def _progress_on(opts: GenerateOptions) -> bool:
    if opts.quiet:
        return False
    return sys.stderr.isatty() if opts.progress is None else opts.progress


class _Phases:
    """One status line per build phase on stderr (with its measured wall clock) when progress is on."""

    def __init__(self, on: bool) -> None:
        self.on = on

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        t0 = time.perf_counter()
        if self.on:
            sys.stderr.write(f"{what} ...")
            sys.stderr.flush()
        yield
        if self.on:
            sys.stderr.write(f" {time.perf_counter() - t0:.1f} s\n")


def text_encoder_for(
    opts: GenerateOptions, model_cfg: Any, demo: Any = None
) -> tuple[Callable[[str], Any], str]:
    """The text conditioning ``generate`` (and ``serve``) use: ``encode(prompt)`` -> float32
    ``[1, text_len, text_dim]`` and its description. ``--prompt-embeds`` (the file, whatever the prompt),
    ``--text-encoder`` (umT5, loaded once), the demo preset's own encoder, else seeded embeddings. Load and
    encode errors are :class:`CliError` naming the option."""
    from rolling_forcing import text as text_mod

    if opts.prompt_embeds is not None:
        try:
            emb = text_mod.load_prompt_embeds(
                opts.prompt_embeds, model_cfg.text_len, model_cfg.text_dim, batch=1
            )
        except (ValueError, TypeError, OSError) as exc:
            raise CliError("--prompt-embeds", str(exc)) from None
        return (lambda prompt: emb), f"precomputed embeddings {opts.prompt_embeds}"
    if opts.text_encoder is not None:
        try:
            enc = text_mod.UMT5TextEncoder(opts.text_encoder, model_cfg.text_len)
        except (ValueError, TypeError, OSError) as exc:
            raise CliError("--text-encoder", str(exc)) from None

        def umt5(prompt: str) -> Any:
            try:
                return text_mod.validate_prompt_embeds(
                    enc.encode([prompt]), model_cfg.text_len, model_cfg.text_dim, batch=1, name="umT5 output"
                )
            except (ValueError, TypeError, OSError) as exc:
                raise CliError("--text-encoder", str(exc)) from None

        return umt5, f"umT5 from {opts.text_encoder}"
    if demo is not None:
        flag = "--prompt-schedule" if opts.prompt_schedule is not None else "--prompt"

        def trained(prompt: str) -> Any:
            try:
                return demo.text_encoder.encode([prompt])
            except ValueError as exc:
                raise CliError(flag, f"demo preset: {exc}") from None

        return trained, "demo text encoder (trained with the DiT)"
    enc_s = text_mod.SeededTextEncoder(model_cfg.text_len, model_cfg.text_dim)
    return (lambda prompt: enc_s.encode([prompt])), "seeded embeddings (tiny preset; SHA-256 of the prompt)"


def _build_text(opts: GenerateOptions, model_cfg: Any, demo: Any = None) -> tuple[Any, str]:
    encode, src = text_encoder_for(opts, model_cfg, demo)
    return encode(opts.prompt), src


def _build_decoder(opts: GenerateOptions, model_cfg: Any, spec: Any, demo: Any = None) -> tuple[Any, str]:
    from rolling_forcing.decode import PreviewDecoder, WanVAEStreamingDecoder

    if demo is not None:
        return demo.decoder, "demo autoencoder (streaming decoder, trained)"

    if opts.vae is not None:
        try:
            dec = WanVAEStreamingDecoder.from_pretrained(opts.vae)
        except (ValueError, TypeError, OSError) as exc:
            raise CliError("--vae", str(exc)) from None
        if dec.channels != model_cfg.out_channels:
            raise CliError(
                "--vae", f"z_dim={dec.channels} but the model outputs {model_cfg.out_channels} channels"
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
    from rolling_forcing.prompts import parse_switch_frames, read_prompt_schedule

    if opts.prompt_schedule is None:
        return None
    try:
        sw = None if opts.switch_frames is None else parse_switch_frames(opts.switch_frames)
    except ValueError as exc:
        raise CliError("--switch-frames", str(exc)) from None
    try:
        return read_prompt_schedule(opts.prompt_schedule, sw)
    except (ValueError, OSError) as exc:
        raise CliError("--prompt-schedule", str(exc)) from None


def _load_demo(opts: GenerateOptions) -> Any:
    """The demo model (``rolling_forcing.demo.load_demo``): the shipped weights, or the ``train-demo``
    directory ``--checkpoint`` names (DiT at its width, its text encoder and autoencoder)."""
    from rolling_forcing.demo import load_demo

    try:
        return load_demo(opts.checkpoint)
    except (ValueError, OSError) as exc:
        if opts.checkpoint is not None:
            raise CliError("--checkpoint", f"demo preset: {exc}") from None
        raise CliError("--preset", f"demo: {exc}") from None


def demo_weights_text(opts: GenerateOptions, model_cfg: Any) -> str:
    """What the demo preset streams, for the report and the served page."""
    if opts.checkpoint is None:
        return "shipped demo weights"
    return (
        f"{opts.checkpoint} (train-demo weights: DiT {model_cfg.num_layers} layers x dim {model_cfg.dim}, "
        "with its text encoder and autoencoder)"
    )


def _load_weights(opts: GenerateOptions, model: Any) -> str:
    """Load ``--checkpoint`` into ``model`` (a preset other than demo, whose weights ``_load_demo``
    loads); returns the weights' description."""
    from rolling_forcing.checkpoint import load_checkpoint

    weights = f"random (torch.manual_seed({opts.seed}))"
    if opts.checkpoint is None:
        return weights
    try:
        fmt = load_checkpoint(model, opts.checkpoint, use_ema=opts.use_ema, lora=opts.lora)
    except (ValueError, TypeError, OSError, RuntimeError, EOFError) as exc:
        raise CliError("--checkpoint", str(exc)) from None
    weights = f"{opts.checkpoint} ({fmt} key layout{', EMA' if opts.use_ema else ''})"
    return weights + (f" + LoRA {opts.lora} merged" if opts.lora is not None else "")


def _check_finite(latents: Any, block: int) -> None:
    import torch

    if not bool(torch.isfinite(latents).all()):
        raise CliError(
            "generate",
            f"block {block} produced non-finite latents (NaN/inf): the weights or the prompt embeddings do "
            "not fit this model or dtype; stopped instead of writing a blank video",
            exit_code=1,
        )


def _run_generate(opts: GenerateOptions, plan: RunPlan, echo: Callable[[str], Any]) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from rolling_forcing.config import PipelineConfig, get_preset
    from rolling_forcing.decode import to_uint8_frames
    from rolling_forcing.guidance import guidance_text
    from rolling_forcing.methods import get_method
    from rolling_forcing.model import CausalWanModel
    from rolling_forcing.pipeline import RollingForcingPipeline
    from rolling_forcing.prompts import switch_options
    from rolling_forcing.report import ChunkTimer, deadline_s
    from rolling_forcing.stream import NoiseSource
    from rolling_forcing.video import VideoSpec, VideoWriter

    say: Callable[[str], Any] = (lambda s: None) if opts.quiet else echo
    bars = _progress_on(opts)
    phase = _Phases(bars)
    # The tiny preset's matrices are too small to gain from intra-op threads; on a shared machine extra
    # threads only add contention (measured p50 chunk latency: 71 ms with 1 thread vs 153 ms with 2).
    # Same for the demo preset (measured p50: 44 ms with 1 thread vs 52 ms with 2, docs/demo_model.md).
    threads = opts.threads if opts.threads is not None else (1 if opts.preset in ("tiny", "demo") else None)
    if threads is not None:
        torch.set_num_threads(threads)
    # Other processes on the machine distort wall-clock figures: record the load next to them.
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    model_cfg = get_preset(opts.preset)
    method = get_method(opts.method)
    switch_mode = opts.switch or default_switch(opts.preset, method.recache)
    pipe_cfg = PipelineConfig(dtype=opts.dtype, positions=opts.positions)
    spec = VideoSpec()
    num_blocks = plan.num_blocks
    warm_blocks = 1 if method.sequential else pipe_cfg.window_blocks
    schedule = _read_schedule(opts)
    total_frames = spec.video_frames(num_blocks, pipe_cfg.frames_per_block)
    meta: dict[str, Any] = {
        "command": command_line(opts),
        "preset": opts.preset,
        "method": method.name,
        "num_blocks": num_blocks,
        "backend": opts.backend,
        "positions": opts.positions,
        "dtype": opts.dtype,
        "seed": opts.seed,
        "noise": "upfront" if plan.upfront else "per-block",
        "out": str(opts.out),
        "warmup": opts.warmup,
        "cores": opts.cores,
        "merged_option": opts.merged,
        "compile": opts.compile,
        "cpu_count": os.cpu_count(),
        "loadavg_1m_at_start": load_at_start,
    }
    deadline = deadline_s(pipe_cfg.frames_per_block, spec.temporal_stride, spec.fps)
    timer = ChunkTimer()
    tmp_video = temporary_path(opts.out)
    writer = VideoWriter(tmp_video, spec.fps)
    pipe: Any = None

    def finish(status: dict[str, Any]) -> dict[str, Any]:
        """Close the writer, move the video where ``status`` says, write the report; return its dict."""
        with _signals_deferred(raise_pending=False):
            writer.close()
            if status["interrupted"] and writer.frames_written > 0:
                os.replace(tmp_video, plan.partial_path)
                status["partial_video"] = str(plan.partial_path)
            elif not status["interrupted"] and status["error"] is None:
                os.replace(tmp_video, opts.out)
            tmp_video.unlink(missing_ok=True)
            meta.update(torch_threads=torch.get_num_threads(), merged=bool(getattr(pipe, "merged", False)))
            report = timer.report(deadline, spec.fps, meta)
            data = {**status, **report.to_json_dict()}
            if opts.report_json is not None:
                write_json_atomic(opts.report_json, data)
            return {"report": report, "data": data}

    got = _Received()
    try:
        with _signals_raise() as got:
            torch.manual_seed(opts.seed)
            demo = None
            with phase(f"building the {opts.preset} model"):
                if opts.preset == "demo":
                    demo = _load_demo(opts)
                    model, model_cfg = demo.model, demo.model_cfg
                    meta["weights"] = demo_weights_text(opts, model_cfg)
                else:
                    model = CausalWanModel(model_cfg)
            if demo is None:
                with phase(f"loading {opts.checkpoint}" if opts.checkpoint is not None else "random weights"):
                    meta["weights"] = _load_weights(opts, model)
            model = model.to(pipe_cfg.torch_dtype).eval()
            with phase("text conditioning"):
                text_embeds, text_src = _build_text(opts, model_cfg, demo)
                switches: dict[int, Any] = {}  # block -> embeddings of the prompt that starts there
                if schedule is not None:
                    segs = schedule.segments(pipe_cfg.frames_per_block, num_blocks)
                    switches = {
                        b: _build_text(replace(opts, prompt=p), model_cfg, demo)[0] for b, p in segs[1:]
                    }
                    text_embeds = _build_text(replace(opts, prompt=segs[0][1]), model_cfg, demo)[0]
                    starts = [b for b, _ in segs]
                    text_src += (
                        f"; prompt schedule {opts.prompt_schedule}: segments start at blocks {starts}, "
                        f"switches {switch_mode}"
                    )
                    meta["switch"] = switch_mode
            meta["text"] = text_src
            with phase("decoder"):
                decoder, meta["decoder"] = _build_decoder(opts, model_cfg, spec, demo)
            if opts.cores != 1:  # TP x SP over spawned CPU ranks; rank 0 streams the chunks
                from sharding.pipeline import ShardedRollingForcingPipeline

                pipe = ShardedRollingForcingPipeline(
                    model, model_cfg, pipe_cfg, cores=opts.cores, backend=opts.backend,
                    positions=opts.positions, merged=opts.merged, method=method,
                    compile=True if opts.compile else None, guidance_scale=opts.guidance,
                )  # fmt: skip
                say(f"sharded over {opts.cores} ranks (gloo, spawned processes): plan {pipe.plan.name}")
            else:
                pipe = RollingForcingPipeline(
                    model, model_cfg, pipe_cfg, backend=opts.backend, positions=opts.positions,
                    merged=opts.merged, compile=True if opts.compile else None, method=method,
                    guidance_scale=opts.guidance,
                )  # fmt: skip
            meta["guidance"] = pipe.guidance_scale
            meta["guidance_sigma_min"] = pipe.guidance_sigma_min
            say(
                f"rolling-forcing generate: preset={opts.preset} blocks={num_blocks} "
                f"({total_frames} frames = {total_frames / spec.fps:.2f} s at {spec.fps:g} fps) "
                f"method={method.name} backend={opts.backend} positions={opts.positions} dtype={opts.dtype} "
                f"guidance={guidance_text(pipe.guidance_scale, pipe.guidance_sigma_min)}\n"
                f"  forward: {'merged (1 per chunk)' if getattr(pipe, 'merged', False) else 'two-pass'}"
                f"{', torch.compile' if opts.compile else ''}; noise {meta['noise']}\n"
                f"  weights: {meta['weights']}\n  text: {text_src}\n  decoder: {meta['decoder']}\n"
                f"  out: {opts.out}"
            )
            dt = pipe_cfg.torch_dtype
            if opts.warmup:
                # One untimed minimal stream (other seed) so one-time costs (lazy op registration,
                # allocator growth, first-call dispatch) do not land in the first chunk's latency.
                t0 = time.perf_counter()
                wbar = tqdm(
                    total=warm_blocks, unit="chunk", desc="warm-up", disable=not bars, file=sys.stderr
                )
                with torch.inference_mode():
                    warm_gen = torch.Generator().manual_seed(opts.seed + 1)
                    for chunk in pipe.stream(text_embeds.to(dt), warm_blocks, generator=warm_gen):
                        decoder.decode(chunk.latents.float())
                        wbar.update(1)
                wbar.close()
                say(
                    f"warm-up stream ({warm_blocks} blocks, not in the report): measured "
                    f"{time.perf_counter() - t0:.2f} s wall clock"
                )
            decoder.reset()
            timer = ChunkTimer()
            generator = torch.Generator().manual_seed(opts.seed)
            bar = tqdm(total=num_blocks, unit="chunk", desc="streaming", disable=not bars, file=sys.stderr)
            with torch.inference_mode():
                if opts.cores != 1:  # the sharded stream takes its switches up front, at their window
                    for b, emb in switches.items():
                        w = b * method.steps if method.sequential else b + pipe_cfg.window_blocks - 1
                        pipe.set_prompt(emb.to(dt), switch_mode == "recache", window=w)
                    stream = pipe.stream(
                        text_embeds.to(dt), num_blocks, generator=generator, upfront=plan.upfront
                    )
                else:
                    noise = NoiseSource(
                        text_embeds.shape[0], model_cfg.latent_frame_shape(), pipe_cfg.frames_per_block,
                        num_blocks, dt, generator=generator, upfront=plan.upfront,
                    )  # fmt: skip
                    stream = pipe.stream(text_embeds.to(dt), num_blocks, generator=generator, noise=noise)
                t_prev = time.perf_counter()
                try:
                    for chunk in stream:
                        t_gen = time.perf_counter()
                        _check_finite(chunk.latents, int(chunk.block))
                        video = decoder.decode(chunk.latents.float())
                        t_dec = time.perf_counter()
                        frames = to_uint8_frames(video)
                        # a chunk is in the video and in the report whole, or in neither
                        with _signals_deferred():
                            writer.write(frames)
                            t_wr = time.perf_counter()
                            timer.add(
                                int(chunk.block), frames.shape[0],
                                generate_s=t_gen - t_prev, decode_s=t_dec - t_gen, write_s=t_wr - t_dec,
                            )  # fmt: skip
                        bar.update(1)
                        if opts.cores == 1 and chunk.block + 1 in switches:
                            emb = switches[chunk.block + 1].to(dt)
                            pipe.set_prompt(emb, **switch_options(switch_mode))
                        t_prev = time.perf_counter()
                finally:
                    close = getattr(stream, "close", None)
                    if close is not None:  # a sharded stream cancels its ranks when closed early
                        close()
            bar.close()
            if writer.frames_written != total_frames:
                raise CliError(
                    "generate", f"wrote {writer.frames_written} frames, expected {total_frames}", exit_code=1
                )
    except BaseException as exc:
        signum = _stop_signal(exc, got)
        if signum is None:
            finish({"interrupted": False, "signal": None, "error": f"{type(exc).__name__}: {exc}"})
            raise
        done = finish({"interrupted": True, "signal": signal.Signals(signum).name, "error": None})
        kept = done["data"].get("partial_video")
        where = (
            f"the {writer.frames_written} frames written so far are in {kept}" if kept else "no frames yet"
        )
        rep = f"; report {opts.report_json}" if opts.report_json is not None else ""
        raise Interrupted(signum, f"interrupted by {signal.Signals(signum).name}: {where}{rep}") from None
    done = finish({"interrupted": False, "signal": None, "error": None})
    report = done["report"]
    say(report.format_table())
    say(
        f"machine: {meta['cpu_count']} CPUs, torch threads {meta['torch_threads']}, 1-min load average at "
        f"start {load_at_start} (wall-clock figures include any contention)"
    )
    if opts.report_json is not None:
        say(f"report written to {opts.report_json}")
    echo(f"video written to {opts.out} ({writer.frames_written} frames)")
    return dict(done["data"])


__all__ = ["Interrupted", "run_generate", "temporary_path", "text_encoder_for", "write_json_atomic"]
