"""Trace replay: every kernel's instruction stream at fixed small shapes equals the stored
one in tests/data/trace_replay.json (records, program order, memory regions, counts per engine:op).

A failure prints the diff (counts that changed, the first differing instruction). If the change is intended,
regenerate with ``python -m tools.trace_replay --update`` and say why in the commit message
(docs/testing.md, "Trace replay")."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tools import trace_replay as tr

pytestmark = pytest.mark.emulator

CASES = {c.name: c for c in tr.cases()}


@pytest.fixture(scope="module")
def stored() -> dict[str, dict[str, Any]]:
    data = tr.load()
    assert data, f"{tr.DATA_PATH} is missing or of another format; run {tr.REGEN}"
    return data


def test_stored_file_holds_exactly_the_defined_cases(stored: dict[str, dict[str, Any]]) -> None:
    assert sorted(stored) == sorted(CASES), f"cases and stored file disagree; run {tr.REGEN}"


def test_stored_file_is_compact() -> None:
    assert tr.DATA_PATH.stat().st_size < 400_000


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_trace_replays(name: str, stored: dict[str, dict[str, Any]]) -> None:
    case = CASES[name]
    entry = tr.capture(case)
    assert _recount(entry) == entry["counts"], "event log and aggregated counts disagree"
    lines = tr.diff(stored.get(name), entry, case)
    assert not lines, (
        f"{name} ({'.'.join(case.kernel)}, lnc={case.lnc}) no longer issues the stored stream:\n  "
        + "\n  ".join(lines)
        + f"\nIf intended: {tr.REGEN} and say why in the commit message."
    )


# --------------------------------------------------------------------------------------------------
# the torch-facing entries launch the traced kernels (real data, not trace-only: the same stream)


def _bf(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _f32(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rope() -> None:
    from nki_kernels.rope3d import rope3d_emulated

    rope3d_emulated(_bf(2, 200, 2, 16), _bf(2, 200, 2, 16, seed=1), (2, 10, 10))


def _rope_tables() -> None:
    from nki_kernels.rope3d import rope3d_tables_emulated

    rope3d_tables_emulated(
        _bf(2, 1100, 2, 16), _bf(2, 1100, 2, 16, seed=1), _f32(1100, 8), _f32(1100, 8), lnc=2
    )


def _rope_one() -> None:
    from nki_kernels.rope3d import rope3d_one_tables_emulated

    rope3d_one_tables_emulated(_bf(1, 2600, 12, 64), _f32(2600, 32), _f32(2600, 32), lnc=2)


def _attention() -> None:
    from nki_kernels.attention import attention_emulated

    kv = _bf(1, 1100, 2, 64, seed=1)
    attention_emulated(_bf(1, 200, 2, 64), kv, kv, 0.125, True, lnc=2)


def _segments() -> None:
    from nki_kernels.attention import attention_segments_emulated

    kv = _f32(1, 900, 2, 64, seed=1)
    attention_segments_emulated(_f32(1, 130, 2, 64), kv, kv, ((10, 530), (899, 1)), 0.125, False)


def _block_table() -> None:
    from nki_kernels.attention_block_table import attention_block_table_emulated

    srcs = [_bf(1, 256, 2, 64, seed=1), _bf(1, 96, 2, 64, seed=2)]
    table = torch.tensor([[[0, 3], [1, 0], [-1, 0]], [[0, 0], [0, 7], [1, 2]]], dtype=torch.int32)
    attention_block_table_emulated(_bf(1, 96, 2, 64), srcs, srcs, table, (32, 64), 32, 0.125, True, lnc=2)


def _kv_write() -> None:
    from nki_kernels.kv_cache import kv_cache_write_emulated

    kv_cache_write_emulated(
        _bf(2, 96, 3, 16), _bf(2, 96, 3, 16), _bf(2, 32, 3, 16), _bf(2, 32, 3, 16), 2, lnc=2
    )


def _kv_slide() -> None:
    from nki_kernels.kv_cache import kv_cache_slide_emulated

    kv_cache_slide_emulated(_bf(2, 100, 3, 16), _bf(2, 100, 3, 16), _bf(2, 30, 3, 16), _bf(2, 30, 3, 16), 10)


def _linear() -> None:
    from nki_kernels.linear import linear_emulated

    linear_emulated(_bf(300, 200), _bf(200, 600, seed=1), _f32(600), lnc=1)


def _conv() -> None:
    from nki_kernels.conv3d import conv3d_causal_emulated

    conv3d_causal_emulated(_f32(130, 2, 5, 7), _f32(9, 130, 20, seed=1), None, (1, 3, 3))


def _adaln() -> None:
    from nki_kernels.elementwise import adaln_norm_modulate_emulated

    rows = _f32(1, 3, 520, seed=1)
    adaln_norm_modulate_emulated(_f32(1, 450, 520), rows, rows, 1e-6, out_dtype=torch.bfloat16)


def _gate() -> None:
    from nki_kernels.elementwise import gate_residual_emulated

    gate_residual_emulated(_f32(1, 450, 520), _bf(1, 450, 520, seed=1), _f32(1, 3, 520, seed=2), lnc=2)


def _rms() -> None:
    from nki_kernels.elementwise import rms_norm_emulated

    rms_norm_emulated(_bf(1, 200, 520), _f32(520, seed=1), 1e-6)


def _gelu() -> None:
    from nki_kernels.elementwise import gelu_tanh_emulated

    gelu_tanh_emulated(_bf(1, 300, 2100), lnc=2)


def _gate_adaln() -> None:
    from nki_kernels.elementwise_fused import gate_residual_adaln_emulated

    rows = _f32(1, 3, 520, seed=2)
    gate_residual_adaln_emulated(_f32(1, 450, 520), _bf(1, 450, 520, seed=1), rows, rows, rows, 1e-6, lnc=2)


ENTRIES: dict[str, tuple[Callable[[], None], str]] = {
    "gate_residual_adaln_emulated": (_gate_adaln, "gate_residual_adaln_lnc2"),
    "adaln_norm_modulate_emulated": (_adaln, "adaln_fp32_to_bf16_lnc1"),
    "gate_residual_emulated": (_gate, "gate_residual_fp32_bf16_lnc2"),
    "rms_norm_emulated": (_rms, "rms_norm_bf16_lnc1"),
    "gelu_tanh_emulated": (_gelu, "gelu_tanh_bf16_lnc2"),
    "rope3d_emulated": (_rope, "rope3d_bf16_lnc1"),
    "rope3d_tables_emulated": (_rope_tables, "rope3d_bf16_lnc2"),
    "rope3d_one_tables_emulated": (_rope_one, "rope3d_one_bf16_lnc2"),
    "attention_emulated": (_attention, "attention_bf16_lse_lnc2_static"),
    "attention_segments_emulated": (_segments, "attention_segments_fp32_lnc1_static"),
    "attention_block_table_emulated": (_block_table, "attention_block_table_bf16_lse_lnc2_static"),
    "kv_cache_write_emulated": (_kv_write, "kv_cache_write_bf16_lnc2"),
    "kv_cache_slide_emulated": (_kv_slide, "kv_cache_slide_bf16_lnc1"),
    "linear_emulated": (_linear, "linear_bf16_bias_lnc1"),
    "conv3d_causal_emulated": (_conv, "conv3d_fp32_k133"),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_entry_launches_the_replayed_kernel(
    entry: str, stored: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry (what ``ops`` dispatches to) launches the case's kernel at its lnc, and the stream a
    real-data run issues is the stored trace-only one."""
    from nki_kernels import _nki
    from nki_kernels.emulator import run

    launched: list[tuple[Any, int, Any]] = []

    def launch(kernel: Any, *args: Any, lnc: int = 1, **kwargs: Any) -> tuple[Any, Any]:
        out, trace = run(kernel, *args, lnc=lnc, keep_events=True, **kwargs)
        launched.append((kernel, lnc, trace))
        return out, trace

    monkeypatch.setattr(_nki, "launch", launch)
    call, name = ENTRIES[entry]
    call()
    case = CASES[name]
    assert len(launched) == 1
    kernel, lnc, trace = launched[0]
    assert kernel is tr.kernel_of(case) and lnc == case.lnc
    assert tr.diff(stored[name], tr.capture_trace(trace, case)) == []


