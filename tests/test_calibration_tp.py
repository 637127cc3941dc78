"""The AGENTIC-TP sensitivity (perf/calibration/tp_sensitivity.py) and the ``lhs_loads`` knob of
``agentic_transpose_kernel``: values vs numpy with reused lhs tiles, DMA/transposes counted against the
loop nest, the as-listed trace unchanged, bad arguments refused, and the full-shape rows against the
calibration table and the issue-time bound."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator.cost import Trn2CostParams
from perf.calibration import harness
from perf.calibration import kernels_matmul as km
from perf.calibration import tp_sensitivity as tps
from perf.calibration.points import POINTS

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(4321)
M, K, N = 256, 384, 1536  # 2 m-tiles, 3 k-tiles, 3 n-tiles


def _check(out: np.ndarray, lhsT: np.ndarray, rhs: np.ndarray) -> None:
    """``out ~= lhsT.T @ rhs``: fp32 accumulation bound K * 2^-24 * (|a|.T @ |b|) plus the bf16 output's
    half ulp (2^-9 relative, doubled for margin); the PE transposes move bf16 values exactly."""
    a, b = lhsT.astype(np.float64), rhs.astype(np.float64)
    ref = a.T @ b
    bound = K * 2.0**-24 * (np.abs(a).T @ np.abs(b)) + 2.0**-8 * np.abs(ref)
    assert np.all(np.abs(np.asarray(out, dtype=np.float64) - ref) <= bound)


@pytest.mark.parametrize("transpose_lhs", [True, False])
@pytest.mark.parametrize("loads", [1, 2, 3, None])
def test_lhs_loads_values_and_counts(transpose_lhs: bool, loads: int | None) -> None:
    lhsT = RNG.standard_normal((K, M)).astype(BF16)
    rhs = RNG.standard_normal((K, N)).astype(BF16)
    lhs = np.ascontiguousarray(lhsT.T) if transpose_lhs else lhsT
    out, tr = emu.run(km.agentic_transpose_kernel, lhs, rhs, transpose_lhs=transpose_lhs, lhs_loads=loads)
    _check(out, lhsT, rhs)
    mt, kt, nt = M // 128, K // 128, N // 512
    lhs_dmas = mt * kt * (nt if loads is None else loads)
    assert tr.count(op="dma_copy") == lhs_dmas + mt * nt * kt + mt * nt  # lhs + rhs + stores
    assert tr.count(op="nc_matmul") == mt * nt * kt
    assert tr.count(op="nc_transpose") == (mt * nt * kt if transpose_lhs else 0)  # never deduplicated


@pytest.mark.parametrize("bad", [0, 4, -1, 1.0, "2"])
def test_lhs_loads_refused(bad: object) -> None:
    a = np.zeros((M, K), dtype=BF16)
    b = np.zeros((K, N), dtype=BF16)
    with pytest.raises(ValueError, match=r"lhs_loads must be None or an int in 1\.\.N/512 = 3"):
        emu.run(km.agentic_transpose_kernel, a, b, lhs_loads=bad, trace_only=True)


def test_lanes_refused() -> None:
    with pytest.raises(ValueError, match="lanes must be ints >= 1"):
        tps.tp_sensitivity(loads=(None,), lanes=(0,))


def test_full_shape_rows() -> None:
    """As listed and one lane: the calibration table's figures.  DMAs = 1,024 rhs + 256 x loads lhs + 64
    stores.  A hwdge DMA's issue holds one of the ``lanes`` issue lanes for ``dma_issue_ns``, so the
    modelled latency is at least DMAs x 510 ns / lanes; the as-listed kernel is issue-bound (the
    published 608 / 802 us is below that bound with one lane)."""
    rows = tps.tp_sensitivity(loads=(None, 1), lanes=(1, 2))
    pts = [p for p in POINTS if p.name in tps.TP_POINTS]
    table = {r.name: r for r in harness.calibration_rows(points=pts, keep_events=True)}
    issue_ns = Trn2CostParams().dma_issue_ns
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        assert r.num_dma == 1024 + 256 * (4 if r.lhs_loads is None else r.lhs_loads) + 64
        assert r.modelled_us >= r.num_dma * issue_ns / r.lanes / 1e3
        if r.lhs_loads is None and r.lanes == 1:
            assert r.modelled_us == pytest.approx(table[r.point].modelled_us, rel=1e-12)
            assert r.ratio == pytest.approx(table[r.point].ratio, rel=1e-12)
            assert r.modelled_us < 1.03 * r.num_dma * issue_ns / 1e3  # issue-bound
    by = {(r.point, r.lhs_loads, r.lanes): r for r in rows}
    for p in tps.TP_POINTS:
        assert by[(p, 1, 1)].modelled_us < by[(p, None, 1)].modelled_us
        assert by[(p, None, 2)].modelled_us < by[(p, None, 1)].modelled_us
