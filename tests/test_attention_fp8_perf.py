"""The FP8 attention option's tensor gate (perf/fp8_gate.py) and its pricing in the end-to-end model
(perf/e2e/fp8.py): the gate's figures against the formats' sizes, its rows, the traced FP8 kernel against the
bf16 one, and the chunk with the attention component swapped."""

from __future__ import annotations

import math

import pytest

from perf.e2e import fp8 as e2e_fp8
from perf.e2e.chunk import ChunkModel
from perf.e2e.components import Component
from perf.e2e.kernels import KernelCost
from perf.e2e.params import E2EParams
from perf.fp8_gate import GateConfig, attention_gate, gate_rows

SMALL = GateConfig(tokens=64, text_tokens=16, dim=128, ffn_dim=256, heads=2, text_dim=64, attn_tokens=2100)
"""A small block whose self-attention still spans 3 key chunks (2,100 tokens)."""


def test_attention_gate_errors_have_the_formats_sizes() -> None:
    """bf16 attention's own error is of bf16's size (below its 2**-7 floor), the FP8 path's error against
    it is larger (P and V rounded to 3 mantissa bits) but below one e4m3 half-ulp (2**-4: P's and V's
    roundings average over the keys), and the bound is the rule's."""
    g = attention_gate(SMALL)
    assert g.name == "fp8_attention" and g.m == g.k == 2100 and g.n == 128
    assert 2.0**-12 < g.err_bf16 < 2.0**-7
    assert g.err_bf16 < g.err_fp8 < 2.0**-4
    assert g.bound == pytest.approx(SMALL.factor * g.err_bf16 + SMALL.floor)


def test_gate_rows_hold_every_gate() -> None:
    rows = gate_rows(SMALL)
    ops = [r.op for r in rows]
    assert (
        ops.count("fp8_attention") == 2 and ops.count("fp8_kv_cache") == 2 and ops.count("fp8_linears") == 10
    )
    att = [r for r in rows if r.op == "fp8_attention"]
    assert [r.config["outlier_frac"] for r in att] == [SMALL.outlier_frac, 0.0]
    assert all(
        r.kind == "measured" and r.extra["passed"] == (r.extra["err_fp8"] <= r.extra["bound"]) for r in rows
    )


@pytest.mark.emulator
def test_traced_fp8_kernel_against_bf16() -> None:
    """At a small block-table shape the FP8 call moves PV time off TensorE (double-row: half the PV
    instructions) and leaves ScalarE's exps as they are; the same FLOPs."""
    shape = ((300,), 3, 1000, 1, 64)
    c8 = e2e_fp8.fp8_attention_cost(*shape)
    c16 = e2e_fp8.fp8_attention_cost(*shape, fp8=False)
    assert "fp8" in c8.source and "fp8" not in c16.source and c8.flops == c16.flops
    assert c8.engine_busy_s["tensor"] < 0.9 * c16.engine_busy_s["tensor"]
    assert c8.engine_busy_s["scalar"] == pytest.approx(c16.engine_busy_s["scalar"], rel=0.02)
    assert c8.model == c16.model == "schedule"


def test_chunk_swaps_only_the_merged_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 chunk = the bf16 chunk with the merged attention's time per call replaced by the FP8 kernel's
    at the chunk's end (30 calls), nothing else moved."""
    cost = KernelCost(2e-3, time_high_s=5e-3, model="schedule", source="fake fp8")
    monkeypatch.setattr(e2e_fp8, "fp8_attention_cost", lambda *a: cost)
    monkeypatch.setattr(e2e_fp8, "fp8_attention_shape", lambda *a: ((1,), 1, 1, 1, 1))
    comps = (Component("attn_merged", "attention", 4e-3, 30), Component("linear", "linear", 1e-3, 60))
    for end, per_call in (("optimistic", 2e-3), ("pessimistic", 5e-3)):
        ch = ChunkModel("merged", 8, "p", 4, 2, comps, 12, E2EParams(), end)
        new = e2e_fp8.fp8_attention_chunk(ch, None, None)
        assert math.isclose(new.chunk_s, ch.chunk_s - 30 * 4e-3 + 30 * per_call)
        assert new.by_group()["linear"] == ch.by_group()["linear"]
    with pytest.raises(ValueError, match="no 'attn_merged' component"):
        e2e_fp8.fp8_attention_chunk(
            ChunkModel("merged", 8, "p", 4, 2, comps[1:], 12, E2EParams()), None, None
        )


def test_targets_row_only_beside_a_traced_merged_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """No FP8-attention row without a traced bf16 merged chunk to compare with (analytic kernels), nor
    where the kernels' FP8 pass cannot run (fewer than 2,048 key positions: the quick tiny preset)."""
    from types import SimpleNamespace

    comps = (Component("attn_merged", "attention", 4e-3, 30),)
    ch = ChunkModel("merged", 8, "p", 4, 2, comps, 12, E2EParams(), "pessimistic")
    r = SimpleNamespace(
        chunks={("merged", "pessimistic"): ch}, kernels_name="analytic", model=None, pipe=None
    )
    r.chunk = lambda v, e: r.chunks[(v, e)]
    assert e2e_fp8._attention_line(r) == []
    r.kernels_name = "traced"
    monkeypatch.setattr(e2e_fp8, "fp8_attention_shape", lambda *a: ((64,), 2, 1000, 1, 64))
    assert e2e_fp8._attention_line(r) == []
