"""Calibration points from measured kernel rows (``rolling-forcing bench kernels --backend neuron
--measure``, :mod:`perf.neuron_measure`): each measured launch beside the cost model's figure for the same
launch, as the calibration suite's ``CalibrationRow`` (``perf/calibration/harness.py``;
alias :data:`CalibrationPoint`), group ``"N"``, so its statistics and table take them as they are.

No row has been measured yet (no Neuron device in this repository's development): docs/neuron.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from perf.calibration.harness import CalibrationRow
from perf.neuron_measure import ModelFn, call_of, modelled_launch_us
from perf.runner import BenchRow, read_rows

__all__ = ["GROUP", "CalibrationPoint", "calibration_points", "points_from_results"]

GROUP = "N"
"""Calibration group of device-measured project kernels (the calibration suite's groups: A, S, C, D, I)."""


CalibrationPoint = CalibrationRow
"""A device-measured project kernel beside the cost model's figure for the same launch: the calibration
suite's own row type (``measured_lo_us == measured_hi_us`` = the measured launch; ``ratio`` = modelled /
measured; group :data:`GROUP`), so its statistics, table and plot take these as they are."""


def _key(op: str, variant: str, config: Mapping[str, Any]) -> str:
    return json.dumps([op, variant, dict(config)], sort_keys=True)


def calibration_points(
    measured: Iterable[BenchRow],
    *,
    remodel: Sequence[tuple[str, str, Mapping[str, Any], Callable[[], Any]]] | None = None,
    model: ModelFn | None = None,
    source_url: str = "",
) -> list[CalibrationPoint]:
    """Calibration points from measured rows (``kind="measured"``, written by ``--measure``).

    The modelled figure of a point is the launch's modelled time recorded in the row
    (``extra["modelled_kernel_us"]``), or, with ``remodel`` (the benchmark cases the rows were measured
    from, e.g. ``perf.bench_kernels.cases(WAN)``), recomputed now by :func:`modelled_launch_us` with
    ``model`` for the case of the same op, variant and config: how a new cost model is calibrated
    against old measurements without the device.

    Raises ``ValueError`` (a point is never silently dropped) for a measured row that is not
    ``kind="measured"``, is an error row or has no latency, and for one without a modelled figure (none
    recorded, or no case of its op/variant/config in ``remodel``).
    """
    calls = {}
    for op, variant, config, fn in remodel or ():
        call = call_of(fn)
        if call is not None:
            calls[_key(op, variant, config)] = call
    points = []
    for r in measured:
        what = f"measured row {r.op}/{r.variant} {dict(r.config)}"
        if r.kind != "measured":
            raise ValueError(f"{what} has kind={r.kind!r}, expected 'measured'")
        if r.status != "ok" or r.latency_us is None:
            raise ValueError(f"{what} has no measurement (status={r.status!r}: {r.message})")
        if remodel is not None:
            call = calls.get(_key(r.op, r.variant, r.config))
            if call is None:
                raise ValueError(f"{what}: no case with this op, variant and config in remodel")
            mod, bn = modelled_launch_us(call, model)
        elif r.extra.get("modelled_kernel_us") is not None:
            mod, bn = float(r.extra["modelled_kernel_us"]), str(r.extra.get("modelled_bottleneck") or "")
        else:
            why = r.extra.get("modelled_error", "none recorded in the row")
            raise ValueError(f"{what} has no modelled figure ({why}); pass remodel=<the cases>")
        meas = float(r.latency_us)
        points.append(
            CalibrationPoint(
                name=f"neuron:{r.op}/{r.variant}",
                kernel=f"nki-ardiff {r.op} ({r.variant})",
                group=GROUP,
                source=f"{r.extra.get('timing_source', 'measured')} (git {r.git_sha}, {r.timestamp})",
                source_url=source_url,
                shape=json.dumps(dict(r.config), sort_keys=True),
                quantity=str(r.extra.get("latency_is", "one launch")),
                published=f"{meas} us",
                measured_lo_us=meas,
                measured_hi_us=meas,
                modelled_us=mod,
                ratio=mod / meas,
                bottleneck=bn,
                method="latency",
            )
        )
    return points


def points_from_results(measured_path: str | Path, *, remodel: bool = False) -> list[CalibrationPoint]:
    """:func:`calibration_points` of the JSONL file ``--measure`` wrote (e.g.
    ``perf/results/bench_kernels_measured.jsonl``); every row must be ``ok``. ``remodel=True`` recomputes
    each modelled figure now from ``perf.bench_kernels``' cases (Wan and quick shapes, matched by config)."""
    rows = read_rows(measured_path)
    cases = None
    if remodel:
        from perf import bench_kernels

        cases = bench_kernels.cases(bench_kernels.WAN) + bench_kernels.cases(bench_kernels.QUICK)
    return calibration_points(rows, remodel=cases, source_url=str(measured_path))
