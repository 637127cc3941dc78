"""Kernel figures the generated report quotes from ``python -m perf.bench_kernels`` rows (*modelled*): the
project's attention and its side-by-side with the ``attention_cte`` design."""

from __future__ import annotations

__all__ = ["attention_side_by_side_lines"]


def _bench_rows(path: str = "perf/results/bench_kernels.jsonl") -> dict[tuple[str, str], dict]:
    """The latest row per ``(op, variant)`` of ``python -m perf.bench_kernels`` (empty if none)."""
    import json
    from pathlib import Path

    rows: dict[tuple[str, str], dict] = {}
    f = Path(path)
    if f.exists():
        for line in f.read_text().splitlines():
            d = json.loads(line)
            rows[(d.get("op", ""), d.get("variant", ""))] = d
    return rows


def attention_side_by_side_lines(path: str = "perf/results/bench_kernels.jsonl") -> list[str]:
    """The project's attention beside the ``attention_cte`` design (perf/attention_cte_harness.py) at the
    same shapes, from the kernel bench's rows (modelled)."""
    rows = _bench_rows(path)
    pairs = (
        ("Wan 23,400 x 32,760 x 12 x 128 bf16, LNC2", ("attention", "flash_fused_lnc2"),
         ("attention_cte_harness", "wan_lnc2")),
        ("one core, TP4xSP2 (11,700 x 32,760 x 3 heads)", ("attention", "per_core_tp4xsp2"),
         ("attention_cte_harness", "per_core_tp4xsp2")),
    )  # fmt: skip
    out = [
        "| shape | nki-ardiff attention, ms (nominal [opt., pess.]) | attention_cte design, ms | "
        "useful FLOPs at the pess. end (ours / cte) |",
        "|---|---|---|---|",
    ]
    for label, ours_k, cte_k in pairs:
        a, b = rows.get(ours_k), rows.get(cte_k)
        if a is None or b is None:
            continue

        def fig(d: dict) -> str:
            ex = d.get("extra", {})
            return (
                f"{d['latency_us'] / 1e3:,.1f} [{ex.get('latency_us_low', 0) / 1e3:,.1f}, "
                f"{ex.get('latency_us_high', 0) / 1e3:,.1f}]"
            )

        ua = a.get("extra", {}).get("useful_flop_pct_high")
        ub = b.get("extra", {}).get("useful_flop_pct_high")
        out.append(f"| {label} | {fig(a)} | {fig(b)} | {ua} % / {ub} % |")
    if len(out) == 2:
        return ["(no attention / attention_cte_harness rows in perf/results/bench_kernels.jsonl yet)"]
    return out


def _attention_row_text(path: str = "perf/results/bench_kernels.jsonl") -> str:
    """The whole-layer attention row of ``python -m perf.bench_kernels`` (its latest entry), as text."""
    row = _bench_rows(path).get(("attention", "flash_fused_lnc2"))
    if row is None:
        return "(no `attention/flash_fused_lnc2` row in perf/results/bench_kernels.jsonl yet.)"
    ex = row.get("extra", {})
    lo, hi = ex.get("latency_us_low"), ex.get("latency_us_high")
    rng = f" [{lo / 1e3:,.1f}, {hi / 1e3:,.1f}]" if lo is not None and hi is not None else ""
    busy, useful = ex.get("tensore_busy_pct_high"), ex.get("useful_flop_pct_high")
    eng = (
        f"; TensorE busy {busy} %, useful FLOPs {useful} % at the pessimistic end" if busy is not None else ""
    )
    return (
        "The whole layer's attention at the Wan shape as one LNC2 kernel (`python -m perf.bench_kernels`, "
        f"row `attention/flash_fused_lnc2`) models at {row['latency_us'] / 1e3:,.1f} ms nominal{rng}{eng}."
    )
