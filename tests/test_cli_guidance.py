"""``--guidance`` of ``generate`` and ``serve`` (nki_ardiff/cli_checks.py, cli_serve.py): the rule as one
error line before anything is built, the value reaching the stream and the served model's description, and
the command line that reproduces a run. The guided stream itself: tests/test_guidance.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nki_ardiff.cli import app
from nki_ardiff.cli_checks import CliError, check_generate
from nki_ardiff.cli_options import GenerateOptions, command_line
from nki_ardiff.cli_serve import build_parts
from rolling_forcing.config import DEMO_GUIDANCE, get_preset

runner = CliRunner()


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("bad", ["0.99", "0", "-2", "nan", "inf"])
def test_bad_guidance_is_one_error_line_before_any_build(
    tmp_path, model_builds: list[int], command: str, bad: str
) -> None:
    args = [command, "--preset", "tiny", "--guidance", bad]
    args += (
        ["--blocks", "5", "-q", "--out", str(tmp_path / "x.mp4")]
        if command == "generate"
        else ["--port", "0"]
    )
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert (
        r.stderr == f"error: --guidance: must be a finite number >= 1 (1: no guidance), got {float(bad)!r}\n"
    )
    assert model_builds == [] and list(tmp_path.iterdir()) == []


def test_guidance_edges_and_the_reproducing_command_line(tmp_path) -> None:
    o = {"out": Path(tmp_path / "a.mp4"), "preset": "tiny", "blocks": 5}
    assert check_generate(GenerateOptions(guidance=1.0, **o)).num_blocks == 5
    with pytest.raises(CliError, match=r"--guidance: must be a finite number >= 1"):
        check_generate(GenerateOptions(guidance=math.nextafter(1.0, 0.0), **o))
    assert "--guidance 3.5" in command_line(GenerateOptions(guidance=3.5, **o))
    assert "--guidance" not in command_line(GenerateOptions(**o))  # the preset's default is implied


def test_generate_streams_with_the_given_guidance(tmp_path) -> None:
    """The header names the stream's guidance: the demo preset's default, and an override."""
    base = ["generate", "--preset", "tiny", "--blocks", "5", "--no-warmup", "--no-progress"]
    r = runner.invoke(app, [*base, "--out", str(tmp_path / "a.mp4")])
    assert r.exit_code == 0, r.output
    assert "guidance=1 (none)\n" in r.output  # tiny: none
    rep = tmp_path / "b.json"
    r = runner.invoke(
        app, [*base, "--guidance", "2.5", "--out", str(tmp_path / "b.mp4"), "--report-json", str(rep)]
    )
    assert r.exit_code == 0, r.output
    assert "guidance=2.5 (classifier-free)\n" in r.output
    meta = json.loads(rep.read_text())["meta"]
    assert (
        meta["guidance"] == 2.5 and meta["guidance_sigma_min"] == 0.0 and "--guidance 2.5" in meta["command"]
    )
    assert get_preset("demo").guidance_scale == DEMO_GUIDANCE > 1


def test_served_model_carries_and_describes_its_guidance() -> None:
    parts = build_parts(GenerateOptions(out=Path("serve.mp4"), preset="tiny", guidance=3.0))
    assert parts.model_cfg.guidance_scale == 3.0
    assert parts.describe()["guidance"] == "3 (classifier-free)"  # tiny: no interval
    plain = build_parts(GenerateOptions(out=Path("serve.mp4"), preset="tiny"))
    assert plain.model_cfg.guidance_scale == 1.0 and plain.describe()["guidance"] == "1 (none)"
