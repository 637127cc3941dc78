"""The ``rolling-forcing serve`` subcommand, registered on the CLI's typer app by :func:`register_serve`
(imports only typer and the standard library until the command runs)."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from typing import Annotated

import typer

# import name -> distribution name, of the `serve` extra in pyproject.toml
SERVE_MODULES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "websockets": "websockets", "PIL": "pillow"}


def missing_serve_modules() -> list[str]:
    """Distribution names of the ``serve`` extra that are not importable (found without importing)."""
    return [dist for mod, dist in SERVE_MODULES.items() if importlib.util.find_spec(mod) is None]


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free port, read it from ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    return sock


def serve(
    preset: Annotated[str, typer.Option(help="model preset (tiny: seeded random weights)")] = "tiny",
    host: Annotated[str, typer.Option(help="address to bind (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: a free one, printed)")] = 8000,
    max_sessions: Annotated[int, typer.Option(help="most concurrent sessions")] = 4,
    headroom: Annotated[float, typer.Option(help="share of the chunk deadline admission keeps free")] = 0.2,
    buffer_frames: Annotated[int, typer.Option(help="playout buffer depth per session (video frames)")] = 24,
    image_format: Annotated[str, typer.Option(help="frame encoding: jpeg or png")] = "jpeg",
    seed: Annotated[int, typer.Option(help="seed of the tiny preset's weights")] = 0,
    threads: Annotated[int, typer.Option(help="torch CPU threads of the worker")] = 1,
    report_dir: Annotated[
        Path | None, typer.Option(help="write each closed session's JSON report here (server-side)")
    ] = None,
) -> None:
    """Serve live streams to a browser page with a prompt box (FastAPI + uvicorn; docs/serve.md)."""
    from rolling_forcing.serve.config import ServeConfig

    try:
        cfg = ServeConfig(
            preset=preset, host=host, port=port, max_sessions=max_sessions, headroom=headroom,
            buffer_frames=buffer_frames, image_format=image_format, weights_seed=seed, threads=threads,
            report_dir=None if report_dir is None else str(report_dir),
        )  # fmt: skip
    except ValueError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=2) from exc
    missing = missing_serve_modules()
    if missing:
        typer.secho(
            f"error: serve needs the serve extra ({', '.join(missing)} not installed): "
            "pip install -e '.[serve]'",
            err=True,
            fg=typer.colors.RED,
        )
        raise typer.Exit(code=2)
    import uvicorn

    from rolling_forcing.serve.app import create_app

    try:
        sock = bind_socket(cfg.host, cfg.port)
    except OSError as exc:
        typer.secho(f"error: cannot bind {cfg.host}:{cfg.port}: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=2) from exc
    bound = sock.getsockname()[1]
    shown = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    typer.echo(f"rolling-forcing serve: open http://{shown}:{bound}/ (building the model first)", err=False)
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), log_level="info", ws="websockets"))
    server.run(sockets=[sock])


def register_serve(app: typer.Typer) -> None:
    """Add the ``serve`` command to the CLI's typer ``app``."""
    app.command("serve")(serve)


__all__ = ["bind_socket", "missing_serve_modules", "register_serve", "serve"]
