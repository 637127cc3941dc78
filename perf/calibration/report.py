"""Calibration report: aligned table, summary statistics, runner rows (JSONL) and the log-log PNG.

Figures: ``measured`` = published trn2 measurement (not run here); ``modelled`` = the trn2 cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from perf.calibration.harness import CalibrationRow, geo_stats, worst_rows
from perf.runner import BenchRow

__all__ = ["format_rows", "summary_lines", "to_bench_rows", "write_png"]


def _us(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.4f}"


def format_rows(rows: Sequence[CalibrationRow]) -> str:
    """Aligned table: point, group, shape, published measured (us; lo-hi), modelled (us), ratio,
    bottleneck, source."""
    head = [
        "point",
        "grp",
        "shape",
        "measured_us (published trn2)",
        "modelled_us",
        "ratio",
        "bottleneck",
        "source",
    ]
    body = []
    for r in rows:
        meas = _us(r.measured_lo_us) if r.measured_lo_us == r.measured_hi_us else (
            f"{_us(r.measured_lo_us)}-{_us(r.measured_hi_us)}"
        )  # fmt: skip
        body.append(
            [
                r.name,
                r.group,
                r.shape[:52],
                meas,
                _us(r.modelled_us),
                f"{r.ratio:.2f}",
                r.bottleneck,
                r.source,
            ]
        )
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    right = {3, 4, 5}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])


def summary_lines(rows: Sequence[CalibrationRow], n_worst: int = 5) -> list[str]:
    """Geometric mean / SD of modelled/measured, the within-x1.25 / x1.5 counts and the worst points."""
    ratios = [r.ratio for r in rows]
    gm, gsd = geo_stats(ratios)
    within = {b: sum(1 for x in ratios if 1 / b <= x <= b) for b in (1.25, 1.5)}
    out = [
        f"points: {len(rows)}; modelled/measured geometric mean {gm:.3f}, geometric SD x{gsd:.3f}; "
        f"min {min(ratios):.2f}, max {max(ratios):.2f}; "
        f"within x1.25: {within[1.25]}, within x1.5: {within[1.5]}",
        "worst points (|log ratio|): "
        + ", ".join(f"{r.name} {r.ratio:.2f} ({r.bottleneck})" for r in worst_rows(rows, n_worst)),
    ]
    return out


def to_bench_rows(rows: Sequence[CalibrationRow], model: str, wall_s: float) -> list[BenchRow]:
    """Runner rows (``op="calibration"``, ``kind="modelled"``): ``latency_us`` is the **modelled** figure;
    ``extra`` carries the **published trn2 measured** figure (``measured_trn2_lo_us``/``_hi_us``, labelled
    ``measured_source``), the ratio, bottleneck, source URL and the measured CPU wall time of tracing."""
    out = []
    for r in rows:
        out.append(
            BenchRow(
                op="calibration",
                variant=r.name,
                config={"kernel": r.kernel, "shape": r.shape, "group": r.group, "method": r.method},
                kind="modelled",
                latency_us=r.modelled_us,
                extra={
                    "model": model,
                    "measured_trn2_lo_us": r.measured_lo_us,
                    "measured_trn2_hi_us": r.measured_hi_us,
                    "measured_label": "published trn2 measurement (not run here): " + r.published,
                    "measured_quantity": r.quantity,
                    "measured_source": r.source,
                    "measured_source_url": r.source_url,
                    "ratio_modelled_over_measured": r.ratio,
                    "bottleneck": r.bottleneck,
                    "trace_wall_s_all_points_measured": wall_s,
                },
            )
        )
    return out


def write_png(rows: Sequence[CalibrationRow], path: str | Path, title: str = "") -> Path:
    """Log-log scatter of modelled vs published measured time (us), with y = x and x1.25 / x1.5 bands;
    published ranges drawn as horizontal error bars.  Uses matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    xs = [r.measured_us for r in rows]
    ys = [r.modelled_us for r in rows]
    lo, hi = min(xs + ys) / 2, max(xs + ys) * 2
    fig, ax = plt.subplots(figsize=(8, 7))
    grid = [lo, hi]
    for band, alpha in ((1.5, 0.10), (1.25, 0.18)):
        lows, highs = [g / band for g in grid], [g * band for g in grid]
        ax.fill_between(grid, lows, highs, color="tab:green", alpha=alpha, lw=0, label=f"within x{band}")
    ax.plot(grid, grid, "k-", lw=1, label="y = x")
    colors = {"A": "tab:blue", "S": "tab:orange", "C": "tab:purple", "D": "tab:red", "I": "tab:brown"}
    names = {
        "A": "AWS agentic docs",
        "S": "SDK tutorial",
        "C": "CS149",
        "D": "DMA throughput",
        "I": "per instruction",
    }
    for g, c in colors.items():
        sel = [r for r in rows if r.group == g]
        if not sel:
            continue
        xerr = [
            [r.measured_us - r.measured_lo_us for r in sel],
            [r.measured_hi_us - r.measured_us for r in sel],
        ]
        ax.errorbar([r.measured_us for r in sel], [r.modelled_us for r in sel], xerr=xerr, fmt="o", color=c,
                    label=names[g], ms=5)  # fmt: skip
        for r in sel:
            ax.annotate(
                r.name, (r.measured_us, r.modelled_us), fontsize=6, xytext=(3, 3), textcoords="offset points"
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("published trn2 measurement (us)")
    ax.set_ylabel("modelled (us)")
    gm, gsd = geo_stats([r.ratio for r in rows])
    ax.set_title(title or f"calibration: geomean {gm:.2f}, geoSD x{gsd:.2f}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
