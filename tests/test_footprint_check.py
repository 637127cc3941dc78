"""The HBM footprint model (``perf.footprint``, arithmetic) against the allocations of the sharded CPU
stream (``perf.footprint_check``): bytes of the tensors every rank holds, reported by the ranks.

Tolerance: none (byte counts are exact). The configuration is chosen so rounding matters: 45-token blocks
(15 tokens per frame) split over SP2 as 23 + 22, so the busiest rank's share is ``ceil(T / sp)`` and the
chip total is the whole cache; TP2 x SP2 on 4 gloo ranks, fp32.
"""

from __future__ import annotations

import dataclasses

import pytest

from perf.footprint_check import ITEMS, LAYOUTS, check, table_lines
from rolling_forcing.config import PipelineConfig
from tests.pipeline_helpers import TINY

ODD = dataclasses.replace(TINY, name="tiny-odd", latent_height=6, latent_width=10)


@pytest.mark.distributed
def test_footprint_items_equal_the_sharded_streams_allocations() -> None:
    p = PipelineConfig()
    t = p.tokens_per_block(ODD)
    assert t % 2 == 1  # the SP split is uneven
    rows = {
        layout: {r.item: r for r in check(ODD, cores=4, tp=2, kv_cache=layout, dtype="float32")}
        for layout in LAYOUTS
    }
    print("\n" + "\n".join(table_lines([r for by in rows.values() for r in by.values()])))
    for layout, by in rows.items():
        assert set(by) == set(ITEMS)
        for r in by.values():
            assert r.exact, (layout, r)
            assert r.plan == "TP2xSP2"
    sh, rep = rows["sp_sharded"], rows["replicated"]
    # independent hand figures: one layer's k and v of 6 local heads x 16 dims in fp32 per token
    row = 6 * ODD.head_dim * 2 * 4
    assert sh["kv_cache"].measured_per_core == p.buffer_slots * (t // 2 + 1) * row * ODD.num_layers
    assert sh["kv_cache"].measured_per_chip == p.buffer_slots * t * 2 * row * ODD.num_layers  # whole cache
    assert rep["kv_cache"].measured_per_chip == 2 * sh["kv_cache"].measured_per_chip  # x sp
    assert sh["kv_gather_buffer"].measured_per_core == p.buffer_slots * t * row  # one whole layer
    assert rep["kv_gather_buffer"].measured_per_chip == 0
    # compact: a ring one slot shorter, the same whole-layer gather, the text k/v once per chip (16 text
    # tokens over 4 ranks: 4 each) plus one whole text layer gathered per rank
    co = rows["sp_compact"]
    assert co["kv_cache"].measured_per_core == (p.buffer_slots - 1) * (t // 2 + 1) * row * ODD.num_layers
    assert co["kv_gather_buffer"].measured_per_core == sh["kv_gather_buffer"].measured_per_core
    text_layer = ODD.text_len * ODD.dim * 2 * 4
    assert (
        co["text_kv"].measured_per_chip == text_layer * ODD.num_layers == sh["text_kv"].measured_per_chip // 4
    )
    assert co["text_kv_gather_buffer"].measured_per_core == text_layer
    assert (
        sh["text_kv_gather_buffer"].measured_per_chip == rep["text_kv_gather_buffer"].measured_per_chip == 0
    )


def test_saved_rows_read_back_as_the_newest_run(tmp_path) -> None:
    """Rows saved as perf.runner BenchRows come back unchanged, and only the newest run_id's."""
    from perf.footprint_check import CheckRow, latest_rows
    from perf.runner import append_rows

    old = CheckRow("tiny", "TP2xSP2", "float32", "sp_sharded", "kv_cache", 10, 10, 40, 40)
    new = [
        CheckRow("mid", "TP4xSP2", "bfloat16", "replicated", "text_kv", 7, 7, 56, 56),
        CheckRow("mid", "TP4xSP2", "bfloat16", "replicated", "kv_cache", 9, 8, 72, 64),
    ]
    path = tmp_path / "footprint_check.jsonl"
    append_rows([old.bench_row("2026-12-01T00:00:00+00:00")], path)
    append_rows([r.bench_row("2026-12-02T00:00:00+00:00") for r in new], path)
    assert latest_rows(path) == new
    assert [r.exact for r in latest_rows(path)] == [True, False]
    assert latest_rows(tmp_path / "missing.jsonl") == []
