"""Packaging: the library imports none of the CLI's own dependencies; the console entry point names the
``cli`` extra in one line when one is missing; pyproject's ``cli`` extra is what the entry point checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # requires-python is >=3.10: the test extra installs tomli there (same API)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CLI_DISTS = {"typer", "tqdm", "matplotlib", "imageio", "imageio-ffmpeg"}


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_library_imports_with_every_cli_dependency_hidden() -> None:
    """The library (kernels, references, pipeline, video module, sharding, perf model) imports with the
    ``cli`` extra's modules hidden: they are imported lazily, inside the functions that need them.
    (torch.hub itself imports tqdm when present, optionally; hiding it covers that too.)"""
    r = _run(
        "import sys\n"
        "for m in ('typer', 'tqdm', 'matplotlib', 'imageio', 'imageio_ffmpeg'):\n"
        "    sys.modules[m] = None\n"
        "import nki_kernels, reference, sharding, rolling_forcing\n"
        "import rolling_forcing.pipeline, rolling_forcing.video, sharding.pipeline, perf.footprint\n"
        "import perf.e2e, perf.e2e.plots\n"
        "print('ok')\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_entry_point_without_a_cli_dependency_is_one_error_line() -> None:
    r = _run(
        "import sys; sys.modules['matplotlib'] = None; sys.modules['tqdm'] = None\n"
        "from nki_ardiff.entry import main\n"
        "main(['--help'])\n"
    )
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "pip install -e '.[cli]'" in lines[0]
    assert "tqdm, matplotlib" in lines[0]


def test_cli_extra_matches_the_entry_points_check_and_test_extra_includes_it() -> None:
    from nki_ardiff.entry import CLI_MODULES

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {
        d.split(">")[0].split("=")[0].split("<")[0].strip() for d in meta["optional-dependencies"]["cli"]
    }
    assert names == CLI_DISTS == set(CLI_MODULES.values())
    test = {d.split(">")[0].split("=")[0].strip() for d in meta["optional-dependencies"]["test"]}
    assert test >= CLI_DISTS
    assert not CLI_DISTS & {d.split(">")[0].split("=")[0].strip() for d in meta["dependencies"]}
    assert "einops" not in str(meta["dependencies"])


def test_toml_reader_is_declared_for_every_supported_python() -> None:
    """requires-python admits 3.10, which has no tomllib: the test extra must bring tomli there."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["requires-python"] == ">=3.10"
    assert any(
        d.replace(" ", "").startswith("tomli>=2;python_version<'3.11'")
        for d in meta["optional-dependencies"]["test"]
    )
