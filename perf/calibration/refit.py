"""The cost model's fitted parameters as :class:`~perf.calibration.fit.Knob` s, the calibration points as a
fit predictor, and the leave-one-source-out (LOSO) report of ``python -m perf.calibration --loso``.

Knobs (:data:`TRN2_KNOBS`): every ``Trn2CostParams`` field whose source says it is fitted to calibration
points (``docs/cost_model.md`` section 2), plus the queued DMA throughput table's measured / fitted sizes
(512 B .. 4 KiB; above 4 KiB re-derived from 4 KiB by the rule the table states), the per-descriptor
time that sets the table below 512 B (the small-transfer rate), and the fixed per-kernel time.  Each
knob's ``prior`` is the figure documented *without* any calibration fit, used when no retained point pins
it (its ``prior_source`` names the document).

:class:`CalibrationPredictor` prices points through the harness' model adapter, with one cache per
``(run, params)``.  ``kernel_fixed_ns`` is added, not re-modelled: the cost model's latency is
``makespan (or bound) + kernel_fixed_ns`` (docs/cost_model.md section 3), so a run is priced once at a
canonical fixed time and shifted; a test checks the additivity on real runs.

Sources for LOSO (:func:`source_groups`): by repository (default) or by repository + file.  A
repository is one publisher's measurement setup (instance, compiler, profiler flags, DGE mode); files
of one repository share it, so holding out a single file would leave its siblings' systematic error in
the fit and make the held-out figure optimistic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from perf.calibration.fit import Fitter, Knob, LosoResult, geo_summary, leave_one_source_out
from perf.calibration.harness import Model, capture_trace, model_latency_ns, point_figure_us, point_params
from perf.calibration.points import POINTS, KernelRun, Point

__all__ = [
    "ADDITIVE_FIELD",
    "DESCRIPTOR_KNOB",
    "TRN2_KNOBS",
    "CalibrationPredictor",
    "loso_lines",
    "refit_lines",
    "rate_knob",
    "run_loso",
    "source_groups",
    "trn2_fitter",
    "descriptor_ns_of",
    "with_descriptor_ns",
    "with_queued_rate",
]

ADDITIVE_FIELD = "kernel_fixed_ns"
"""The parameter the cost model adds to every launch's latency (priced by shifting, not re-modelling)."""

_PLATEAU_GBPS = 16 * 23.0  # DMA-BW: 16 engines x 23 B/ns


def with_descriptor_ns(params: Any, descriptor_ns: float) -> Any:
    """``params`` with the queued DMA throughput below 512 B re-derived from a per-descriptor time of
    ``descriptor_ns`` by the table's stated rule (``cost.params.small_queued_points``: 256 B from the
    descriptor time, below it the single-DMA curve's shape), unrounded."""
    from nki_kernels.emulator.cost.params import small_descriptor_gbps

    at256 = small_descriptor_gbps(256, descriptor_ns)
    eff = dict(params.dma_efficiency_points)
    table = {s: (at256 * eff[s] / eff[256] if s < 512 else v) for s, v in params.dma_queued_gbps_points}
    return dataclasses.replace(params, dma_queued_gbps_points=tuple(sorted(table.items())))


def descriptor_ns_of(params: Any) -> float:
    """The per-descriptor time the table's 256 B entry implies (inverse of ``small_descriptor_gbps``)."""
    from nki_kernels.emulator.cost.params import DMA_ENGINE_BYTES_PER_NS

    return 16 * 256 / dict(params.dma_queued_gbps_points)[256] - 256 / DMA_ENGINE_BYTES_PER_NS


def with_queued_rate(params: Any, size: int, gbps: float) -> Any:
    """``params`` with the queued DMA throughput at ``size`` (>= 512) bytes set to ``gbps`` and the
    table's extrapolated entries above 4 KiB re-derived as ``params.DMA_QUEUED_GBPS_POINTS`` states (the
    4 KiB figure scaled by the single-DMA curve's shape, ``dma_efficiency_points``).  Sizes below 512 B
    follow the per-descriptor time (:func:`with_descriptor_ns`)."""
    table = dict(params.dma_queued_gbps_points)
    if size not in table or size < 512:
        raise ValueError(f"with_queued_rate: size {size} is not a table size >= 512 in {sorted(table)}")
    table[size] = float(gbps)
    eff = dict(params.dma_efficiency_points)
    for s in table:
        if s > 4096 and 4096 in table:
            table[s] = table[4096] * eff[s] / eff[4096]
    return dataclasses.replace(params, dma_queued_gbps_points=tuple(sorted(table.items())))


