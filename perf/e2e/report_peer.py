"""The measured peer's part of the generated report: its table, its per-group breakdown and the calibration
verdict (all *modelled* against the peer's published measurements)."""

from __future__ import annotations

from collections.abc import Sequence

from perf.e2e.peer import CALIBRATION_BAND
from perf.e2e.report_fmt import _fps, _ms
from perf.e2e.run import PeerRow

__all__ = ["calibration_verdict", "peer_breakdown_lines", "peer_table"]


def calibration_verdict(peer: Sequence[PeerRow]) -> str:
    """One line: predicted / measured at the calibration point (480x832, 8 cores, merged) at both ends."""
    for row in peer:
        c = row.config
        if (c.height, c.width, c.cores, c.variant) == (480, 832, 8, "merged") and row.measured and row.chunks:
            lo, hi = row.ratio("pessimistic"), row.ratio("optimistic")
            assert lo is not None and hi is not None
            inside = [
                e
                for e, x in (("pessimistic", lo), ("optimistic", hi))
                if 1 / CALIBRATION_BAND <= x <= CALIBRATION_BAND
            ]
            verdict = (
                f"within x{CALIBRATION_BAND} at the {' and '.join(inside)} end"
                if inside
                else f"outside x{CALIBRATION_BAND} at both ends"
            )
            return (
                f"End-to-end calibration (peer, 480x832, TP4xSP2, merged, {row.chunks['optimistic'].neffs} "
                "NEFFs "
                "per chunk fed): modelled "
                f"{row.chunks['pessimistic'].fps:.2f}-{row.chunks['optimistic'].fps:.2f} fps "
                f"vs measured {row.measured.fps:.1f} fps ({row.measured.fps_low}-{row.measured.fps_high}): "
                f"predicted / measured = x{lo:.2f} (pessimistic end) to x{hi:.2f} (optimistic end), "
                f"{verdict}."
            )
    return "End-to-end calibration: the peer's configuration was not modelled."


def peer_table(peer: Sequence[PeerRow]) -> list[str]:
    """Markdown rows: every peer configuration, modelled (both ends) beside the measured figure."""
    out = [
        "| resolution | cores | plan | variant | modelled fps (pess.-opt.) | modelled ms per chunk (DiT + "
        "VAE, "
        "pess.) | NEFFs per chunk | measured fps (peer) | predicted / measured (pess., opt.) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in peer:
        c = row.config
        if not row.chunks:
            out.append(
                f"| {c.height}x{c.width} | {c.cores} | {c.plan} | {c.variant} | not modelled: {row.error} "
                "|||||"
            )
            continue
        lo, hi = row.chunks["pessimistic"], row.chunks["optimistic"]
        meas = "not published"
        if row.measured is not None:
            pm = row.measured
            spread = f" ({pm.fps_low:g}-{pm.fps_high:g})" if pm.fps_low != pm.fps_high else ""
            meas = f"{pm.fps:g}{spread}"
            meas += f"; {pm.note}" if pm.note else ""
        rl, rh = row.ratio("pessimistic"), row.ratio("optimistic")
        ratio = "-" if rl is None or rh is None else f"x{rl:.2f}, x{rh:.2f}"
        note = f" ({row.error})" if row.error else ""
        split = f"{_ms(lo.chunk_s)} ({_ms(lo.dit_s)} + {_ms(lo.chunk_s - lo.dit_s)})"
        out.append(
            f"| {c.height}x{c.width} | {c.cores} | {lo.plan_name}{note} | {c.variant} | {_fps(lo, hi)} | "
            f"{split} "
            f"| {lo.neffs} | {meas} | {ratio} |"
        )
    return out


def peer_breakdown_lines(peer: Sequence[PeerRow]) -> list[str]:
    """Where the calibration point's modelled chunk goes, per group at both ends (ms per chunk)."""
    for row in peer:
        c = row.config
        if (c.height, c.width, c.cores, c.variant) != (480, 832, 8, "merged") or not row.chunks:
            continue
        lo, hi = row.chunks["pessimistic"].by_group(), row.chunks["optimistic"].by_group()
        out = [
            "| group (peer, 480x832, TP4xSP2, merged) | ms per chunk, pessimistic | optimistic |",
            "|---|---|---|",
        ]
        for g in sorted(set(lo) | set(hi), key=lambda g: -lo.get(g, 0.0)):
            out.append(f"| {g} | {lo.get(g, 0.0) * 1e3:,.1f} | {hi.get(g, 0.0) * 1e3:,.1f} |")
        opt = {x.name: x.time_s for x in row.chunks["optimistic"].components}
        per_layer = [
            f"{x.name} {x.time_s * 1e3:.2f}-{opt.get(x.name, 0.0) * 1e3:.2f} ms"
            for x in row.chunks["pessimistic"].components
            if x.group in ("attention", "cross_attention")
        ]
        return [*out, "", "Per layer and core (pessimistic-optimistic): " + "; ".join(per_layer) + ".", ""]
    return []
