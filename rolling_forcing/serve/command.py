"""Running ``rolling-forcing serve``: the serve extra's check, the listening socket and uvicorn with the
server's log lines (imports only the standard library until :func:`run_server` runs).

The command itself (its options, ``generate``'s checks and model builders) is ``nki_ardiff/cli_serve.py``:
the face builds the :class:`~rolling_forcing.serve.engine.ModelParts` and hands them to
:func:`run_server`.
"""

from __future__ import annotations

import copy
import importlib.util
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rolling_forcing.serve.config import ServeConfig
    from rolling_forcing.serve.engine import ModelParts

# import name -> distribution name, of the `serve` extra in pyproject.toml
SERVE_MODULES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "websockets": "websockets", "PIL": "pillow"}

SERVE_LOGGER = "rolling_forcing.serve"
"""The server's own log lines (a viewer that went away, ...): INFO and up, printed like uvicorn's."""


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


def log_config() -> dict[str, Any]:
    """uvicorn's logging configuration plus the :data:`SERVE_LOGGER` logger on uvicorn's stderr handler
    (same format: ``INFO:     viewer of session ... closed the connection: ...``)."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"][SERVE_LOGGER] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return cfg


def run_server(
    cfg: ServeConfig, sock: socket.socket, parts: ModelParts | None = None, echo: Callable[[str], Any] = print
) -> None:
    """Serve ``cfg`` on the bound ``sock`` until stopped (SIGINT / SIGTERM): print the URL, build the app
    over ``parts`` (calibrated at start-up) and run uvicorn."""
    import uvicorn

    from rolling_forcing.serve.app import create_app

    bound = sock.getsockname()[1]
    shown = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    echo(f"rolling-forcing serve: open http://{shown}:{bound}/ (measuring the chunk cost first)")
    app = create_app(cfg, parts=parts)
    server = uvicorn.Server(uvicorn.Config(app, log_config=log_config(), ws="websockets"))
    server.run(sockets=[sock])


__all__ = ["SERVE_LOGGER", "bind_socket", "log_config", "missing_serve_modules", "run_server"]