def rate_knob(size: int, eff: float) -> Knob:
    """The queued DMA throughput at ``size`` bytes per descriptor as a knob (GB/s, log-searched).
    Prior: the published single-DMA curve at that size (``eff``) x the 368 GB/s plateau (DMA-OV x
    DMA-BW), the v1 figure, with no calibration fit."""
    return Knob(
        name=f"queued_gbps@{size}",
        get=lambda p: dict(p.dma_queued_gbps_points)[size],
        put=lambda p, v: with_queued_rate(p, size, v),
        bounds=(5.0, 500.0),
        prior=round(eff * _PLATEAU_GBPS, 1),
        prior_source=f"DMA-OV single-DMA curve {eff:g} x 368 GB/s (DMA-BW)",
    )


DESCRIPTOR_KNOB = Knob(
    name="dma_descriptor_ns",
    get=descriptor_ns_of,
    put=with_descriptor_ns,
    bounds=(0.5, 500.0),
    prior=100.0,
    prior_source="DMA-OV single-DMA curve at 256 B (0.10 x 368 GB/s = 36.8 GB/s: 100 ns per descriptor)",
)
"""The per-descriptor time that sets the queued throughput below 512 B (the small-transfer rate)."""


def _field(
    name: str, bounds: tuple[float, float], prior: float, source: str, *, log: bool = True, **kw: Any
) -> Knob:
    return Knob(
        name=name,
        get=lambda p: float(getattr(p, name)),
        put=lambda p, v: dataclasses.replace(p, **{name: v}),
        bounds=bounds,
        prior=prior,
        log=log,
        prior_source=source,
        **kw,
    )


def _trn2_knobs() -> tuple[Knob, ...]:
    from nki_kernels.emulator.cost.params import DMA_EFFICIENCY_POINTS, Trn2CostParams

    eff = dict(DMA_EFFICIENCY_POINTS)
    rng = Trn2CostParams.ranges()
    cyc: dict[str, Any] = {"log": False, "tolerance_abs": 5.0}
    return (
        _field(
            ADDITIVE_FIELD,
            (5_000.0, 20_000.0),
            12_850.0,
            "no public figure outside the CS149 profiles: their stated nominal",
            log=False,
            stated_range=rng[ADDITIVE_FIELD],
        ),  # fmt: skip
        _field("dma_issue_ns", (100.0, 2_000.0), 600.0, "DGE: ~600 ns per hardware-DGE DMA instruction"),
        _field(
            "dge_none_issue_ns",
            (20.0, 2_000.0),
            300.0,
            "DGE: 'none' (descriptors prebuilt in HBM) has the lowest per-transfer cost; no figure: the "
            "parameter's own nominal",
            stated_range=rng["dge_none_issue_ns"],
        ),  # fmt: skip
        Knob(
            name="dma_issue_lanes",
            get=lambda p: float(p.dma_issue_lanes),
            put=lambda p, v: dataclasses.replace(p, dma_issue_lanes=int(v)),
            bounds=(1.0, 4.0),
            prior=2.0,
            values=(1.0, 2.0, 4.0),
            prior_source="DGE: two DGE instances per trn2 NeuronCore",
        ),
        DESCRIPTOR_KNOB,
        *(rate_knob(s, eff[s]) for s in (512, 1024, 2048, 4096)),
        _field(
            "matmul_overhead_cycles", (0.0, 100.0), 0.0, "ISA: nc_matmul cost formula has no overhead", **cyc
        ),
        _field("matmul_small_tile_cycles", (0.0, 600.0), 0.0, "ISA: no small-tile term", **cyc),
        _field(
            "scalar_psum_access_cycles", (0.0, 400.0), 60.0, "V2-ARCH: ~60-cycle PSUM access start", **cyc
        ),
        _field(
            "vector_psum_access_cycles", (0.0, 400.0), 60.0, "V2-ARCH: ~60-cycle PSUM access start", **cyc
        ),
        _field("transpose_fp32_factor", (1.0, 8.0), 4.0, "TRN2-ARCH: FP32 on TensorE ~4x BF16"),
        _field(
            "dma_completion_ns",
            (0.0, 2_000.0),
            800.0,
            "DMA-BW: ~1.3 us cross-engine DMA latency minus the ~0.5 us issue",
            log=False,
            tolerance_abs=100.0,
            stated_range=rng["dma_completion_ns"],
        ),  # fmt: skip
    )


