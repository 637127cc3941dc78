"""A user's `python -m perf.*` run never dirties the checkout: every entry point that can write tracked
results (perf/results/*, perf/REPORT.md) writes them only with --save (the Makefile's UPDATE=1)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

WRITERS = (
    "perf.attention_guard",
    "perf.bench_integrations",
    "perf.bench_kernels",
    "perf.bench_long_stream",
    "perf.bench_pipeline",
    "perf.bench_quality",
    "perf.calibration.__main__",
    "perf.demo_chain",
    "perf.e2e.cli",
    "perf.footprint_check",
    "perf.fp8_gate",
    "perf.fp8_psnr",
    "perf.neuron_points",
    "perf.serve_switch",
)
"""Entry points that can write tracked results (each: ``build_parser()``, --save off by default)."""
PRINT_ONLY = (
    "perf.attention_cte_harness",
    "perf.bench_cost_schedule",
    "perf.e2e.elementwise_table",
    "perf.e2e.fp8",
    "perf.calibration.tp_sensitivity",
    "perf.vae_bf16",
    "perf.neuron_measure",  # the --measure child (``run-kernel CALL.pkl``), writes only into its temp workdir
)
"""Entry points with no channel to a tracked file at all (checked on their source below)."""
PERF = Path(__file__).resolve().parents[1] / "perf"
TRACKED_WRITES = ("append_rows", "RESULTS_DIR", "results_path", "write_png", "savefig", "REPORT.md")


def _entry_points() -> set[str]:
    """Every ``python -m perf.<x>`` module: a ``__main__`` guard, or a package's ``__main__.py`` (whose
    ``main`` lives where it imports it from: perf.e2e -> perf.e2e.cli)."""
    found = set()
    for f in PERF.rglob("*.py"):
        mod = ".".join(f.relative_to(PERF.parent).with_suffix("").parts)
        if f.name == "__main__.py" and "def main(" not in f.read_text():
            src = f.read_text()
            mod = src.split("from ", 1)[1].split(" import main", 1)[0].strip()
        elif f.name != "__main__.py" and '__name__ == "__main__"' not in f.read_text():
            continue
        found.add(mod)
    return found


def test_every_entry_point_is_classified() -> None:
    """A new ``python -m perf.*`` command has to join WRITERS (opt-in --save, tested) or PRINT_ONLY."""
    assert _entry_points() == set(WRITERS) | set(PRINT_ONLY)


@pytest.mark.parametrize("module", PRINT_ONLY)
def test_print_only_entry_points_have_no_tracked_output(module: str) -> None:
    src = (PERF.parent / Path(*module.split("."))).with_suffix(".py").read_text()
    assert [w for w in TRACKED_WRITES if w in src] == []


OPT_OUT = {  # the former opt-out flags, still accepted (now the default) but not with --save
    "perf.bench_kernels": "--no-save",
    "perf.bench_long_stream": "--no-save",
    "perf.bench_pipeline": "--no-write",
    "perf.bench_quality": "--no-save",
    "perf.calibration.__main__": "--no-write",
}


@pytest.mark.parametrize("module", WRITERS)
def test_writing_tracked_results_is_opt_in(module: str) -> None:
    ap = importlib.import_module(module).build_parser()
    assert ap.parse_args([]).save is False
    assert ap.parse_args(["--save"]).save is True
    if module in OPT_OUT:
        assert ap.parse_args([OPT_OUT[module]]).save is False


@pytest.mark.parametrize("module", sorted(OPT_OUT))
def test_save_and_the_old_opt_out_contradict(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exc:
        main(["--save", OPT_OUT[module]])
    assert exc.value.code == 2 and "contradict" in capsys.readouterr().err


def _outputs(perf_dir: Path) -> list[Path]:
    """The tracked files a --save run writes: perf/REPORT*.md and everything under perf/results."""
    return [p for p in (*perf_dir.glob("REPORT*.md"), *(perf_dir / "results").rglob("*")) if p.is_file()]


def test_e2e_default_output_is_untracked_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """perf.e2e without --save or --out-dir writes under ./build/perf/e2e (git-ignored), nothing in perf/."""
    import perf.e2e.cli as cli

    perf_dir = Path(cli.__file__).resolve().parents[1]
    before = {p: p.stat().st_mtime_ns for p in _outputs(perf_dir)}
    monkeypatch.chdir(tmp_path)
    cli.main(["--quick", "--analytic", "--no-peer"])  # analytic tiny preset: well under a second
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert written and all(p.parts[:3] == ("build", "perf", "e2e") for p in written), written
    after = {p: p.stat().st_mtime_ns for p in _outputs(perf_dir)}
    assert after == before
    with pytest.raises(SystemExit):
        cli.main(["--save", "--out-dir", "x"])
