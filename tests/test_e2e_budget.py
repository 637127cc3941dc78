"""The per-chunk budget table (perf/e2e/budget.py) against hand-computed rooflines on a synthetic chunk."""

from __future__ import annotations

import pytest

from perf.e2e.budget import budget_lines, budget_rows, layer_path_lines
from perf.e2e.chunk import ChunkModel
from perf.e2e.components import Component
from perf.e2e.params import E2EParams

P = E2EParams()
CORES = 8


def _chunk(scale: float, end: str) -> ChunkModel:
    peak, bw = P.peak_flops_per_core, P.hbm_Bps_per_core
    comps = (
        # 1 ms of FLOPs per core at peak, modelled at 4 ms x scale, 30 calls
        Component(
            "attn_denoise",
            "attention",
            4e-3 * scale,
            30,
            int(1e-3 * peak * CORES),
            1,
            True,
            "t",
            hbm_bytes=int(0.1e-3 * bw),
            bound="vector",
        ),
        # 2 ms of bytes per core, modelled at 2.5 ms, 30 calls
        Component(
            "gelu_tanh", "elementwise", 2.5e-3, 30, 0, 1, True, "t", hbm_bytes=int(2e-3 * bw), bound="hbm"
        ),
        Component("sharding_comm", "comm", 1e-3 * scale, 30, 0, 0, True, "t", 2, bound="collective"),
        Component(
            "qkv_proj",
            "linear",
            1.1e-3,
            30,
            int(1e-3 * peak * CORES),
            1,
            True,
            "t",
            hbm_bytes=1000,
            bound="tensor",
        ),
        Component("kernel_fixed", "kernel_fixed", 1e-5, 100, 0, 0, False, "t"),
    )
    return ChunkModel("merged", CORES, "TP4xSP2", 4, 2, comps, 12, P, end)


def test_rooflines_gaps_and_order_match_hand_computation() -> None:
    opt, pess = _chunk(1.0, "optimistic"), _chunk(2.0, "pessimistic")
    rows = {r.name: r for r in budget_rows(opt, pess)}
    a = rows["attn_denoise"]
    assert a.roofline_kind == "flops"
    assert a.roofline_ms == pytest.approx(30 * 1.0, rel=1e-6)
    assert a.ms_pess == pytest.approx(30 * 8.0) and a.ms_opt == pytest.approx(30 * 4.0)
    assert a.gap_ms == pytest.approx(240 - 30, rel=1e-6) and a.gap_x == pytest.approx(8.0, rel=1e-6)
    g = rows["gelu_tanh"]
    assert g.roofline_kind == "bytes" and g.roofline_ms == pytest.approx(60.0, rel=1e-6)
    assert rows["sharding_comm"].roofline_ms == 0 and rows["sharding_comm"].gap_x is None
    assert rows["kernel_fixed"].bound == "fixed time"
    gaps = [r.gap_ms for r in budget_rows(opt, pess)]
    assert gaps == sorted(gaps, reverse=True)
    assert budget_rows(opt, pess)[0].name == "attn_denoise"


def test_total_line_gives_the_roofline_fps() -> None:
    opt, pess = _chunk(1.0, "optimistic"), _chunk(2.0, "pessimistic")
    roof_ms = 30 * 1.0 + 30 * 2.0 + 30 * 1.0  # attention + gelu + qkv (comm / fixed: 0)
    total = budget_lines(opt, pess)[-1]
    assert f"**{roof_ms:,.2f}**" in total
    assert f"{12 / (roof_ms / 1e3):.1f} fps" in total


def test_mismatched_chunks_are_rejected() -> None:
    a = _chunk(1.0, "optimistic")
    b = ChunkModel("merged", CORES, "TP4xSP2", 4, 2, a.components[:2], 12, P, "pessimistic")
    with pytest.raises(ValueError, match="same chunk model"):
        budget_rows(a, b)


def test_layer_path_follows_execution_order_and_marks_sync_points() -> None:
    opt, pess = _chunk(1.0, "optimistic"), _chunk(2.0, "pessimistic")
    line = layer_path_lines(opt, pess)[0]
    order = [line.index(n) for n in ("qkv_proj", "sharding_comm", "attn_denoise", "gelu_tanh")]
    assert order == sorted(order)
    assert "sharding_comm 2.00-1.00 [all cores wait]" in line
    assert "attn_denoise 8.00-4.00" in line
