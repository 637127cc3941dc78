"""Calibration harness: trace every point's kernel runs (cached), model them through ONE adapter, and
compare with the published trn2 measurement.

* :func:`capture_trace` is the only place a calibration kernel is traced (trace-only, emulator); it is
  cached per :class:`~perf.calibration.points.KernelRun` within the process and passes
  ``keep_events=True`` to the emulator when asked (the v2 dependency-aware schedule needs the ordered
  event log).
* :func:`model_latency_ns` is the only place the cost model is called: ``(trace, params) -> (ns,
  bottleneck)``; it calls ``nki_kernels.emulator.cost.profile`` (cost model v2: the dependency-aware
  schedule when the trace has its event log, else the bound model).
* :func:`calibration_rows` returns one :class:`CalibrationRow` per published point; it accepts another
  ``model`` callable of the same signature, so a new cost model can be calibrated without editing here.

All modelled figures are **modelled**; all ``measured`` figures are **published trn2 measurements**.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from perf.calibration import kernels_matmul as km
from perf.calibration import kernels_small as ks
from perf.calibration.points import POINTS, KernelRun, Point

__all__ = [
    "KERNELS",
    "CalibrationRow",
    "Model",
    "calibration_rows",
    "capture_trace",
    "clear_trace_cache",
    "geo_stats",
    "kernel_args",
    "model_latency_ns",
    "modelled_us",
    "point_figure_us",
    "point_params",
    "trace_wall_s",
    "worst_rows",
]

KERNELS: dict[str, Callable[..., Any]] = {
    "agentic_v0": km.agentic_v0_kernel,
    "agentic_v1": km.agentic_v1_kernel,
    "agentic_v2": km.agentic_v2_kernel,
    "agentic_transpose": km.agentic_transpose_kernel,
    "mixed_tiles": km.mixed_tiles_kernel,
    "sdk_tiled": km.sdk_tiled_kernel,
    "sdk_hoisted": km.sdk_hoisted_kernel,
    "sdk_blocked_mn": km.sdk_blocked_mn_kernel,
    "sdk_blocked_mnk": km.sdk_blocked_mnk_kernel,
    "vector_add_tiled": ks.vector_add_tiled_kernel,
    "vector_add_stream": ks.vector_add_stream_kernel,
    "matrix_transpose": ks.matrix_transpose_kernel,
    "matmul_chain": ks.matmul_chain_kernel,
    "psum_evict": ks.psum_evict_kernel,
    "pe_transpose": ks.pe_transpose_kernel,
    "dma_pairs": ks.dma_pairs_kernel,
    "dma_pattern": ks.dma_pattern_kernel,
}
"""Kernel names used by :class:`~perf.calibration.points.KernelRun` -> the kernel functions."""

Model = Callable[[Any, Any], tuple[float, str]]
"""``(trace, params) -> (latency_ns, bottleneck engine)``: the cost-model adapter signature."""

_TRACES: dict[tuple[KernelRun, bool], Any] = {}
_WALL_S: dict[tuple[KernelRun, bool], float] = {}


def clear_trace_cache() -> None:
    """Forget every cached trace (and its recorded wall time)."""
    _TRACES.clear()
    _WALL_S.clear()


def trace_wall_s() -> float:
    """Measured CPU wall-clock seconds spent tracing the runs now in the cache."""
    return sum(_WALL_S.values())


def kernel_args(run: KernelRun) -> tuple[list[Any], dict[str, Any]]:
    """``run``'s kernel arguments: a ``TensorSpec`` per HBM input (bf16 / fp32) and its keyword arguments
    (``out_dtype`` names resolved to dtypes).  Used by the tracing here and by the device path
    (``perf.neuron_points.calibration_call``)."""
    import ml_dtypes
    import numpy as np

    from nki_kernels.emulator import TensorSpec

    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
    args = [TensorSpec(shape, dtypes[dt]) for shape, dt in run.args]
    kwargs = {k: (dtypes[v] if k == "out_dtype" else v) for k, v in run.kwargs}
    return args, kwargs


def capture_trace(run: KernelRun, *, keep_events: bool = False) -> Any:
    """Trace-only emulator run of ``run`` (cached per ``(run, keep_events)`` in this process).

    ``keep_events=True`` records the ordered event log the dependency-aware schedule needs
    (``nki_kernels.emulator.run(..., keep_events=True)``).  ``run.sbuf_check=False`` traces with the
    emulator's SBUF capacity check off (see the point's note).
    """
    if not isinstance(run, KernelRun):
        raise TypeError(f"capture_trace: run must be a KernelRun, got {type(run).__name__}")
    if run.kernel not in KERNELS:
        raise KeyError(f"capture_trace: unknown kernel {run.kernel!r}; known: {sorted(KERNELS)}")
    key = (run, bool(keep_events))
    if key in _TRACES:
        return _TRACES[key]
    from nki_kernels import emulator as emu
    from nki_kernels.emulator.hw import TRN2

    opts: dict[str, Any] = {"trace_only": True}
    if keep_events:
        opts["keep_events"] = True
    if not run.sbuf_check:
        opts["hw"] = dataclasses.replace(TRN2, check_sbuf_capacity=False)
    args, kwargs = kernel_args(run)
    t0 = time.perf_counter()
    _, trace = emu.run(KERNELS[run.kernel], *args, **opts, **kwargs)
    _WALL_S[key] = time.perf_counter() - t0
    _TRACES[key] = trace
    return trace


def model_latency_ns(trace: Any, params: Any = None) -> tuple[float, str]:
    """THE cost-model adapter: modelled latency (ns) of one traced launch on one trn2 core and its
    bottleneck engine.  ``nki_kernels.emulator.cost.profile`` (cost model v2)."""
    from nki_kernels.emulator import cost

    prof = cost.profile(trace, params) if params is not None else cost.profile(trace)
    return float(prof.latency_ns), str(prof.bottleneck)


def modelled_us(
    point: Point, params: Any = None, model: Model = model_latency_ns, *, keep_events: bool = False
) -> tuple[float, str]:
    """Modelled figure of ``point`` in microseconds and the bottleneck engine (of the larger run), by the
    point's method (``points`` module docstring)."""
    pp = point_params(point, params)
    res = [model(capture_trace(r, keep_events=keep_events), pp) for r in point.runs]
    return point_figure_us(point, [lat for lat, _ in res]), res[-1][1]