TRN2_KNOBS: tuple[Knob, ...] = _trn2_knobs()
"""The fitted parameters of ``Trn2CostParams`` (module docstring)."""


class CalibrationPredictor:
    """``(params, point names) -> {name: modelled / published}`` over ``points`` through ``model``
    (default the harness adapter, cost model v2), tracing with the event log when ``keep_events``.

    Each run is priced once per parameter set; ``kernel_fixed_ns`` is added to the latency priced at a
    canonical 1 ns (module docstring).  ``priced`` counts the runs actually modelled.
    """

    def __init__(
        self, points: Sequence[Point] = POINTS, *, keep_events: bool = True, model: Model = model_latency_ns
    ) -> None:
        self.points = {p.name: p for p in points}
        self.keep_events = keep_events
        self.model = model
        self._lat: dict[tuple[KernelRun, Any], float] = {}
        self.priced = 0

    def run_latency_ns(self, run: KernelRun, params: Any) -> float:
        fixed = float(getattr(params, ADDITIVE_FIELD))
        canon = dataclasses.replace(params, **{ADDITIVE_FIELD: 1.0})
        key = (run, canon)
        if key not in self._lat:
            self._lat[key] = self.model(capture_trace(run, keep_events=self.keep_events), canon)[0] - 1.0
            self.priced += 1
        return self._lat[key] + fixed

    def __call__(self, params: Any, names: Sequence[str]) -> dict[str, float]:
        out = {}
        for n in names:
            p = self.points[n]
            pp = point_params(p, params)
            lat = [self.run_latency_ns(r, pp) for r in p.runs]
            out[n] = point_figure_us(p, lat) / p.measured_mid_us
        return out


def source_groups(points: Sequence[Point] = POINTS, by: str = "repo") -> dict[str, tuple[str, ...]]:
    """``{source label: point names}``: by ``"repo"`` (GitHub owner/name) or ``"path"`` (repo:file)."""
    if by not in ("repo", "path"):
        raise ValueError(f"source_groups: by must be 'repo' or 'path', got {by!r}")
    groups: dict[str, list[str]] = {}
    for p in points:
        key = p.source.repo if by == "repo" else f"{p.source.repo}:{p.source.path}"
        groups.setdefault(key, []).append(p.name)
    return {k: tuple(v) for k, v in groups.items()}


