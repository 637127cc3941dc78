"""Sensitivity of the AGENTIC-TP points (``agentic_tp_v0`` / ``agentic_tp_v1``) to the two facts of
their compiled kernels that the source does not publish (docs/calibration.md, "agentic_tp_v1: what was
checked"); every figure is **modelled** (cost model v2 schedule over emulator traces).

* ``lhs_loads``: how many times the compiled kernel loads each ``lhs`` tile of (m, k) over the 4
  n-iterations (the listing: 4; the same repository's V0 profile shows the compiler keeping an
  n-invariant tile for about 3 of 8 n-iterations, so anywhere from 1 to 4 is possible here);
* ``lanes``: how many hardware-DGE issue lanes the compiled kernel's DMAs are spread over (the model:
  1; trn2 has two DGE instances, triggered from the Sync or the Scalar engine, which one being the
  compiler's choice unless ``dma_copy(engine=...)`` names it).

``python -m perf.calibration.tp_sensitivity`` prints the table and, for comparison, the whole suite's
geometric SD with one and with two issue lanes on every point (measured CPU ~1 min).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from perf.calibration.harness import calibration_rows, capture_trace, geo_stats, point_params
from perf.calibration.point_defs import bf16_arg, kernel_run
from perf.calibration.points import POINTS

__all__ = ["TP_POINTS", "TpRow", "lanes_summary", "tp_sensitivity"]

TP_POINTS: dict[str, bool] = {"agentic_tp_v0": True, "agentic_tp_v1": False}
"""Point name -> ``transpose_lhs`` of its kernel."""


@dataclass(frozen=True)
class TpRow:
    """One modelled variant of an AGENTIC-TP point: ``lhs_loads`` (``None`` = as listed) and ``lanes``
    (``dma_issue_lanes``); ``num_dma`` / ``dma_bytes`` of the trace, ``modelled_us`` the modelled
    latency, ``ratio`` = modelled / published, ``tensor_busy_us`` the modelled TensorE busy time
    (throttling included; the source publishes TE-active 503 / 420 us)."""

    point: str
    lhs_loads: int | None
    lanes: int
    num_dma: int
    dma_bytes: int
    modelled_us: float
    ratio: float
    tensor_busy_us: float


def tp_sensitivity(
    loads: Sequence[int | None] = (None, 3, 2, 1), lanes: Sequence[int] = (1, 2), params: object = None
) -> list[TpRow]:
    """Model both AGENTIC-TP points at every ``lhs_loads`` in ``loads`` (``None`` or 1..4) and every
    issue-lane count in ``lanes`` (>= 1), other parameters from ``params`` (``None``: the defaults).
    Shapes: the published 2048^3 bf16.  Rows in (point, loads, lanes) order."""
    from nki_kernels.emulator import cost

    for ln in lanes:
        if type(ln) is not int or ln < 1:
            raise ValueError(f"tp_sensitivity: lanes must be ints >= 1, got {ln!r}")
    pts = {p.name: p for p in POINTS}
    rows = []
    for name, transpose_lhs in TP_POINTS.items():
        point = pts[name]
        base = point_params(point, params) or cost.Trn2CostParams()
        for ld in loads:
            kw: dict[str, Any] = {} if ld is None else {"lhs_loads": ld}
            run = kernel_run(
                "agentic_transpose", bf16_arg((2048, 2048)), bf16_arg((2048, 2048)),
                transpose_lhs=transpose_lhs, **kw,
            )  # fmt: skip
            trace = capture_trace(run, keep_events=True)
            for ln in lanes:
                prof = cost.profile(trace, dataclasses.replace(base, dma_issue_lanes=ln))
                us = prof.latency_ns / 1e3
                rows.append(
                    TpRow(
                        name,
                        ld,
                        ln,
                        prof.num_dma,
                        prof.dma_bytes,
                        us,
                        us / point.measured_mid_us,
                        prof.engine_busy_ns["tensor"] / 1e3,
                    )  # fmt: skip
                )
    return rows


def lanes_summary(lanes: Sequence[int] = (1, 2)) -> list[tuple[int, float, float, int, int]]:
    """Every calibration point with ``dma_issue_lanes`` = each of ``lanes``: ``(lanes, geomean, geoSD,
    within x1.25, within x1.5)`` (modelled / published)."""
    from nki_kernels.emulator.cost import Trn2CostParams

    out = []
    for ln in lanes:
        rows = calibration_rows(dataclasses.replace(Trn2CostParams(), dma_issue_lanes=ln), keep_events=True)
        r = [x.ratio for x in rows]
        g, s = geo_stats(r)
        out.append((ln, g, s, sum(max(x, 1 / x) <= 1.25 for x in r), sum(max(x, 1 / x) <= 1.5 for x in r)))
    return out


def main() -> int:
    t0 = time.perf_counter()
    print("| point | lhs loads per (m,k) tile | issue lanes | DMAs | MB | modelled us | ratio | TE busy us |")
    print("|---|---|---|---|---|---|---|---|")
    for r in tp_sensitivity():
        ld = "4 (as listed)" if r.lhs_loads is None else str(r.lhs_loads)
        print(
            f"| {r.point} | {ld} | {r.lanes} | {r.num_dma:,} | {r.dma_bytes / 1e6:.0f} | "
            f"{r.modelled_us:,.0f} | {r.ratio:.2f} | {r.tensor_busy_us:.0f} |"
        )
    print("\nevery point, dma_issue_lanes on all of them (modelled / published):")
    for ln, g, s, w125, w15 in lanes_summary():
        print(f"  lanes={ln}: geomean {g:.3f}, geoSD x{s:.3f}, within x1.25: {w125}, within x1.5: {w15}")
    print(f"measured CPU wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