def point_params(point: Point, params: Any) -> Any:
    """The parameters ``point`` is modelled with: ``params`` (``None`` = the cost model's defaults), with
    ``default_dge_mode`` set to the point's ``dge_mode`` when its source states one.  Parameters of
    another model (no ``default_dge_mode`` field) are passed unchanged: the DGE mode is a
    ``Trn2CostParams`` notion."""
    if point.dge_mode is None:
        return params
    if params is None:
        from nki_kernels.emulator.cost import Trn2CostParams

        params = Trn2CostParams()
    if not hasattr(params, "default_dge_mode"):
        return params
    return dataclasses.replace(params, default_dge_mode=point.dge_mode)


def point_figure_us(point: Point, latencies_ns: Sequence[float]) -> float:
    """The point's modelled figure in microseconds from its runs' modelled latencies (ns, in
    ``point.runs`` order), by the point's method (``points`` module docstring)."""
    if len(latencies_ns) != len(point.runs):
        raise ValueError(
            f"point_figure_us: {point.name} has {len(point.runs)} run(s), got {len(latencies_ns)} latencies"
        )
    if point.method == "latency":
        return latencies_ns[0] / 1e3
    la, lb = latencies_ns
    ca, cb = point.runs[0].count, point.runs[1].count
    slope = (lb - la) / (cb - ca)
    if point.method == "slope":
        return slope * point.units / 1e3
    return (la - ca * slope) / 1e3


@dataclass(frozen=True)
class CalibrationRow:
    """One calibration point: published trn2 measurement vs this project's model.

    ``measured_lo_us``/``measured_hi_us``: the **published** figure (a range where published as one);
    ``modelled_us``: the cost model's figure (**modelled**); ``ratio`` = modelled / geometric middle of
    the published range; ``in_range``: modelled within the published range.
    """

    name: str
    kernel: str
    group: str
    source: str
    source_url: str
    shape: str
    quantity: str
    published: str
    measured_lo_us: float
    measured_hi_us: float
    modelled_us: float
    ratio: float
    bottleneck: str
    method: str

    @property
    def in_range(self) -> bool:
        return self.measured_lo_us <= self.modelled_us <= self.measured_hi_us

    @property
    def measured_us(self) -> float:
        return math.sqrt(self.measured_lo_us * self.measured_hi_us)


def calibration_rows(
    params: Any = None,
    *,
    model: Model = model_latency_ns,
    points: Iterable[Point] | None = None,
    keep_events: bool = False,
) -> list[CalibrationRow]:
    """One row per published point (default: every point of :data:`~perf.calibration.points.POINTS`),
    modelled with ``model(trace, params)`` (default :func:`model_latency_ns`, cost model v2).  Traces are
    cached per run within the process, so calling this for several ``params`` traces once."""
    rows = []
    for p in POINTS if points is None else points:
        mod, bn = modelled_us(p, params, model, keep_events=keep_events)
        rows.append(
            CalibrationRow(
                name=p.name,
                kernel=p.kernel,
                group=p.group,
                source=p.source.short(),
                source_url=p.source.url,
                shape=p.shape,
                quantity=p.quantity,
                published=p.published,
                measured_lo_us=p.measured_us[0],
                measured_hi_us=p.measured_us[1],
                modelled_us=mod,
                ratio=mod / p.measured_mid_us,
                bottleneck=bn,
                method=p.method,
            )
        )
    return rows


def geo_stats(ratios: Sequence[float]) -> tuple[float, float]:
    """``(geometric mean, geometric SD)`` of positive ratios; the SD is ``exp`` of the population standard
    deviation of ``log(ratio)`` (1.0 when all ratios are equal)."""
    if not ratios or any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(
            f"geo_stats: ratios must be a non-empty sequence of finite positive numbers, got {ratios!r}"
        )
    logs = [math.log(r) for r in ratios]
    mu = sum(logs) / len(logs)
    var = sum((x - mu) ** 2 for x in logs) / len(logs)
    return math.exp(mu), math.exp(math.sqrt(var))


def worst_rows(rows: Sequence[CalibrationRow], n: int = 5) -> list[CalibrationRow]:
    """The ``n`` rows farthest from ratio 1 (in ``|log ratio|``), worst first."""
    return sorted(rows, key=lambda r: -abs(math.log(r.ratio)))[:n]