# --------------------------------------------------------------------------------------------------
# the diff itself: a planted change is reported where it is


@pytest.fixture(scope="module")
def attention_entry() -> dict[str, Any]:
    return tr.capture(CASES["attention_bf16_lse_lnc2"])


def _position_of_first(entry: dict[str, Any], pred: Callable[[list[Any]], bool]) -> tuple[int, int]:
    """(instruction position, record index) of the first instruction whose record satisfies ``pred``."""
    order = tr._expand(entry)
    pos = next(p for p, i in enumerate(order) if pred(entry["records"][i]))
    return pos, order[pos]


def test_diff_reports_a_swapped_engine(attention_entry: dict[str, Any]) -> None:
    new = copy.deepcopy(attention_entry)
    pos, i = _position_of_first(new, lambda r: r[0] == "tensor_copy" and r[1] == "vector")
    n = sum(run for j, run in new["order"] if j == i)
    new["records"][i][1] = "scalar"
    lines = tr.diff(attention_entry, {**new, "counts": _recount(new)})
    assert f"count scalar:tensor_copy: 0 -> {n}" in lines
    k = attention_entry["counts"]["vector:tensor_copy"]
    assert f"count vector:tensor_copy: {k} -> {k - n}" in lines
    assert f"first differing instruction #{pos} of 176 -> 176:" in lines
    assert '  fields: engine: "vector" -> "scalar"' in lines


