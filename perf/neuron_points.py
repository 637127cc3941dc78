"""Calibration points from a Neuron device, two ways.

1. **Project kernels** (``rolling-forcing bench kernels --backend neuron --measure``,
   :mod:`perf.neuron_measure`): each measured launch beside the cost model's figure for the same launch,
   as the calibration suite's ``CalibrationRow`` (``perf/calibration/harness.py``; alias
   :data:`CalibrationPoint`), group ``"N"``, so its statistics and table take them as they are
   (:func:`calibration_points`, :func:`points_from_results`).
2. **The calibration kernels themselves** (closing the loop): ``python -m perf.neuron_points
   measure-calibration`` launches every run of every calibration point (``perf.calibration.points``)
   on the device through the same timing route (:class:`perf.neuron_measure.ExplorerTiming`), forms
   each point's figure by the point's own method (latency, slope or intercept of the device times,
   :func:`perf.calibration.harness.point_figure_us`) and appends one ``kind="measured"`` row per point
   (:func:`measure_calibration`; default file ``perf/results/calibration_measured.jsonl``).
   :func:`device_points` turns those rows back into calibration :class:`~perf.calibration.points.Point`
   objects (same runs, the device figure as the measurement), which ``python -m perf.calibration
   --measured FILE [--refit] [--loso]`` prices and re-fits exactly as it does the published points.
   The device compiles with its default flags, so a device point has ``dge_mode=None`` whatever its
   published source used.  A round trip on a synthetic device (timings from the cost model at a known
   parameter set) is tested in ``tests/test_neuron_calibration_loop.py``.

No row has been measured yet (no Neuron device in this repository's development): docs/neuron.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from perf.calibration.harness import CalibrationRow
from perf.calibration.points import POINTS, KernelRun, Point, Source
from perf.neuron_measure import KernelCall, ModelFn, TimingSource, call_of, modelled_launch_us
from perf.runner import RESULTS_DIR, BenchRow, append_rows, read_rows, run_case

__all__ = [
    "CALIBRATION_OP",
    "GROUP",
    "MEASURED_FILE",
    "CalibrationPoint",
    "calibration_call",
    "calibration_points",
    "device_points",
    "device_points_from_file",
    "measure_calibration",
    "points_from_results",
]

CALIBRATION_OP = "calibration"
"""``op`` of the rows :func:`measure_calibration` writes (``variant`` = the point's name)."""

MEASURED_FILE = RESULTS_DIR / "calibration_measured.jsonl"
"""Default file of the device-measured calibration rows."""

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


# ------------------------------------------------------------------ the calibration kernels on a device
def calibration_call(run: KernelRun) -> KernelCall:
    """The device launch of one calibration run: its kernel (``perf.calibration.harness.KERNELS``), a
    ``TensorSpec`` per HBM input (zero-filled on the device) and its keyword arguments, on one core."""
    from perf.calibration.harness import KERNELS, kernel_args

    if run.kernel not in KERNELS:
        raise KeyError(f"calibration_call: unknown kernel {run.kernel!r}; known: {sorted(KERNELS)}")
    args, kwargs = kernel_args(run)
    return KernelCall(
        kernel=KERNELS[run.kernel], args=tuple(args), lnc=1, kwargs=tuple(sorted(kwargs.items()))
    )


def measure_calibration(points: Sequence[Point], timing: TimingSource) -> list[BenchRow]:
    """One ``kind="measured"`` row per calibration point (op :data:`CALIBRATION_OP`, variant = name).

    Every run of the point is launched once through ``timing`` (device time of one execution, us); the
    row's ``latency_us`` is the point's figure by its own method from those times (``latency``: the run;
    ``slope``: the marginal time of the counted work x ``units``; ``intercept``: the time with no work),
    i.e. the quantity the cost model's figure for the point is. ``extra``: ``run_kernel_us`` (per run,
    in ``point.runs`` order), ``run_counts``, ``method``, ``units``, ``timing_source``, the published
    figure for reference (``published_us``) and the published source's DGE mode
    (``published_dge_mode``; the device run used its default compile).  A point whose figure comes out
    <= 0 (a slope within the device's noise) is an error row naming the run times; a failed launch is
    an error row (``perf.runner.run_case``), never a silent skip.
    """
    rows = []
    for p in points:

        def measure(p: Point = p) -> dict[str, Any]:
            from perf.calibration.harness import point_figure_us

            times, source = [], ""
            for i, run in enumerate(p.runs):
                t = timing(calibration_call(run), f"calibration-{p.name}-{i}")
                if not t.kernel_us > 0:
                    raise ValueError(
                        f"timing source returned kernel_us={t.kernel_us} for run {i}; must be > 0"
                    )
                times.append(float(t.kernel_us))
                source = t.source
            figure = point_figure_us(p, [us * 1e3 for us in times])
            if not figure > 0:
                raise ValueError(
                    f"{p.name}: the device run times {times} us give a {p.method} of {figure:.6g} us "
                    "(must be > 0: the counted work is within the device's noise; re-measure)"
                )
            return {
                "latency_us": figure,
                "extra": {
                    "method": p.method,
                    "units": p.units,
                    "run_kernel_us": times,
                    "run_counts": [r.count for r in p.runs],
                    "timing_source": source,
                    "published_us": list(p.measured_us),
                    "published_dge_mode": p.dge_mode,
                    "backend": "neuron",
                },
            }

        rows.append(
            run_case(measure, op=CALIBRATION_OP, variant=p.name,
                     config={"point": p.name, "shape": p.shape}, kind="measured")
        )  # fmt: skip
    return rows


def device_points(
    rows: Iterable[BenchRow], *, points: Sequence[Point] = POINTS, source_path: str = ""
) -> tuple[Point, ...]:
    """Calibration points whose measurement is the device figure of :func:`measure_calibration` rows.

    Each point keeps its runs, method and units (so the cost model prices it exactly as the published
    point); ``measured_us = (v, v)`` with the row's ``latency_us``, ``dge_mode=None`` (the device used its
    default compile) and ``source`` = ``Source("device:<git sha>", source_path, <git sha>)``.  Raises
    ``ValueError`` (never a silent drop) for a row of another op or kind, an error row, a point name
    that is not in ``points``, a method that differs from the point's, or a point given twice.
    """
    by_name = {p.name: p for p in points}
    out: dict[str, Point] = {}
    for r in rows:
        what = f"row {r.op}/{r.variant}"
        if r.op != CALIBRATION_OP or r.kind != "measured":
            raise ValueError(f"{what}: expected op={CALIBRATION_OP!r} kind='measured', got kind={r.kind!r}")
        if r.status != "ok" or r.latency_us is None or not r.latency_us > 0:
            raise ValueError(f"{what} has no measurement (status={r.status!r}: {r.message})")
        p = by_name.get(r.variant)
        if p is None:
            raise ValueError(f"{what}: no calibration point named {r.variant!r}")
        if r.extra.get("method") != p.method:
            raise ValueError(
                f"{what}: method {r.extra.get('method')!r} differs from the point's {p.method!r}"
            )
        if p.name in out:
            raise ValueError(f"{what}: point {p.name} given twice")
        v = float(r.latency_us)
        src = Source(f"device:{r.git_sha}", source_path, r.git_sha, str(r.extra.get("timing_source", "")))
        out[p.name] = dataclasses.replace(
            p,
            source=src,
            measured_us=(v, v),
            published=f"{v:.6g} us on the device ({p.method} of {len(p.runs)} run(s), {r.timestamp})",
            quantity=f"device time of one execution, by the point's method ({p.method})",
            dge_mode=None,
        )
    return tuple(out.values())


def device_points_from_file(path: str | Path, *, points: Sequence[Point] = POINTS) -> tuple[Point, ...]:
    """:func:`device_points` of the JSONL file :func:`measure_calibration`'s rows were appended to; when
    a point was measured more than once, its last row (the latest run) counts."""
    latest: dict[str, BenchRow] = {}
    for r in read_rows(path):
        latest[r.variant] = r
    if not latest:
        raise ValueError(f"device_points_from_file: {path} holds no rows")
    return device_points(latest.values(), points=points, source_path=str(path))


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m perf.neuron_points`` (``--save`` off by default)."""
    ap = argparse.ArgumentParser(prog="python -m perf.neuron_points", description=main.__doc__)
    ap.add_argument("command", nargs="?", choices=("measure-calibration",), default="measure-calibration")
    ap.add_argument("--only", nargs="*", default=None, metavar="POINT", help="subset of the points")
    ap.add_argument("--workdir", default=None, help="directory for NEFF/NTFF (default: a new temp dir)")
    ap.add_argument(
        "--save",
        action="store_true",
        help=f"append the rows to the tracked {MEASURED_FILE.relative_to(RESULTS_DIR.parents[1])}",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSONL file the rows are appended to (default: build/perf/calibration_measured.jsonl, "
        "untracked; the tracked file with --save)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m perf.neuron_points measure-calibration [--only P ...] [--workdir D] [--save | --out F]``:
    time the calibration points on this machine's Neuron device and append their rows to a JSONL file."""
    import tempfile

    from perf.neuron_measure import ExplorerTiming, NeuronUnavailable, require_measure

    ap = build_parser()
    a = ap.parse_args(argv)
    if a.save and a.out:
        ap.error("--save and --out contradict: --save writes the tracked file")
    a.out = str(MEASURED_FILE) if a.save else (a.out or str(Path("build/perf/calibration_measured.jsonl")))
    pts = POINTS
    if a.only:
        unknown = sorted(set(a.only) - {p.name for p in POINTS})
        if unknown:
            ap.error(f"--only: unknown points {unknown}")
        pts = tuple(p for p in POINTS if p.name in a.only)
    try:
        profiler = require_measure()  # naming what is missing, before any launch
    except NeuronUnavailable as e:
        print(f"python -m perf.neuron_points: {e}", file=sys.stderr)
        return 2
    wd = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="nki-ardiff-calibration-"))
    rows = measure_calibration(pts, ExplorerTiming(workdir=wd, profiler=profiler))
    out = append_rows(rows, Path(a.out))
    bad = [r for r in rows if r.status != "ok"]
    print(f"{len(rows) - len(bad)} of {len(rows)} points measured; rows appended to {out}")
    for r in bad:
        print(f"  {r.variant}: {r.message}", file=sys.stderr)
    print(f"re-fit the cost model on them: python -m perf.calibration --measured {out} --refit")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
