"""Tests of the shared benchmark runner (perf/runner.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nki_kernels.emulator.cost import profile
from nki_kernels.emulator.trace import Trace, TraceRecord
from perf import runner
from perf.runner import (
    FIGURES,
    BenchRow,
    append_rows,
    current_command,
    figures_from_profile,
    format_table,
    git_sha,
    portable_command,
    print_table,
    read_rows,
    results_path,
    run_case,
    time_call,
)


def _row(**kw: object) -> BenchRow:
    base: dict[str, object] = {
        "op": "rope3d",
        "variant": "nki",
        "config": {"L": 128, "H": 2},
        "kind": "modelled",
    }
    base.update(kw)
    return BenchRow(**base)  # type: ignore[arg-type]


def test_row_provenance_filled(monkeypatch: pytest.MonkeyPatch) -> None:
    # The row's sha comes from git_sha(); pin it so the test does not race other commits moving HEAD.
    monkeypatch.setattr(runner, "_git_sha", lambda cwd: "abc1234")
    row = _row(latency_us=1.5)
    assert row.status == "ok"
    assert row.command == current_command()
    assert row.git_sha == "abc1234"
    assert row.timestamp.endswith("+00:00")


def test_git_sha_reads_head(tmp_path: Path) -> None:
    # A private repository whose HEAD nobody else moves; its sha is read once, independently.
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    try:
        git("init", "-q")
        (tmp_path / "f").write_text("x")
        git("add", "f")
        git("commit", "-q", "-m", "one")
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"git is not usable here to build a scratch repository: {e}")
    expected = git("rev-parse", "--short", "HEAD")
    assert len(expected) >= 7
    assert git_sha(tmp_path) == expected


def test_git_sha_unknown_outside_repo(tmp_path: Path) -> None:
    assert git_sha(tmp_path) == "unknown"


def test_current_command_is_argv() -> None:
    cmd = current_command()
    assert any(a in cmd for a in sys.argv[1:2]) or Path(sys.argv[0]).name in cmd
    assert cmd.startswith("python ") and sys.executable not in cmd  # no interpreter path of this machine


def test_portable_command_names_no_machine_path(tmp_path: Path) -> None:
    argv = ["/opt/venv/bin/python3", "-m", "perf.bench_kernels", "--ops", "rope3d", "--no-save"]
    assert portable_command(argv, tmp_path, True) == "python -m perf.bench_kernels --ops rope3d --no-save"
    script = tmp_path / "perf" / "x y.py"  # a script by full path under the working directory -> relative
    assert portable_command(["/usr/bin/python", str(script), "-n", "3"], tmp_path, True) == (
        "python 'perf/x y.py' -n 3"
    )
    assert portable_command([str(script), "/elsewhere/f.json"], tmp_path, False) == (
        "python 'perf/x y.py' /elsewhere/f.json"  # outside the working directory: kept as given
    )


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"kind": "estimated"}, ValueError, "kind"),
        ({"status": "skipped"}, ValueError, "status"),
        ({"status": "error"}, ValueError, "message"),
        ({"op": ""}, ValueError, "op"),
        ({"latency_us": "fast"}, TypeError, "latency_us"),
        ({"latency_us": float("nan")}, ValueError, "latency_us"),
        ({"config": {"x": object()}}, TypeError, "config"),
    ],
)
def test_row_validation(kw: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        _row(**kw)


def test_append_and_read_roundtrip(tmp_path: Path) -> None:
    rows = [
        _row(latency_us=781.2, bytes=287_539_200, descriptors=1_000, tensore_util=None),
        _row(variant="naive", status="error", message="ValueError: boom"),
        _row(op="window", variant="cpu", kind="measured", fps=0.5, memory_bytes=123, config={"frames": 3}),
    ]
    p1 = append_rows(rows[:2], "kernels", results_dir=tmp_path)
    assert p1 == tmp_path / "kernels.jsonl"
    p2 = append_rows(rows[2:], tmp_path / "kernels.jsonl")
    assert p2 == p1
    lines = p1.read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first["op"] == "rope3d" and first["kind"] == "modelled" and first["bytes"] == 287_539_200
    assert {"git_sha", "command", "status", "config"} <= set(first)
    assert read_rows(p1) == rows


def test_results_path_default_and_bad_name() -> None:
    assert (
        results_path("kernels") == Path(__file__).resolve().parents[1] / "perf" / "results" / "kernels.jsonl"
    )
    with pytest.raises(ValueError, match="name"):
        results_path("../x")


def test_append_rejects_non_rows(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="BenchRow"):
        append_rows([{"op": "x"}], "bad", results_dir=tmp_path)  # type: ignore[list-item]
    assert not (tmp_path / "bad.jsonl").exists()


def test_read_rows_names_bad_line(tmp_path: Path) -> None:
    p = tmp_path / "r.jsonl"
    p.write_text(_row().to_json() + "\n" + json.dumps({"op": "x", "nonsense": 1}) + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2"):
        read_rows(p)


def test_run_case_error_row() -> None:
    def boom() -> dict[str, float]:
        raise RuntimeError("PSUM bank overflow")

    row = run_case(boom, op="attention", variant="nki", config={"Lq": 128}, kind="modelled")
    assert row.status == "error"
    assert "RuntimeError: PSUM bank overflow" in row.message
    assert "test_perf_runner.py" in row.message
    assert row.latency_us is None


def test_run_case_figures_and_extra() -> None:
    row = run_case(
        lambda: {"latency_us": 12.5, "descriptors": 256, "speedup": 3.0, "extra": {"note": "x"}},
        op="rope3d",
        variant="nki",
        config={"L": 256},
        kind="measured",
    )
    assert row.status == "ok" and row.kind == "measured"
    assert row.latency_us == 12.5 and row.descriptors == 256
    assert row.extra == {"note": "x", "speedup": 3.0}
    bad = run_case(lambda: 42, op="x", variant="y", config={}, kind="measured")
    assert bad.status == "error" and "mapping of figures" in bad.message
    with pytest.raises(ValueError, match="kind"):
        run_case(lambda: {}, op="x", variant="y", config={}, kind="guess")


def test_run_case_from_kernel_profile() -> None:
    rec = TraceRecord(
        op="dma_copy",
        engine="dma",
        shapes=((128, 1024), (128, 1024)),
        dtypes=("bfloat16", "bfloat16"),
        buffers=("sbuf", "hbm"),
        partitions=128,
        free_elems=1024,
        bytes_read=128 * 2048,
        bytes_written=128 * 2048,
        descriptors=((2048, 128),),
        direction="hbm->sbuf",
    )
    t = Trace(kernel_name="load")
    t.add(rec, 10)
    prof = profile(t)
    row = run_case(lambda: prof, op="load", variant="nki", config={"n": 10}, kind="modelled")
    assert row.status == "ok"
    assert row.latency_us == pytest.approx(prof.latency_ns / 1e3)
    assert row.bytes == 10 * 128 * 2048 and row.hbm_bytes == 10 * 128 * 2048
    assert row.descriptors == 1280
    assert row.extra["dma_bound_us"] == pytest.approx(prof.dma_bound_ns / 1e3)
    assert figures_from_profile(prof, hbm_bytes_min=5)["hbm_bytes_min"] == 5


def test_table_shows_kind_and_only_used_figures(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        _row(latency_us=781.25, tensore_util=0.734),
        _row(variant="naive_stride2", status="error", message="x" * 100),
        _row(op="decode", variant="cpu", kind="measured", latency_us=1234567.0),
    ]
    text = format_table(rows)
    lines = text.splitlines()
    header = lines[0].split()
    assert header[:5] == ["op", "variant", "kind", "status", "config"]
    assert "latency_us" in header and "tensore_util" in header and "message" in header
    assert "fps" not in header and "bytes" not in header
    assert "modelled" in lines[2] and "measured" in lines[4]
    assert "73.4%" in lines[2] and "781.250" in lines[2] and "1,234,567.0" in lines[4]
    assert "..." in lines[3]
    assert "errors: 1" in lines[-1]
    # columns aligned: every data line places 'kind' at the same offset
    col = lines[0].index("kind")
    assert all(ln[col : col + 8].strip() in {"modelled", "measured", "----"} for ln in lines[2:5])
    print_table(rows)
    assert capsys.readouterr().out.strip() == text
    assert format_table([]) == "(no rows)"


def test_time_call_measures() -> None:
    calls: list[int] = []
    us = time_call(lambda: calls.append(1), repeat=3, warmup=2)
    assert len(calls) == 5 and us >= 0
    with pytest.raises(ValueError, match="repeat"):
        time_call(lambda: None, repeat=0)
    assert set(FIGURES) >= {"latency_us", "bytes", "descriptors", "tensore_util", "fps", "memory_bytes"}


def test_committed_result_rows_record_portable_commands() -> None:
    """Every row under perf/results records its command as ``python ...`` relative to the repository, never
    an interpreter or file path of the machine that ran it."""
    rows = [
        (path.name, json.loads(line))
        for path in sorted((Path(__file__).resolve().parents[1] / "perf" / "results").glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    assert rows
    for name, row in rows:
        cmd = row.get("command", "")
        assert cmd.startswith("python "), (name, cmd)
        assert not any(a.startswith("/") for a in cmd.split()), (name, cmd)
