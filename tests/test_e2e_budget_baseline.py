"""Before and after (perf/e2e/budget_baseline.py): the baseline reader against small temp jsonl files, the
table's numbers against its inputs, and the tracked perf/results/e2e.jsonl holding the baseline rows."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from perf.e2e.budget_baseline import (
    BASELINE_JSONL,
    BASELINE_SHA,
    before_after_lines,
    before_after_rows,
    before_after_table,
    read_baseline,
)
from perf.e2e.chunk import ChunkModel
from perf.e2e.components import Component
from perf.e2e.params import E2EParams

CFG = {"preset": "wan2.1-1.3b", "height": 480, "width": 832, "cores": 8, "plan": "TP4xSP2"}
# baseline groups, ms per chunk (binary-exact sums: the reader checks they add up to latency_us / 1e3)
G_PESS = {"attention": 500.0, "vae": 150.0, "linear": 100.0, "barrier": 2.5}
G_OPT = {"attention": 400.0, "vae": 125.0, "linear": 75.0, "barrier": 0.5}
FRAMES = 12


def _row(variant: str, sha: str, groups: dict[str, float], **over: Any) -> dict[str, Any]:
    chunk_ms = sum(groups.values())
    row = {
        "op": "e2e_chunk",
        "variant": variant,
        "config": CFG,
        "kind": "modelled",
        "status": "ok",
        "latency_us": chunk_ms * 1e3,
        "fps": FRAMES / (chunk_ms / 1e3),
        "extra": {"end": variant.split("/")[-1], "groups_ms": groups},
        "git_sha": sha,
        "timestamp": "2026-12-02T09:15:56+00:00",
    }
    return {**row, **over}


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _decoys() -> list[dict[str, Any]]:
    """Rows the reader must skip: another sha, another variant at the sha, another op at the sha."""
    other = {"attention": 1.0}
    return [
        _row("merged/pessimistic", "ffff000", other),
        _row("merged/optimistic", "ffff000", other),
        _row("two_pass/pessimistic", "abc1234", other),
        _row("two_pass/optimistic", "abc1234", other),
        _row("merged/pessimistic", "abc1234", other, op="e2e_peer"),
    ]


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    rows = [
        *_decoys()[:2],
        _row("merged/pessimistic", "abc1234", G_PESS),
        *_decoys()[2:],
        _row("merged/optimistic", "abc1234", G_OPT),
    ]
    return _write(tmp_path / "e2e.jsonl", rows)


def test_reader_reads_both_ends_of_the_named_sha(jsonl: Path) -> None:
    b = read_baseline(jsonl, "abc12")
    assert b.git_sha == "abc1234" and b.variant == "merged" and dict(b.config) == CFG
    assert dict(b.groups_ms["pessimistic"]) == G_PESS
    assert dict(b.groups_ms["optimistic"]) == G_OPT
    assert dict(b.chunk_ms) == {"pessimistic": 752.5, "optimistic": 600.5}
    assert b.fps["pessimistic"] == FRAMES / 0.7525 and b.fps["optimistic"] == FRAMES / 0.6005


def test_reader_wrong_sha_is_an_error_naming_the_sha(jsonl: Path) -> None:
    with pytest.raises(ValueError, match=r"merged/pessimistic.*git_sha starting 'abc9'"):
        read_baseline(jsonl, "abc9")


def test_reader_one_end_missing_names_the_end(tmp_path: Path) -> None:
    path = _write(tmp_path / "e.jsonl", [_row("merged/pessimistic", "abc1234", G_PESS)])
    with pytest.raises(ValueError, match=r"'merged/optimistic' with git_sha starting 'abc1234'"):
        read_baseline(path, "abc1234")


@pytest.mark.parametrize("prefix", ["", "abc", "ABC1234", "abc123z", 1234567])
def test_reader_rejects_a_malformed_sha_prefix(jsonl: Path, prefix: Any) -> None:
    with pytest.raises(ValueError, match=r"sha_prefix must be 4-40 lowercase hex digits"):
        read_baseline(jsonl, prefix)


def test_reader_missing_file_and_bad_rows(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a file"):
        read_baseline(tmp_path / "absent.jsonl", "abc1234")
    bad = dict(_row("merged/optimistic", "abc1234", G_OPT), latency_us=601.5e3)  # groups sum to 600.5 ms
    path = _write(tmp_path / "a.jsonl", [_row("merged/pessimistic", "abc1234", G_PESS), bad])
    with pytest.raises(ValueError, match=r"add up to 600\.500000 ms, not the row's chunk 601\.500000"):
        read_baseline(path, "abc1234")
    err = _row("merged/optimistic", "abc1234", G_OPT, status="error")
    path = _write(tmp_path / "b.jsonl", [_row("merged/pessimistic", "abc1234", G_PESS), err])
    with pytest.raises(ValueError, match=r"status 'ok'"):
        read_baseline(path, "abc1234")


def test_reader_ambiguous_prefix_is_an_error_identical_resave_is_not(tmp_path: Path) -> None:
    p, o = _row("merged/pessimistic", "abc1234", G_PESS), _row("merged/optimistic", "abc1234", G_OPT)
    other = _row("merged/pessimistic", "abc1299", {**G_PESS, "vae": 151.0})
    with pytest.raises(ValueError, match=r"2 different e2e_chunk rows 'merged/pessimistic'.*abc1299"):
        read_baseline(_write(tmp_path / "a.jsonl", [p, o, other]), "abc12")
    b = read_baseline(_write(tmp_path / "b.jsonl", [p, o, p, o]), "abc12")  # same run saved twice
    assert dict(b.groups_ms["pessimistic"]) == G_PESS


def test_tracked_results_hold_the_baseline_rows() -> None:
    """The figures the real-time work started from: 1,018.7 / 814.7 ms per chunk, 11.78-14.73 fps."""
    tracked = Path(__file__).resolve().parents[1] / "perf" / "results" / "e2e.jsonl"
    assert tracked == BASELINE_JSONL
    b = read_baseline()
    assert b.git_sha == BASELINE_SHA == "d031b26"
    assert (round(b.chunk_ms["pessimistic"], 1), round(b.chunk_ms["optimistic"], 1)) == (1018.7, 814.7)
    assert (round(b.fps["pessimistic"], 2), round(b.fps["optimistic"], 2)) == (11.78, 14.73)
    groups = {"attention", "vae", "linear", "comm", "cross_attention", "elementwise", "rope", "barrier"}
    groups |= {"kernel_fixed", "launch", "kv_write"}
    assert set(b.groups_ms["pessimistic"]) == set(b.groups_ms["optimistic"]) == groups
    assert dict(b.config) == CFG


# -- the table -----------------------------------------------------------------------------------------

P = E2EParams()
# now, ms per chunk: attention faster, vae the same (pess.: 1e-9 ms less), linear slower, barrier gone,
# elementwise new
N_PESS = {"attention": 300.0, "vae": 150.0 - 1e-9, "linear": 110.0, "elementwise": 20.0}
N_OPT = {"attention": 250.0, "vae": 125.0, "linear": 80.0, "elementwise": 10.0}


def _chunk(groups: dict[str, float], end: str, variant: str = "merged") -> ChunkModel:
    # each group as 4 calls of a quarter of its time: by_group must sum the calls
    comps = tuple(Component(f"{g}_c", g, ms / 4e3, 4) for g, ms in groups.items())
    return ChunkModel(variant, 8, "TP4xSP2", 4, 2, comps, FRAMES, P, end)


def _cells(line: str) -> list[str]:
    return [c.strip().strip("*") for c in line.strip().strip("|").split("|")]


def _nums(cell: str) -> tuple[float, float]:
    a, b = cell.split(" / ")
    return float(a.replace(",", "")), float(b.replace(",", ""))


def test_table_numbers_are_the_inputs_and_their_difference(jsonl: Path) -> None:
    base = read_baseline(jsonl, "abc1234")
    opt, pess = _chunk(N_OPT, "optimistic"), _chunk(N_PESS, "pessimistic")
    lines = before_after_table(base, opt, pess)
    assert _cells(lines[0]) == ["group", "before", "now", "change"]
    body = {_cells(ln)[0]: _cells(ln)[1:] for ln in lines[2:]}
    groups = set(G_PESS) | set(N_PESS)
    assert set(body) == groups | {"chunk", "fps"}
    for g in groups:
        before = (G_PESS.get(g, 0.0), G_OPT.get(g, 0.0))
        now = (N_PESS.get(g, 0.0), N_OPT.get(g, 0.0))
        got = [_nums(c) for c in body[g]]
        assert got[0] == pytest.approx(before, abs=0.005), g  # printed to 2 decimals
        assert got[1] == pytest.approx(now, abs=0.005), g
        assert got[2] == pytest.approx((now[0] - before[0], now[1] - before[1]), abs=0.005), g
    # attention: 500 -> 300 and 400 -> 250 printed with the sign of the change
    assert body["attention"][2] == "-200.00 / -150.00" and body["linear"][2] == "+10.00 / +5.00"
    assert body["vae"][2] == "0.00 / 0.00"  # no change at the printed precision: no sign
    assert [_nums(c) for c in body["chunk"]] == [(752.5, 600.5), (580.0, 465.0), (-172.5, -135.5)]
    fb, fn = (FRAMES / 0.7525, FRAMES / 0.6005), (FRAMES / 0.580, FRAMES / 0.465)
    got = [_nums(c) for c in body["fps"]]
    assert got[0] == pytest.approx(fb, abs=0.005) and got[1] == pytest.approx(fn, abs=0.005)
    assert got[2] == pytest.approx((fn[0] - fb[0], fn[1] - fb[1]), abs=0.01)  # two roundings
    # order: the baseline's pessimistic ms, largest first; the new group last
    assert [_cells(ln)[0] for ln in lines[2:-2]] == ["attention", "vae", "linear", "barrier", "elementwise"]


def test_rows_check_the_chunks_ends_and_variant(jsonl: Path) -> None:
    base = read_baseline(jsonl, "abc1234")
    opt, pess = _chunk(N_OPT, "optimistic"), _chunk(N_PESS, "pessimistic")
    rows = {r.group: r for r in before_after_rows(base, opt, pess)}
    assert (rows["barrier"].now_pess, rows["barrier"].change_opt) == (0.0, -0.5)
    with pytest.raises(
        ValueError, match=r"'merged' chunk at the optimistic end, got 'merged' at 'pessimistic'"
    ):
        before_after_rows(base, pess, pess)
    with pytest.raises(ValueError, match=r"got 'two_pass'"):
        before_after_rows(base, opt, _chunk(N_PESS, "pessimistic", "two_pass"))


def _result(preset: str = "wan2.1-1.3b", height: int = 480) -> Any:
    chunks = {("merged", "optimistic"): _chunk(N_OPT, "optimistic")}
    chunks[("merged", "pessimistic")] = _chunk(N_PESS, "pessimistic")
    return SimpleNamespace(
        model=SimpleNamespace(name=preset), height=height, width=832, chunk=lambda v, e: chunks[(v, e)]
    )


def test_section_lines_and_another_configuration(jsonl: Path) -> None:
    lines = before_after_lines(_result(), jsonl, "abc1234")
    assert lines[1].startswith(
        "Before and after (modelled, merged forward, per chunk, ms pessimistic / optimistic): before = "
    )
    assert "abc1234" in lines[1]
    base = read_baseline(jsonl, "abc1234")
    r = _result()
    assert lines[3:] == before_after_table(
        base, r.chunk("merged", "optimistic"), r.chunk("merged", "pessimistic")
    )
    other = before_after_lines(_result("tiny", 64), jsonl, "abc1234")
    assert len(other) == 2 and re.search(r"not shown, the baseline \(abc1234: .*'height': 480", other[1])
    assert "'height': 64" in other[1]


def test_cli_summary_prints_the_table_after_the_guard_rows() -> None:
    from perf.e2e.cli import _with_before_after

    head = [
        "MODELLED ...",
        "  merged ...",
        "  guard trips (merged, ...)",
        "  guard trips (eager, ...)",
        "Peer ...",
    ]
    assert _with_before_after(head, ["T1", "T2"]) == [*head[:4], "T1", "T2", "", "Peer ..."]
    assert _with_before_after(head[:2], ["T1"]) == [*head[:2], "T1", ""]
