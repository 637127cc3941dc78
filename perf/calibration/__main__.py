"""``python -m perf.calibration``: model every published trn2 calibration point and compare.

Prints the table (published measured vs modelled, ratio, bottleneck, source), the geometric mean and SD
of modelled/measured and the worst points; with ``--save`` it also appends one runner row per point to
``perf/results/calibration.jsonl`` and writes ``perf/results/calibration.png`` (``--results-dir`` moves
both; without ``--save`` nothing is written).  ``--loso`` adds the
re-fit of the fitted parameters and the leave-one-source-out figure (slow: minutes with the schedule;
``perf.calibration.refit``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from perf.calibration.harness import calibration_rows, trace_wall_s
from perf.calibration.points import Point, point_names
from perf.calibration.report import format_rows, summary_lines, to_bench_rows, write_png
from perf.runner import RESULTS_DIR, append_rows


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (its own function so a test can check the defaults: nothing tracked is
    written without ``--save``)."""
    ap = argparse.ArgumentParser(prog="python -m perf.calibration", description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", default=str(RESULTS_DIR), help="where calibration.jsonl / .png go")
    ap.add_argument("--no-write", action="store_true", help="print only (the default; kept for scripts)")
    ap.add_argument(
        "--only",
        nargs="*",
        default=None,
        metavar="POINT",
        help=f"subset of points: {' '.join(point_names())}",
    )
    ap.add_argument(
        "--bound-only",
        action="store_true",
        help="no event log: the v2 bound model instead of the dependency-aware schedule (faster)",
    )
    ap.add_argument(
        "--loso",
        action="store_true",
        help="also re-fit the fitted parameters and report leave-one-source-out (slow with the schedule)",
    )
    ap.add_argument(
        "--refit",
        action="store_true",
        help="also re-fit the fitted parameters on every point (the full fit of --loso, without the "
        "held-out fits) and print the fitted values",
    )
    ap.add_argument(
        "--measured",
        default=None,
        metavar="FILE",
        help="use the device-measured calibration rows in FILE (python -m perf.neuron_points "
        "measure-calibration) as the points' measurements instead of the published figures",
    )
    ap.add_argument(
        "--loso-by",
        choices=("repo", "path"),
        default="repo",
        help="what a source is for --loso: a repository (default) or a repository file",
    )
    ap.add_argument(
        "--save",
        action="store_true",
        help="append the rows to calibration.jsonl and write calibration.png in --results-dir (default "
        "perf/results, tracked); default: print only",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.save and a.no_write:
        ap.error("--save and --no-write contradict each other")
    from nki_kernels.emulator.cost import Trn2CostParams
    from perf.calibration.harness import geo_stats
    from perf.calibration.points import POINTS

    points = POINTS
    if a.measured:
        from perf.neuron_points import device_points_from_file

        try:
            points = device_points_from_file(a.measured)
        except (OSError, ValueError) as exc:
            ap.error(f"--measured {a.measured}: {exc}")
    if a.only:
        unknown = sorted(set(a.only) - set(point_names()))
        if unknown:
            ap.error(f"--only: unknown points {unknown}; known: {', '.join(point_names())}")
        points = tuple(p for p in points if p.name in a.only)
    t0 = time.perf_counter()
    events = not a.bound_only
    rows = calibration_rows(points=points, keep_events=events)
    ends = {
        end: calibration_rows(params, points=points, keep_events=events)
        for end, params in (("low", Trn2CostParams.low()), ("high", Trn2CostParams.high()))
    }
    wall = time.perf_counter() - t0
    model = "cost model v2, " + (
        "bound model (no event log)" if a.bound_only else "dependency-aware schedule"
    )
    what = f"DEVICE measurement ({a.measured})" if a.measured else "PUBLISHED trn2 measurement (not run here)"
    print(f"trn2 calibration: measured = {what}; modelled = {model}")
    print(format_rows(rows))
    for line in summary_lines(rows):
        print(line)
    for end, end_rows in ends.items():
        gm, gsd = geo_stats([r.ratio for r in end_rows])
        print(
            f"every unmeasured parameter at its {end} end: geometric mean {gm:.3f}, geometric SD x{gsd:.3f}, "
            f"ratios {min(r.ratio for r in end_rows):.2f}-{max(r.ratio for r in end_rows):.2f} (modelled)"
        )
    print(
        f"measured CPU wall time: {wall:.2f} s total, {trace_wall_s():.2f} s tracing "
        "(trace-only, cached per run)"
    )
    if a.refit and not a.loso:
        _refit(points, events)
    if a.loso:
        _loso(points, events, a.loso_by)
    if a.save:
        out = append_rows(to_bench_rows(rows, model, wall), "calibration",
                          results_dir=a.results_dir)  # fmt: skip
        png = write_png(rows, Path(a.results_dir) / "calibration.png")
        print(f"rows appended to {out}; plot {png}")
    return 0


def _refit(points: Sequence[Point], events: bool) -> None:
    from nki_kernels.emulator.cost import Trn2CostParams
    from perf.calibration.refit import TRN2_KNOBS, refit_lines, trn2_fitter

    t0 = time.perf_counter()
    fitter = trn2_fitter(points, keep_events=events)
    res = fitter.fit(Trn2CostParams(), method="lm")
    print()
    for line in refit_lines(res, Trn2CostParams(), TRN2_KNOBS):
        print(line)
    print(
        f"re-fit: measured CPU wall time {time.perf_counter() - t0:.1f} s, {fitter.evaluations} point prices"
    )


def _loso(points: Sequence[Point], events: bool, by: str) -> None:
    from nki_kernels.emulator.cost import Trn2CostParams
    from perf.calibration.refit import TRN2_KNOBS, loso_lines, run_loso

    t0 = time.perf_counter()
    res, fitter = run_loso(
        points,
        by=by,
        keep_events=events,
        progress=lambda m: print(f"[{time.perf_counter() - t0:7.1f} s] {m}", file=sys.stderr, flush=True),
    )
    wall = time.perf_counter() - t0
    defaults = {k.name: k.get(Trn2CostParams()) for k in TRN2_KNOBS}
    print()
    for line in loso_lines(res, defaults, TRN2_KNOBS, by):
        print(line)
    print(
        f"leave-one-source-out: measured CPU wall time {wall:.1f} s, {fitter.evaluations} point prices "
        f"({getattr(fitter.predict, 'priced', '?')} runs modelled; knobs: perf.calibration.refit.TRN2_KNOBS)"
    )


if __name__ == "__main__":
    sys.exit(main())
