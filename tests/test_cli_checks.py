"""``generate``'s option checks (nki_ardiff/cli_checks.py) at their edges: every numeric bound accepted at
its edge and refused one step past it with ``error: <option>: <rule>`` (exit 2) before anything is built;
the oversubscription warning. In-process (CliRunner / check_generate), no model is run."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nki_ardiff.cli import app
from nki_ardiff.cli_checks import CliError, check_generate
from nki_ardiff.cli_options import GenerateOptions

runner = CliRunner()


def test_threads_and_cores_above_the_cpu_count_warn_in_one_line(tmp_path, capsys) -> None:
    n = (os.cpu_count() or 1) + 1
    plan = check_generate(GenerateOptions(out=Path(tmp_path / "a.mp4"), blocks=5, threads=n))
    assert plan.num_blocks == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: --threads: {n} is more than")
    check_generate(GenerateOptions(out=Path(tmp_path / "a.mp4"), blocks=5, threads=n - 1))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flag", ["--threads", "--cores"])
@pytest.mark.parametrize("n", [0, -1])
def test_threads_and_cores_below_one_are_one_error_line_before_any_build(
    tmp_path, model_builds: list[int], flag: str, n: int
) -> None:
    """The bound's edge: 0 (and below) is refused by the checks with the one-line rule and exit 2, before
    any model is built or file written (not a torch traceback from set_num_threads(0), not a rank
    launch with 0 cores)."""
    out = tmp_path / "x.mp4"
    args = ["generate", "--preset", "tiny", "--blocks", "5", "--no-warmup", "-q", "--out", str(out)]
    r = runner.invoke(app, [*args, flag, str(n)])
    assert r.exit_code == 2, r.output
    assert r.stderr == f"error: {flag}: must be >= 1, got {n}\n"
    assert model_builds == [] and list(tmp_path.iterdir()) == []


def test_one_thread_and_one_core_are_accepted(tmp_path, capsys) -> None:
    opts = GenerateOptions(out=Path(tmp_path / "a.mp4"), preset="tiny", blocks=5, threads=1, cores=1)
    plan = check_generate(opts)
    assert plan.num_blocks == 5 and capsys.readouterr().err == ""  # no warning either: 1 <= cpu_count


def test_numeric_bounds_of_generate_are_exact_at_their_edges(tmp_path) -> None:
    """--seconds (0, 24 h], --blocks [1, the 24 h count], --seed [0, 2**63 - 2]: each edge accepted, the
    next value refused with the option and its rule."""
    o = {"out": Path(tmp_path / "a.mp4"), "preset": "tiny", "positions": "relative"}  # no table bound
    top = 1 + math.ceil((86_400 * 16 - 9) / 12)  # 24 h at 16 fps: 9 frames in the first block, 12 after
    assert check_generate(GenerateOptions(seconds=86_400.0, **o)).num_blocks == top
    assert check_generate(GenerateOptions(blocks=top, **o)).num_blocks == top
    for seed in (0, 2**63 - 2):
        assert check_generate(GenerateOptions(blocks=5, seed=seed, **o)).num_blocks == 5
    refused = [
        ({"seconds": math.nextafter(86_400.0, math.inf)}, "--seconds", "at most 86400 (24 h of video)"),
        ({"seconds": 0.0}, "--seconds", "must be a finite number > 0, got 0.0"),
        ({"blocks": top + 1}, "--blocks", f"must be in [1, {top}]"),
        ({"blocks": 0}, "--blocks", f"must be in [1, {top}]"),
        ({"blocks": 5, "seed": 2**63 - 1}, "--seed", f"must be in [0, 2**63 - 2], got {2**63 - 1}"),
        ({"blocks": 5, "seed": -1}, "--seed", "must be in [0, 2**63 - 2], got -1"),
    ]
    for kw, flag, rule in refused:
        with pytest.raises(CliError) as info:
            check_generate(GenerateOptions(**kw, **o))
        assert info.value.argument == flag and rule in info.value.rule and info.value.exit_code == 2, kw
