"""TracedLinearProvider (perf/matmul_model.py): whole linears priced as one call of the project's linear
kernel, and the token scaling of long GEMMs checked against a direct trace."""

from __future__ import annotations

import pytest

from perf.matmul_model import LINEAR_TRACE_TOKENS, TracedLinearProvider, linear_profile

pytestmark = pytest.mark.emulator


def test_whole_linear_is_one_block_with_both_ends() -> None:
    prov = TracedLinearProvider()
    lo = linear_profile("x", 1000, 256, 700, prov, end="optimistic")
    hi = linear_profile("x", 1000, 256, 700, prov, end="pessimistic")
    assert lo.blocks == hi.blocks == 1
    assert lo.flops == 2 * 1000 * 256 * 700
    assert 0 < lo.latency_s <= hi.latency_s
    blk = prov.linear(1000, 256, 700)
    assert blk.source.startswith("traced linear kernel")
    # the fixed per-kernel time is stripped at each end (the end-to-end model charges it per call)
    assert lo.latency_s == pytest.approx(blk.latency_s - blk.fixed_s)
    assert prov.linear(1000, 256, 700) is blk  # cached


def test_long_gemm_scaling_matches_a_direct_trace() -> None:
    m = LINEAR_TRACE_TOKENS + 3 * 1024  # 11 m-blocks, traced at 8 and scaled
    scaled = TracedLinearProvider().linear(m, 256, 512)
    assert "scaled" in scaled.source
    direct_prov = TracedLinearProvider()
    import perf.matmul_model as mm

    old = mm.LINEAR_TRACE_TOKENS
    try:
        mm.LINEAR_TRACE_TOKENS = 10**9
        direct = direct_prov.linear(m, 256, 512)
    finally:
        mm.LINEAR_TRACE_TOKENS = old
    assert "scaled" not in direct.source
    # steady state: the per-block time is the same, so the scaled latency is within a few % of the trace
    assert scaled.latency_s == pytest.approx(direct.latency_s, rel=0.05)
    assert scaled.latency_high_s == pytest.approx(direct.latency_high_s, rel=0.05)


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="k must be a positive int"):
        TracedLinearProvider().linear(10, 0, 10)