def test_diff_reports_a_reordering_with_equal_counts(attention_entry: dict[str, Any]) -> None:
    new = copy.deepcopy(attention_entry)
    order = tr._expand(new)
    pos = next(p for p in range(len(order) - 1) if new["records"][order[p]] != new["records"][order[p + 1]])
    order[pos], order[pos + 1] = order[pos + 1], order[pos]
    new["order"] = [[i, 1] for i in order]
    lines = tr.diff(attention_entry, new)
    assert lines[0] == f"first differing instruction #{pos} of 176 -> 176:"
    assert not any(line.startswith("count ") for line in lines)


def test_diff_reports_a_changed_region_and_a_dropped_instruction(attention_entry: dict[str, Any]) -> None:
    new = copy.deepcopy(attention_entry)
    new["regions"][37] = "00000000"
    lines = tr.diff(attention_entry, new, CASES["attention_bf16_lse_lnc2"])
    assert lines[0].startswith("first instruction whose memory regions differ: #37 ")
    assert lines[1] == "  now: " + tr.regions_at(CASES["attention_bf16_lse_lnc2"], 37)
    assert "write " in lines[1]
    order = tr._expand(attention_entry)[:-1]
    new = {**copy.deepcopy(attention_entry), "order": [[i, 1] for i in order], "regions": new["regions"][:-1]}
    assert tr.diff(attention_entry, new)[-1].startswith(
        "program order: 176 -> 175 instructions, equal up to #175"
    )
    assert tr.diff(attention_entry, copy.deepcopy(attention_entry)) == []


def test_update_round_trips_and_reports_new_and_stale_cases(tmp_path: Any) -> None:
    """``dumps`` / ``load`` keep an entry exactly; ``compare`` names a case missing from the file and one the
    file holds that is no longer defined."""
    names = ["kv_cache_write_bf16_lnc1", "kv_cache_slide_bf16_lnc1"]
    entries = {n: tr.capture(CASES[n]) for n in names}
    path = tmp_path / "replay.json"
    path.write_text(tr.dumps({names[0]: entries[names[0]], "gone": entries[names[1]]}))
    assert tr.load(path)[names[0]] == entries[names[0]]
    _, diffs = tr.compare(names, path=path)
    assert diffs == {names[1]: ["new case (not in the stored file)"]}
    cheap = dict.fromkeys(CASES, entries[names[0]])  # every defined case "captured" as this one entry
    _, diffs = tr.compare(None, path=path, capture_fn=lambda c: cheap[c.name])
    assert diffs["gone"] == ["stored case no longer defined in tools/trace_replay.py cases()"]
    assert names[0] not in diffs
    with pytest.raises(ValueError, match="--case: unknown case"):
        tr.compare(["no_such_case"], path=path)


def _recount(entry: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for i, n in entry["order"]:
        r = entry["records"][i]
        counts[f"{r[1]}:{r[0]}"] = counts.get(f"{r[1]}:{r[0]}", 0) + n
    return counts


def test_every_trace_record_field_is_stored() -> None:
    """A field added to ``TraceRecord`` must be added to the stored rows (and the file regenerated), or it
    would go unguarded."""
    import dataclasses

    from nki_kernels.emulator import TraceRecord

    assert tuple(f.name for f in dataclasses.fields(TraceRecord)) == tr.RECORD_FIELDS
