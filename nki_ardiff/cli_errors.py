"""How ``rolling-forcing`` commands end on an anticipated failure: one ``error: <argument>: <rule>`` line.

Exit codes: 2 usage error (a bad option or input file, :class:`~nki_ardiff.cli_checks.CliError` with
``exit_code=2`` and the library's own argument checks: ``ValueError``, ``TypeError``,
``FileNotFoundError``, ``NotImplementedError``); 1 runtime failure (a non-finite latent, a rank that
died: ``sharding.launch.LaunchError``); 128 + signal number after SIGINT (130) or SIGTERM (143). Anything
else is a bug and keeps its traceback. ``--debug`` (or ``NKI_ARDIFF_DEBUG=1``) re-raises every error
with its traceback instead of the one line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import typer

from nki_ardiff.cli_checks import CliError

DEBUG_ENV = "NKI_ARDIFF_DEBUG"

_USAGE = (ValueError, TypeError, FileNotFoundError, NotImplementedError)


def debug_enabled(ctx: typer.Context | None = None) -> bool:
    """``--debug`` (a root parameter of ``ctx``) or ``NKI_ARDIFF_DEBUG`` = 1/true/yes."""
    if os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes"):
        return True
    return bool(ctx is not None and ctx.find_root().params.get("debug"))


def click_exceptions() -> Any:
    """The click exceptions module typer raises (typer >= 0.2x vendors click as ``typer._click``)."""
    try:
        from typer._click import exceptions
    except ImportError:  # older typer: the click package
        from click import exceptions  # type: ignore[no-redef]
    return exceptions


def usage_error_line(exc: Any) -> str:
    """One ``error: <argument>: <rule>`` line for a click usage error (bad value, unknown option ...)."""
    param = getattr(exc, "param", None)
    opts = getattr(param, "opts", None)
    cmd = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else "rolling-forcing"
    arg = opts[0] if opts else (getattr(exc, "option_name", None) or cmd)
    msg = one_line(exc.format_message() if param is None else exc.message)
    msg = msg.removeprefix("Value error, ")
    env = getattr(param, "envvar", None)
    if isinstance(env, str) and os.environ.get(env):
        msg += f" ({env}={os.environ[env]!r} sets its default)"
    return f"error: {arg}: {msg} (see {cmd} -h)"


def one_line(message: str) -> str:
    """``message`` on one line (multi-line library messages joined with ``; ``)."""
    return "; ".join(s.strip() for s in str(message).splitlines() if s.strip())


def fail(argument: str, rule: str, code: int = 2) -> typer.Exit:
    """Print ``error: <argument>: <rule>`` on stderr and return the :class:`typer.Exit` to raise."""
    typer.secho(f"error: {argument}: {one_line(rule)}", err=True, fg=typer.colors.RED)
    return typer.Exit(code=code)


@contextlib.contextmanager
def reported_errors(command: str = "generate", ctx: typer.Context | None = None) -> Iterator[None]:
    """Turn anticipated failures inside the block into one stderr line and an exit code (see module)."""
    from nki_ardiff.cli_run import Interrupted

    try:
        yield
    except Interrupted as exc:
        typer.secho(one_line(str(exc)), err=True, fg=typer.colors.YELLOW)
        raise typer.Exit(code=exc.exit_code) from None
    except CliError as exc:
        if debug_enabled(ctx):
            raise
        raise fail(exc.argument, exc.rule, exc.exit_code) from None
    except _USAGE as exc:
        if debug_enabled(ctx):
            raise
        raise fail(command, str(exc)) from None
    except RuntimeError as exc:
        from sharding.launch import LaunchError

        if debug_enabled(ctx) or not isinstance(exc, LaunchError):
            raise
        first = one_line(str(exc).split("\n", 1)[0])
        raise fail(
            "--cores", f"a rank of the sharded stream failed: {first} (--debug for the tracebacks)", 1
        ) from None


__all__ = [
    "DEBUG_ENV",
    "click_exceptions",
    "debug_enabled",
    "fail",
    "one_line",
    "reported_errors",
    "usage_error_line",
]
