"""Calibration bands of the cost model v2: every published trn2 point of ``perf/calibration`` (the
re-implemented published kernels and their published figures) must keep its modelled/measured ratio inside the
band stated here, so a parameter change that breaks calibration fails CI.

Every point is traced with the event log and priced by the dependency-aware schedule (v2's latency).
Bands (the project's target): every point within x1.25 of its published measurement, except
the points listed in ``BANDS`` with the reason the model misses them (docs/cost_model.md section 4).
Points whose trace and schedule take more than ~1 s are marked ``slow``; traces are cached per run.
The geometric SD over all points (target <= x1.25) is checked in the slow tier.
"""

from __future__ import annotations

import math

import pytest

from perf.calibration.harness import calibration_rows, geo_stats
from perf.calibration.points import POINTS, Point

TARGET = 1.25
BANDS: dict[str, tuple[float, float, str]] = {
    "agentic_v0": (0.6, 1.25, "V0's DMAs ran at 152 GB/s; the queued points give 1 KiB loads 259 GB/s"),
    "sdk_hoisted": (0.8, 1.5, "fp32 2 KiB loads at the 244 GB/s fitted to V2's bf16 2 KiB loads"),
    "agentic_tp_v0": (1.3, 1.8, "as written 2,112 DMAs + 1,024 transposes; issue-bound at 510 ns per DMA"),
    "agentic_tp_v1": (1.7, 2.4, "as written 2,112 DMAs, issue-bound at 510 ns: 1.08 ms vs 608 us published"),
}
SLOW = {"agentic_v0", "sdk_tiled", "sdk_hoisted", "sdk_blocked_mn", "sdk_blocked_mnk", "cs149_tiled_rc1"}


def _band(name: str) -> tuple[float, float]:
    lo, hi, _ = BANDS.get(name, (1 / TARGET, TARGET, ""))
    return lo, hi


@pytest.mark.parametrize(
    "point",
    [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW else []) for p in POINTS],
)
def test_calibration_point_within_band(point: Point) -> None:
    (row,) = calibration_rows(points=[point], keep_events=True)
    lo, hi = _band(point.name)
    assert lo <= row.ratio <= hi, (
        f"{point.name}: modelled/measured {row.ratio:.3f} outside [{lo:.3f}, {hi:.3f}]"
    )


@pytest.mark.slow
def test_calibration_geometric_sd_target() -> None:
    """Target: geometric SD of modelled/measured <= x1.25 over every point, and every point within x1.5
    except the documented misses (a band reaching beyond x1.5)."""
    rows = calibration_rows(keep_events=True)
    _, gsd = geo_stats([r.ratio for r in rows])
    assert gsd <= TARGET
    misses = {n for n, (lo, hi, _) in BANDS.items() if lo < 1 / 1.5 or hi > 1.5}
    assert all(abs(math.log(r.ratio)) <= math.log(1.5) for r in rows if r.name not in misses)
