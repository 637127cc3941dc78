"""Calibration suite: the project's own NKI 0.6 re-implementations of published trn2 kernels, modelled
by the trn2 cost model and compared with their **published** trn2 measurements.

Run ``python -m perf.calibration`` (table, geometric mean / SD of modelled/measured, worst points,
JSONL rows in ``perf/results/calibration.jsonl`` and a log-log PNG).  ``docs/calibration.md`` lists every
point and its public source.  Public API for the cost-model work: :func:`calibration_rows`,
:func:`model_latency_ns`, :func:`capture_trace`, :func:`geo_stats`.
"""

from perf.calibration.harness import (
    CalibrationRow,
    calibration_rows,
    capture_trace,
    clear_trace_cache,
    geo_stats,
    model_latency_ns,
    modelled_us,
    worst_rows,
)
from perf.calibration.points import POINTS, KernelRun, Point, Source

__all__ = [
    "POINTS",
    "CalibrationRow",
    "KernelRun",
    "Point",
    "Source",
    "calibration_rows",
    "capture_trace",
    "clear_trace_cache",
    "geo_stats",
    "model_latency_ns",
    "modelled_us",
    "worst_rows",
]
