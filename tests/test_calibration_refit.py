"""Tests of perf.calibration.refit: the cost model's fitted parameters as knobs, the calibration predictor
(additive fixed time), the source grouping, and one fit on a cheap real point against the documented
formula (docs/cost_model.md section 3)."""

from __future__ import annotations

import dataclasses

import pytest

from nki_kernels.emulator.cost import Trn2CostParams
from perf.calibration.fit import Fitter
from perf.calibration.harness import capture_trace, model_latency_ns, point_params
from perf.calibration.points import POINTS
from perf.calibration.refit import (
    TRN2_KNOBS,
    CalibrationPredictor,
    descriptor_ns_of,
    source_groups,
    with_descriptor_ns,
    with_queued_rate,
)

BY_NAME = {p.name: p for p in POINTS}


def test_with_queued_rate_rederives_the_extrapolated_entries() -> None:
    p = Trn2CostParams()
    eff = dict(p.dma_efficiency_points)
    t = dict(with_queued_rate(p, 4096, 300.0).dma_queued_gbps_points)
    assert t[4096] == 300.0
    assert t[32768] == pytest.approx(300.0 / eff[4096])
    assert t[8192] == pytest.approx(300.0 * eff[8192] / eff[4096])
    assert t[512] == dict(p.dma_queued_gbps_points)[512]
    # the default table follows the same rule above 4 KiB (its stated derivation), to 0.1 GB/s rounding
    same = dict(with_queued_rate(p, 4096, dict(p.dma_queued_gbps_points)[4096]).dma_queued_gbps_points)
    for s, v in p.dma_queued_gbps_points:
        assert same[s] == pytest.approx(v, abs=0.06), s
    with pytest.raises(ValueError, match="not a table size"):
        with_queued_rate(p, 256, 1.0)


def test_descriptor_time_sets_the_small_sizes() -> None:
    """At 256 B each descriptor takes t0 + 256 / 23 B/ns on one of 16 engines: t0 = 10 ns -> 16 * 256 /
    (10 + 256 / 23) = 193.9 GB/s; below 256 B the single-DMA curve's shape scales it (32 B: x 0.014 /
    0.10).  The default table is that rule at t0 = 4.7 ns (to its 0.1 GB/s rounding)."""
    p = Trn2CostParams()
    t = dict(with_descriptor_ns(p, 10.0).dma_queued_gbps_points)
    at256 = 16 * 256 / (10 + 256 / 23)
    assert t[256] == pytest.approx(at256)
    assert t[128] == pytest.approx(at256 * 0.05 / 0.10) and t[32] == pytest.approx(at256 * 0.014 / 0.10)
    assert t[512] == dict(p.dma_queued_gbps_points)[512]
    assert descriptor_ns_of(with_descriptor_ns(p, 10.0)) == pytest.approx(10.0)
    default = dict(with_descriptor_ns(p, 4.7).dma_queued_gbps_points)
    for s, v in p.dma_queued_gbps_points:
        assert v == pytest.approx(default[s], abs=0.06), s


def test_every_fitted_parameter_is_a_knob_with_a_consistent_spec() -> None:
    names = {k.name for k in TRN2_KNOBS}
    fitted = {n for n, src in Trn2CostParams.sources().items() if "fitted" in src}
    fitted.discard("dma_queued_gbps_points")  # one knob per table size instead
    assert fitted <= names, fitted - names
    p = Trn2CostParams()
    for k in TRN2_KNOBS:
        lo, hi = k.bounds
        assert lo <= k.get(p) <= hi, k.name  # defaults lie inside the searched interval
        mid = k.values[0] if k.values else (lo + hi) / 2
        assert k.get(k.put(p, mid)) == pytest.approx(mid), k.name
        assert k.prior_source, k.name


@pytest.mark.parametrize("events", [True, False], ids=["schedule", "bound"])
@pytest.mark.parametrize("name", ["cs149_stream_fd200", "fixed_idle", "dma_4K"])
def test_predictor_shifts_the_fixed_time_exactly(events: bool, name: str) -> None:
    """Priced once at a canonical fixed time and shifted: equal to re-modelling every run."""
    point = BY_NAME[name]
    params = dataclasses.replace(Trn2CostParams(), kernel_fixed_ns=9_000.0, dma_issue_ns=700.0)
    pred = CalibrationPredictor([point], keep_events=events)
    got = pred(params, [name])[name]
    pp = point_params(point, params)  # the point's stated DGE mode, when it has one
    lat = [model_latency_ns(capture_trace(r, keep_events=events), pp)[0] for r in point.runs]
    if point.method == "latency":
        direct = lat[0] / 1e3
    else:
        (la, lb), (ca, cb) = lat, (point.runs[0].count, point.runs[1].count)
        slope = (lb - la) / (cb - ca)
        direct = (slope * point.units if point.method == "slope" else la - ca * slope) / 1e3
    assert got * point.measured_mid_us == pytest.approx(direct, rel=1e-12)
    assert pred.priced == len(point.runs)
    pred(dataclasses.replace(params, kernel_fixed_ns=12_000.0), [name])
    assert pred.priced == len(point.runs)  # the fixed time alone does not re-model


def test_source_groups_partition_the_points() -> None:
    for by in ("repo", "path"):
        groups = source_groups(POINTS, by)
        names = [n for v in groups.values() for n in v]
        assert sorted(names) == sorted(p.name for p in POINTS)
    repo = source_groups(POINTS, "repo")
    assert set(repo["xaviergonzalez/asst4-trainium2"]) == {
        "cs149_tiled_rc1", "cs149_tiled_rc128", "cs149_stream_fd2", "cs149_stream_fd200", "cs149_transpose"
    }  # fmt: skip
    assert len(source_groups(POINTS, "path")) > len(repo)
    with pytest.raises(ValueError, match="by must be"):
        source_groups(POINTS, "author")


def test_fit_of_the_scalar_psum_access_matches_the_formula() -> None:
    """ScalarE [128,128] fp32 PSUM -> SBUF copy: (max(64, 128) + x) cycles / 1.2 GHz = 221 ns published
    -> x = 221 * 1.2 - 128 = 137.2 cycles."""
    knob = next(k for k in TRN2_KNOBS if k.name == "scalar_psum_access_cycles")
    point = BY_NAME["evict_scalar"]
    f = Fitter((knob,), CalibrationPredictor([point], keep_events=False), [point.name], refine=30)
    res = f.fit(Trn2CostParams(scalar_psum_access_cycles=10))
    assert res.values[knob.name] == pytest.approx(221 * 1.2 - 128, abs=0.01)
    assert res.ratios[point.name] == pytest.approx(1.0, abs=1e-4)
