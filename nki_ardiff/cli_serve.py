"""``rolling-forcing serve``: watch and steer live streams in a browser (docs/serve.md).

It serves the demo preset by default (the shipped trained DiT, text encoder and autoencoder) and every
preset ``generate`` runs. The model options are ``generate``'s (``--preset``, ``--checkpoint``,
``--use-ema``, ``--lora``, ``--vae``, ``--text-encoder``): checked by the same code
(:func:`nki_ardiff.cli_checks.check_model_sources`) before anything is built or bound, and built by the
same builders (:mod:`nki_ardiff.cli_run`), so a bad option gets the same one ``error: <option>: <rule>``
line (exit 2) as with ``generate``. Then the socket is bound, the model built and the server runs
(:func:`rolling_forcing.serve.command.run_server`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nki_ardiff.cli_checks import CliError, check_guidance_option, check_model_sources
from nki_ardiff.cli_errors import reported_errors
from nki_ardiff.cli_options import GenerateOptions, Preset, Switch, default_switch

if TYPE_CHECKING:
    from rolling_forcing.serve.config import ServeConfig
    from rolling_forcing.serve.engine import ModelParts

# ServeConfig fields set from an option of their own name, and the others
_FIELD_FLAGS = {"weights_seed": "--seed"} | {
    f: "--" + f.replace("_", "-")
    for f in ("host", "port", "max_sessions", "headroom", "buffer_frames", "image_format", "threads")
}


def serve_config(**fields: object) -> ServeConfig:
    """:class:`~rolling_forcing.serve.config.ServeConfig` of the options; :class:`CliError` naming the
    option whose rule a field breaks."""
    from rolling_forcing.serve.config import ServeConfig

    try:
        return ServeConfig(**fields)  # type: ignore[arg-type]
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0].rstrip(":")
        raise CliError(_FIELD_FLAGS.get(field, "serve"), str(exc)) from None


def build_parts(opts: GenerateOptions) -> ModelParts:
    """The served model of ``opts`` (checked by :func:`check_model_sources`), built as ``generate`` builds
    it: the demo preset's shipped model, or the preset's DiT (``torch.manual_seed(--seed)``, then
    ``--checkpoint`` / ``--lora``), ``--text-encoder`` or seeded embeddings, ``--vae`` or the preview
    decoder. The page's preselected switch mode: ``--switch``, else :func:`default_switch` (the demo
    model restarts, the others continue). Load errors are :class:`CliError` naming the option."""
    import torch

    from nki_ardiff.cli_run import (
        _build_decoder,
        _load_demo,
        _load_weights,
        demo_weights_text,
        text_encoder_for,
    )
    from rolling_forcing.config import get_preset
    from rolling_forcing.methods import get_method
    from rolling_forcing.model import CausalWanModel
    from rolling_forcing.prompts import check_scene_prompt
    from rolling_forcing.serve.engine import DEMO_PROMPT, DEMO_PROMPT_HELP, ModelParts, session_decoder
    from rolling_forcing.video import VideoSpec

    model_cfg = get_preset(opts.preset)
    switch = opts.switch or default_switch(opts.preset, get_method(opts.method).recache)
    demo = None
    if opts.preset == "demo":
        demo = _load_demo(opts)
        model, model_cfg = demo.model, demo.model_cfg  # the width of the weights
        weights = demo_weights_text(opts, model_cfg)
    else:
        torch.manual_seed(opts.seed)
        model = CausalWanModel(model_cfg)
        weights = _load_weights(opts, model)
    if opts.guidance is not None:
        model_cfg = replace(model_cfg, guidance_scale=opts.guidance)
    model = model.float().eval()
    encode, text = text_encoder_for(opts, model_cfg, demo)
    proto, decoder = _build_decoder(opts, model_cfg, VideoSpec(), demo)
    if demo is None:
        return ModelParts(
            opts.preset, model_cfg, model, encode, lambda: session_decoder(proto), weights, text, decoder,
            switch=switch,
        )  # fmt: skip
    return ModelParts(
        "demo", model_cfg, model, encode, lambda: session_decoder(proto), weights, text, decoder,
        lambda p: check_scene_prompt(p, model_cfg.text_len), DEMO_PROMPT_HELP, DEMO_PROMPT, switch,
    )  # fmt: skip


def serve(
    ctx: typer.Context,
    preset: Annotated[
        Preset, typer.Option(help="model preset, as for generate (demo: the shipped trained model)")
    ] = Preset.demo,
    checkpoint: Annotated[
        Path | None, typer.Option(help="DiT weights, as for generate (demo: a train-demo --out directory)")
    ] = None,
    use_ema: Annotated[bool, typer.Option(help="RF training checkpoint: use generator_ema")] = False,
    lora: Annotated[Path | None, typer.Option(help="PEFT LoRA file merged into --checkpoint")] = None,
    vae: Annotated[
        Path | None, typer.Option(help="local diffusers AutoencoderKLWan directory (hf extra)")
    ] = None,
    text_encoder: Annotated[
        Path | None, typer.Option(help="local umT5 directory (transformers; hf extra)")
    ] = None,
    host: Annotated[str, typer.Option(help="address to bind (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: a free one, printed)")] = 8000,
    max_sessions: Annotated[int, typer.Option(help="most concurrent sessions")] = 4,
    headroom: Annotated[float, typer.Option(help="share of the chunk deadline admission keeps free")] = 0.2,
    buffer_frames: Annotated[int, typer.Option(help="playout buffer depth per session (video frames)")] = 24,
    image_format: Annotated[str, typer.Option(help="frame encoding: jpeg or png")] = "jpeg",
    seed: Annotated[
        int, typer.Option(help="seed of random weights (tiny; as generate) and of the calibration noise")
    ] = 0,
    threads: Annotated[int, typer.Option(help="torch CPU threads of the worker")] = 1,
    guidance: Annotated[
        float | None,
        typer.Option(help="classifier-free guidance scale, >= 1 (as generate; default: the preset's)"),
    ] = None,
    report_dir: Annotated[
        Path | None, typer.Option(help="write each closed session's JSON report here (server-side)")
    ] = None,
    switch: Annotated[
        Switch | None,
        typer.Option(
            help="the switch mode the page preselects: continue the stream, recache its KV cache, or "
            "restart it under the new prompt (default: restart for demo, continue for the others)"
        ),
    ] = None,
) -> None:
    """Serve live streams to a browser page with a prompt box (FastAPI + uvicorn; docs/serve.md)."""
    with reported_errors("serve", ctx):
        cfg = serve_config(
            preset=preset.value, host=host, port=port, max_sessions=max_sessions, headroom=headroom,
            buffer_frames=buffer_frames, image_format=image_format, weights_seed=seed, threads=threads,
            report_dir=None if report_dir is None else str(report_dir),
        )  # fmt: skip
        # generate's record of the model options (serve writes no video: `out` is not used)
        opts = GenerateOptions(
            out=Path("serve.mp4"), preset=preset.value, seed=seed, checkpoint=checkpoint, use_ema=use_ema,
            lora=lora, vae=vae, text_encoder=text_encoder, guidance=guidance,
            switch=None if switch is None else switch.value,
        )  # fmt: skip
        if guidance is not None:
            check_guidance_option(guidance)
        check_model_sources(opts, typed_prompts=True)
        from rolling_forcing.serve.command import bind_socket, missing_serve_modules, run_server

        missing = missing_serve_modules()
        if missing:
            raise CliError(
                "serve",
                f"needs the serve extra ({', '.join(missing)} not installed): pip install -e '.[serve]'",
            )
        try:
            sock = bind_socket(cfg.host, cfg.port)
        except OSError as exc:
            raise CliError("--port", f"cannot bind {cfg.host}:{cfg.port}: {exc}") from None
        try:
            parts = build_parts(opts)
        except BaseException:
            sock.close()
            raise
        run_server(cfg, sock, parts, echo=typer.echo)


__all__ = ["build_parts", "serve", "serve_config"]
