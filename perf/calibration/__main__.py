"""``python -m perf.calibration``: model every published trn2 calibration point and compare.

Prints the table (published measured vs modelled, ratio, bottleneck, source), the geometric mean and SD
of modelled/measured and the worst points; appends one runner row per point to
``perf/results/calibration.jsonl`` and writes ``perf/results/calibration.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from perf.calibration.harness import calibration_rows, trace_wall_s
from perf.calibration.points import point_names
from perf.calibration.report import format_rows, summary_lines, to_bench_rows, write_png
from perf.runner import RESULTS_DIR, append_rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.calibration", description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", default=str(RESULTS_DIR), help="where calibration.jsonl / .png go")
    ap.add_argument("--no-write", action="store_true", help="print only (no JSONL row, no PNG)")
    ap.add_argument(
        "--only",
        nargs="*",
        default=None,
        metavar="POINT",
        help=f"subset of points: {' '.join(point_names())}",
    )
    a = ap.parse_args(argv)
    from perf.calibration.points import POINTS

    points = POINTS
    if a.only:
        unknown = sorted(set(a.only) - set(point_names()))
        if unknown:
            ap.error(f"--only: unknown points {unknown}; known: {', '.join(point_names())}")
        points = tuple(p for p in POINTS if p.name in a.only)
    t0 = time.perf_counter()
    rows = calibration_rows(points=points)
    wall = time.perf_counter() - t0
    print("trn2 calibration: measured = PUBLISHED trn2 measurement (not run here); modelled = cost model v1")
    print(format_rows(rows))
    for line in summary_lines(rows):
        print(line)
    print(
        f"measured CPU wall time: {wall:.2f} s total, {trace_wall_s():.2f} s tracing "
        "(trace-only, cached per run)"
    )
    if not a.no_write:
        out = append_rows(to_bench_rows(rows, "v1 (nki_kernels.emulator.cost.profile)", wall), "calibration",
                          results_dir=a.results_dir)  # fmt: skip
        png = write_png(rows, Path(a.results_dir) / "calibration.png")
        print(f"rows appended to {out}; plot {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
