"""Console entry point ``rolling-forcing``: one error line naming the ``cli`` extra when it is missing.

The CLI's own dependencies (typer, tqdm, imageio + imageio-ffmpeg, matplotlib) are the ``cli`` extra, so
the library installs without them; this module imports nothing but the standard library until they are
known to be present.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

# import name -> distribution name, of the `cli` extra in pyproject.toml
CLI_MODULES = {
    "typer": "typer",
    "tqdm": "tqdm",
    "imageio": "imageio",
    "imageio_ffmpeg": "imageio-ffmpeg",
    "matplotlib": "matplotlib",
}


def missing_cli_modules() -> list[str]:
    """Distribution names of the ``cli`` extra that are not importable (found without importing them)."""
    return [dist for mod, dist in CLI_MODULES.items() if importlib.util.find_spec(mod) is None]


def main(argv: Sequence[str] | None = None) -> None:
    """Run the ``rolling-forcing`` CLI, or exit 2 with one ``error:`` line if the ``cli`` extra is missing."""
    missing = missing_cli_modules()
    if missing:
        sys.stderr.write(
            f"error: the rolling-forcing command needs the cli extra ({', '.join(missing)} not installed): "
            "pip install -e '.[cli]'\n"
        )
        raise SystemExit(2)
    from nki_ardiff.cli import main as cli_main

    cli_main(argv)