def trn2_fitter(
    points: Sequence[Point] = POINTS,
    *,
    keep_events: bool = True,
    knobs: Sequence[Knob] = TRN2_KNOBS,
    model: Model = model_latency_ns,
    **kw: int,
) -> Fitter:
    """A :class:`~perf.calibration.fit.Fitter` of ``knobs`` over ``points`` priced by the cost model."""
    pred = CalibrationPredictor(points, keep_events=keep_events, model=model)
    return Fitter(knobs, pred, [p.name for p in points], **kw)


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def loso_lines(
    res: LosoResult, defaults: Mapping[str, float], knobs: Sequence[Knob] = TRN2_KNOBS, by: str = "repo"
) -> list[str]:
    """Report lines: knob values (default, full re-fit, per held-out source), per-source held-out
    statistics, the pooled held-out figure, every flag, and the held-out ratio of every point."""
    out = [f"leave-one-source-out by {by}: {len(res.sources)} sources, {len(res.held_out)} points"]
    full = geo_summary(res.full.ratios.values())
    out.append(
        f"in-sample re-fit (all sources): geometric mean {full['geomean']:.3f}, geometric SD "
        f"x{full['geosd']:.3f}, ratios {full['min']:.2f}-{full['max']:.2f}, within x1.25: "
        f"{full['within_1.25']:.0f}, within x1.5: {full['within_1.5']:.0f} (modelled)"
    )
    pooled = geo_summary(res.held_out.values())
    out.append(
        f"held out (each point predicted by the fit without its source): geometric mean "
        f"{pooled['geomean']:.3f}, geometric SD x{pooled['geosd']:.3f}, ratios {pooled['min']:.2f}-"
        f"{pooled['max']:.2f}, within x1.25: {pooled['within_1.25']:.0f}, within x1.5: "
        f"{pooled['within_1.5']:.0f} of {pooled['n']:.0f} (modelled)"
    )
    out.append("")
    out.append("| source held out | points | geomean | geoSD | worst point (ratio) | flagged knobs |")
    out.append("|---|---|---|---|---|---|")
    for s in res.sources:
        st = geo_summary(s.ratios.values())
        worst = max(s.ratios, key=lambda n: abs(math.log(s.ratios[n])))
        flagged = ", ".join(f.knob for f in s.flags) or "-"
        out.append(
            f"| {s.source} | {len(s.points)} | {st['geomean']:.3f} | x{st['geosd']:.3f} | "
            f"{worst} ({s.ratios[worst]:.2f}) | {flagged} |"
        )
    out.append("")
    head = "| knob | default | full re-fit | " + " | ".join(f"without {s.source}" for s in res.sources) + " |"
    out.append(head)
    out.append("|---" * (3 + len(res.sources)) + "|")
    for k in knobs:
        cells = [_fmt(defaults[k.name]), _fmt(res.full.values[k.name])]
        for s in res.sources:
            mark = "*" if any(f.knob == k.name for f in s.flags) else ""
            cells.append(_fmt(s.fit.values[k.name]) + mark)
        out.append(f"| {k.name} | " + " | ".join(cells) + " |")
    out.append("(* flagged: " + "; ".join(
        f"{f.knob} without {f.source}: {_fmt(f.value)} vs {_fmt(f.reference)}, {f.why}" for f in res.flags
    ) + ")" if res.flags else "(no knob flagged)")  # fmt: skip
    out.append("")
    out.append("| point | source | in-sample re-fit ratio | held-out ratio |")
    out.append("|---|---|---|---|")
    src_of = {n: s.source for s in res.sources for n in s.points}
    for n, r in res.held_out.items():
        out.append(f"| {n} | {src_of[n]} | {res.full.ratios[n]:.2f} | {r:.2f} |")
    return out


def refit_lines(res: Any, start: Any, knobs: Sequence[Knob] = TRN2_KNOBS) -> list[str]:
    """Report lines of one full re-fit (:meth:`~perf.calibration.fit.Fitter.fit` result ``res`` started
    from ``start``): every knob's start and fitted value (``unpinned`` when no point moves it), and the
    fitted ratios' statistics."""
    st = geo_summary(res.ratios.values())
    out = [
        f"re-fit on {len(res.points)} points: geometric mean {st['geomean']:.3f}, geometric SD "
        f"x{st['geosd']:.3f}, ratios {st['min']:.2f}-{st['max']:.2f}, within x1.25: "
        f"{st['within_1.25']:.0f}, within x1.5: {st['within_1.5']:.0f} (modelled)",
        "",
        "| knob | start | re-fit |",
        "|---|---|---|",
    ]
    for k in knobs:
        note = " (unpinned: prior)" if k.name in res.unpinned else ""
        out.append(f"| {k.name} | {_fmt(k.get(start))} | {_fmt(res.values[k.name])}{note} |")
    return out


def run_loso(
    points: Sequence[Point] = POINTS,
    *,
    by: str = "repo",
    keep_events: bool = True,
    params: Any = None,
    knobs: Sequence[Knob] = TRN2_KNOBS,
    progress: Callable[[str], None] | None = None,
    method: str = "lm",
    **kw: int,
) -> tuple[LosoResult, Fitter]:
    """Sensitivity, full fit and LOSO over ``points`` from ``params`` (default ``Trn2CostParams()``),
    fitting by ``method`` (:meth:`~perf.calibration.fit.Fitter.fit`; Levenberg-Marquardt by default:
    the fewest runs priced)."""
    from nki_kernels.emulator.cost import Trn2CostParams

    start = params if params is not None else Trn2CostParams()
    fitter = trn2_fitter(points, keep_events=keep_events, knobs=knobs, grid=kw.get("grid", 9),
                         refine=kw.get("refine", 8))  # fmt: skip
    if progress:
        progress("sensitivity: which knobs move which points")
    fitter.sensitivity(start)
    if progress:
        progress(f"sensitivity done ({fitter.evaluations} points priced); fitting")
    res = leave_one_source_out(fitter, start, source_groups(points, by), method=method, progress=progress)
    return res, fitter
