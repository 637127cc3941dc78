"""``python -m perf.e2e`` / ``rolling-forcing bench e2e``: run the model, print the peer comparison and
both ends, write ``perf/REPORT.md``, ``perf/results/e2e.jsonl`` (BenchRow, ``kind: modelled``) and the PNG."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perf.e2e.budget import budget_lines
from perf.e2e.budget_baseline import before_after_lines
from perf.e2e.chunk import ChunkModel
from perf.e2e.kernels import AnalyticKernels
from perf.e2e.params import E2EParams
from perf.e2e.plots import write_plots
from perf.e2e.report import attention_side_by_side_lines, headline_lines, render_report, targets_lines
from perf.e2e.run import E2EResult, run_model
from perf.matmul_model import AnalyticMatmulProvider
from rolling_forcing.methods import METHOD_NAMES

__all__ = ["main", "result_rows"]


def _chunk_extra(cm: ChunkModel) -> dict[str, Any]:
    return {
        "end": cm.end,
        "dit_fps": cm.dit_fps,
        "mfu_vs_667": cm.mfu_published_peak,
        "headroom_at_target": cm.headroom(),
        "kernel_calls_per_chunk": cm.kernel_calls,
        "collectives_per_chunk": cm.collectives,
        "neffs_per_chunk": cm.neffs,
        "neff_derivation": cm.launch_plan.describe() if cm.launch_plan else "",
        "tflop_per_chunk": cm.flops / 1e12,
        "groups_ms": {g: t * 1e3 for g, t in cm.by_group().items()},
    }


def result_rows(r: E2EResult) -> list[Any]:
    """The BenchRows of one run (every figure at both ends; ``extra.end`` names the end)."""
    from perf.runner import BenchRow

    cfg = {"preset": r.model.name, "height": r.height, "width": r.width}
    rows = []
    for (variant, end), cm in r.chunks.items():
        rows.append(
            BenchRow(
                op="e2e_chunk",
                variant=f"{variant}/{end}",
                config={**cfg, "cores": cm.cores, "plan": cm.plan_name},
                kind="modelled",
                latency_us=cm.chunk_s * 1e6,
                fps=cm.fps,
                tensore_util=cm.mfu,
                memory_bytes=r.footprints[0].per_chip,
                extra={**_chunk_extra(cm), "kernels": r.kernels_name, "matmul": r.matmul_name},
            )
        )
    for row in r.peer:
        c = row.config
        pcfg = {
            "preset": r.model.name,
            "height": c.height,
            "width": c.width,
            "cores": c.cores,
            "plan": c.plan,
        }
        if not row.chunks:
            rows.append(
                BenchRow(
                    op="e2e_peer",
                    variant=c.variant,
                    config=pcfg,
                    kind="modelled",
                    status="error",
                    message=row.error,
                )
            )
            continue
        for end, cm in row.chunks.items():
            ratio = row.ratio(end)
            rows.append(
                BenchRow(
                    op="e2e_peer",
                    variant=f"{c.variant}/{end}",
                    config=pcfg,
                    kind="modelled",
                    latency_us=cm.chunk_s * 1e6,
                    fps=cm.fps,
                    tensore_util=cm.mfu,
                    extra={
                        **_chunk_extra(cm),
                        "peer_measured_fps": None if row.measured is None else row.measured.fps,
                        "peer_source": None if row.measured is None else row.measured.source,
                        "predicted_over_measured": ratio,
                        "kernels": r.peer_kernels_name,
                        "note": row.error,
                    },
                )
            )
    for end, t in r.ttff.items():
        rows.append(
            BenchRow(
                op="e2e_ttff",
                variant=f"growing/{end}",
                config=cfg,
                kind="modelled",
                latency_us=t.total_s * 1e6,
                extra={"static_us": t.static_s * 1e6, "warmup_ms": [x * 1e3 for x in t.warmup_s]},
            )
        )
    for fp in r.footprints + r.lower_bounds:
        rows.append(
            BenchRow(
                op="e2e_hbm",
                variant=fp.label,
                config={**cfg, "cores": fp.cores},
                kind="modelled",
                memory_bytes=fp.per_chip,
                extra={"per_core": fp.per_core, "items": {i.name: i.per_chip for i in fp.items}},
            )
        )
    for wp, end, cm in r.weight_variants:
        if wp == "replicated":
            continue  # the merged rows above
        rows.append(
            BenchRow(
                op="e2e_chunk",
                variant=f"merged/{wp}/{end}",
                config={**cfg, "cores": cm.cores, "plan": cm.plan_name, "weights": wp},
                kind="modelled",
                latency_us=cm.chunk_s * 1e6,
                fps=cm.fps,
                tensore_util=cm.mfu,
                extra=_chunk_extra(cm),
            )
        )
    for ncores, name, by_end in r.scaling:
        if not by_end:
            rows.append(
                BenchRow(
                    op="e2e_scaling",
                    variant=name,
                    config={**cfg, "cores": ncores},
                    kind="modelled",
                    status="error",
                    message=name,
                )
            )
            continue
        for end, (f, df) in by_end.items():
            rows.append(
                BenchRow(
                    op="e2e_scaling",
                    variant=f"{name}/{end}",
                    config={**cfg, "cores": ncores},
                    kind="modelled",
                    fps=f,
                    extra={"dit_fps": df, "end": end},
                )
            )
    return rows


def _methods_main(a: Any, out: Path, params: E2EParams, kernels: Any, matmul: Any) -> int:
    """``--methods``: the per-method steady-state table (:mod:`perf.e2e.methods`), all modelled."""
    from perf.e2e.kernels import default_kernel_provider
    from perf.e2e.methods import method_bench_rows, method_rows, method_table
    from perf.e2e.run import _model
    from perf.footprint import vae_probe
    from perf.matmul_model import default_matmul_provider
    from perf.runner import append_rows

    m = _model(a.preset, a.height, a.width)
    vae = vae_probe(m.latent_height, m.latent_width, 3)
    kernels = kernels or default_kernel_provider(params)
    matmul = matmul or default_matmul_provider()
    names = tuple(a.method) if a.method else tuple(METHOD_NAMES)
    rows = method_rows(
        m, cores=a.cores, vae=vae, kernels=kernels, matmul=matmul, params=params, methods=names
    )
    print(
        f"per-method steady state, {m.name} at {a.height}x{a.width}, {a.cores} cores "
        f"(kernels: {kernels.name})"
    )
    print(method_table(rows))
    stem = "e2e_methods_quick" if a.quick else "e2e_methods"
    append_rows(method_bench_rows(rows, m, a.height, a.width), out / "results" / f"{stem}.jsonl")
    return 0


def _with_before_after(head: list[str], table: list[str]) -> list[str]:
    """``head`` with ``table`` inserted after its last guard-trips row (at the end when it has none) and
    a blank line after the table."""
    at = max((i + 1 for i, ln in enumerate(head) if ln.startswith("  guard trips")), default=len(head))
    return [*head[:at], *table, "", *head[at:]]


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (its own function so a test can check the defaults: nothing tracked is
    written without ``--save``)."""
    ap = argparse.ArgumentParser(
        prog="python -m perf.e2e", description="End-to-end model of Rolling Forcing on trn2 (modelled)"
    )
    ap.add_argument("--preset", default="wan2.1-1.3b")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--cores", type=int, default=8)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny preset at 64x64 (smoke test; the peer rows stay Wan2.1-1.3B)",
    )
    ap.add_argument("--analytic", action="store_true", help="force the analytic kernel/matmul providers")
    ap.add_argument("--no-peer", action="store_true", help="skip the peer's configurations")
    ap.add_argument(
        "--out-dir",
        default=None,
        help="where REPORT.md, results/ and PNGs go (default build/perf/e2e; --save: perf/)",
    )
    ap.add_argument(
        "--methods",
        action="store_true",
        help="only the per-method table (rolling-forcing, self-forcing, causvid, longlive; "
        "results/e2e_methods.jsonl); REPORT.md is left alone",
    )
    ap.add_argument(
        "--method",
        action="append",
        choices=list(METHOD_NAMES),
        default=None,
        help="with --methods (implied): only these methods (repeatable)",
    )
    ap.add_argument(
        "--save",
        action="store_true",
        help="write perf/REPORT.md, perf/results/ and the PNGs (tracked); default: build/perf/e2e",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m perf.e2e [--quick] [--analytic] [--no-peer] [--out-dir DIR] [--cores N] [--preset P]
    [--height H] [--width W]``."""
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.method:
        a.methods = True
    if a.quick:
        a.preset, a.height, a.width = "tiny", 64, 64
    if a.save and a.out_dir:
        ap.error("--save writes perf/ itself; --out-dir names another place: pass one of them")
    # default: an untracked scratch directory (build/perf/e2e); --save: the tracked perf/ (REPORT.md, results)
    tracked = Path(__file__).resolve().parent.parent
    out = Path(a.out_dir) if a.out_dir else (tracked if a.save else Path("build/perf/e2e"))
    params = E2EParams()
    kernels = AnalyticKernels(params) if a.analytic else None
    matmul = AnalyticMatmulProvider() if a.analytic else None
    if a.methods:
        return _methods_main(a, out, params, kernels, matmul)
    r = run_model(
        a.preset,
        a.height,
        a.width,
        a.cores,
        params=params,
        kernels=kernels,
        matmul=matmul,
        peer=not a.no_peer,
    )
    from perf.runner import append_rows, print_table

    argv_s = list(sys.argv[1:] if argv is None else argv)
    r.command = " ".join(["python -m perf.e2e", *argv_s])
    stem = "e2e_quick" if a.quick else "e2e"
    pngs = write_plots(r, out / "results", stem)
    rows = result_rows(r)
    append_rows(rows, out / "results" / f"{stem}.jsonl")
    print_table(rows)
    print()
    print("\n".join(_with_before_after(headline_lines(r), before_after_lines(r))))
    print()
    print("\n".join(targets_lines(r)))
    print(
        "Attention side by side with the attention_cte design (modelled, perf/results/bench_kernels.jsonl):"
    )
    print("\n".join(attention_side_by_side_lines()))
    print()
    print("Per-chunk budget (modelled, merged forward; sorted by the gap to the roofline):")
    print("\n".join(budget_lines(r.chunk("merged", "optimistic"), r.chunk("merged", "pessimistic"))))
    report = render_report(r, [str(p.relative_to(out)) for p in pngs])
    name = "REPORT_quick.md" if a.quick else "REPORT.md"
    (out / name).write_text(report)
    print(f"wrote {out / name} (measured {r.wall_s:.1f} s CPU wall time)", file=sys.stderr)
    return 0
