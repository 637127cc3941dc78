"""The report's "Guard sensitivity" section: the modelled chunk when the static softmax offset's guard
trips (:mod:`perf.e2e.guard`) and the trip statistic measured on every model the project has
(``perf/results/attention_guard.jsonl``, written by ``python -m perf.attention_guard --save``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perf.e2e.guard import FRACTIONS, SCOPES, GuardSensitivity
from perf.e2e.report_fmt import _ms

__all__ = ["guard_lines", "guard_headline_lines", "measured_guard_lines", "read_guard_rows"]

_SELF = ("self_attention",)
_VARIANT = {
    "merged": "merged, one NEFF per forward (the headline)",
    "merged_eager": "merged, sharded stream without --compile",
}


def read_guard_rows(path: str | Path | None = None) -> list[Any]:
    """The measured rows of ``perf/results/attention_guard.jsonl`` (none if the file does not exist)."""
    from perf.runner import read_rows, results_path

    p = Path(path) if path is not None else results_path("attention_guard")
    return read_rows(p) if p.exists() else []


def _pair(g: GuardSensitivity, variant: str, fraction: float, scopes: Sequence[str]) -> str:
    """``fps pess-opt (chunk ms pess-opt)`` of one case."""
    lo, hi = g.row(variant, "pessimistic", fraction, scopes), g.row(variant, "optimistic", fraction, scopes)
    return f"{lo.fps:.2f}-{hi.fps:.2f} fps ({_ms(lo.chunk_s)}-{_ms(hi.chunk_s)} ms)"


def guard_headline_lines(g: GuardSensitivity) -> list[str]:
    """Terminal lines: fps of the merged chunk at 0 / 10 / 100 % of the heads tripping."""
    if not g.rows:
        return [f"  guard trips: not priced ({g.note})"]
    variants = list(dict.fromkeys(r.variant for r in g.rows))
    out = []
    for v in variants:
        cases = ", ".join(f"{f:.0%} {_pair(g, v, f, _SELF)}" for f in FRACTIONS)
        out.append(f"  guard trips ({v}, self-attention heads tripping): {cases}")
    return out


def _terms_text(g: GuardSensitivity, variant: str) -> str:
    parts = []
    for t_lo in g.terms.get((variant, "pessimistic"), []):
        t_hi = next(t for t in g.terms[(variant, "optimistic")] if t.component == t_lo.component)
        parts.append(
            f"`{t_lo.component}` {_ms(t_lo.static_s)}-{_ms(t_hi.static_s)} ms per call, "
            f"{_ms(t_lo.tripped_s)}-{_ms(t_hi.tripped_s)} ms with every guard tripping "
            f"(+{_ms(t_lo.extra_s)}-{_ms(t_hi.extra_s)} ms, {t_lo.calls} calls per chunk"
            + (f"; priced by {t_lo.source}" if t_lo.source and "(schedule)" not in t_lo.source else "")
            + ")"
        )
    return "; ".join(parts)


def guard_lines(g: GuardSensitivity, measured: Sequence[Any] = ()) -> list[str]:
    """The section (markdown lines): the modelled table and the measured trip statistics."""
    head = "## Guard sensitivity (modelled chunk; the trip statistics measured)\n"
    if not g.rows:
        return [head, f"Not priced: {g.note}.\n", *measured_guard_lines(measured)]
    L = [
        head,
        "Every figure above assumes the static softmax offset's guard never trips. A trip re-runs one "
        "guard unit (a head of `attention_kernel`, a head's query group of the block-table kernel) with "
        "the running max over the K/V it already holds in SBUF, inside the same kernel call: no K/V reload, "
        "no extra kernel call, NEFF or collective. Priced by tracing each attention call with every guard "
        "tripping (`perf.e2e.kernels.every_guard_trips`: the instruction stream a NEFF runs then, tested "
        "equal to an emulator run whose every row trips) and charging `fraction x (tripped - static)` per "
        "call on top of the static call (`perf/e2e/guard.py`). The fraction is the share of the critical "
        "core's heads that trip in every layer; the cores wait for each other at every layer's collectives, "
        "so one tripping head per layer costs its core 1 / (its local heads) of the all-tripping extra and "
        "the chunk waits for that core.\n",
    ]
    for v in list(dict.fromkeys(r.variant for r in g.rows)):
        L.append(f"Per call at the pessimistic-optimistic end ({_VARIANT.get(v, v)}): {_terms_text(g, v)}.\n")
        break  # the per-call figures are the same for every variant of the merged forward
    L.append("| chunk | heads tripping | self-attention trips | self- and cross-attention trip |")
    L.append("|---|---|---|---|")
    for v in list(dict.fromkeys(r.variant for r in g.rows)):
        for f in FRACTIONS:
            L.append(
                f"| {_VARIANT.get(v, v)} | {f:.0%} | {_pair(g, v, f, _SELF)} | {_pair(g, v, f, SCOPES)} |"
            )
        one = [r for r in g.rows if r.variant == v and r.label.startswith("1 head")]
        for r in one[:1]:
            L.append(f"| {_VARIANT.get(v, v)} | {r.label} | {_pair(g, v, r.fraction, _SELF)} | - |")
    L.append("")
    L.append(
        "fps and ms: pessimistic-optimistic end, modelled. The cross-attention columns are what a trip "
        "would cost: the text keys (512 for Wan) fit in ONE key chunk (1,024 keys), so a cross-attention "
        "row's offset is its exact maximum (1 <= l <= the key count) and it cannot trip on finite inputs.\n"
    )
    return L + measured_guard_lines(measured)


def _latest(rows: Sequence[Any]) -> list[Any]:
    """The rows of the newest wan_layer sweep (largest ``extra.run_id``) per (weights, layer, dtype)."""
    newest: dict[tuple[Any, ...], str] = {}
    for r in rows:
        key = (r.config.get("weights"), r.config.get("layer"), r.config.get("dtype"))
        newest[key] = max(newest.get(key, ""), str(r.extra.get("run_id", "")))
    return [
        r
        for r in rows
        if str(r.extra.get("run_id", ""))
        == newest[(r.config.get("weights"), r.config.get("layer"), r.config.get("dtype"))]
    ]


def measured_guard_lines(rows: Sequence[Any]) -> list[str]:
    """The measured trip statistics of ``perf/results/attention_guard.jsonl``: the demo/tiny streams (guard
    trips counted in the kernels) and the Wan2.1-1.3B layer sweep (the guard's quantities per head)."""
    L = ["### The trip statistic, measured (`perf/results/attention_guard.jsonl`)\n"]
    streams = [r for r in rows if r.op == "attention_guard" and r.variant == "static_offset"]
    wan = _latest([r for r in rows if r.op == "attention_guard" and r.variant == "wan_layer"])
    if not streams and not wan:
        return [*L, "Not measured: `python -m perf.attention_guard --save`.\n"]
    if streams:
        passes = sum(r.extra.get("static_passes", 0) for r in streams)
        trips = sum(r.extra.get("running_max_passes", 0) for r in streams)
        hi = [r.extra["guard_log_l_max"] for r in streams if r.extra.get("guard_log_l_max") is not None]
        lo = [r.extra["tile_log_l_min"] for r in streams if r.extra.get("tile_log_l_min") is not None]
        models = sorted({f"{r.config.get('model')} {r.config.get('latent')}" for r in streams})
        L.append(
            f"- **Trained demo DiT streams** ({len(streams)} runs; {', '.join(models)}; emulator kernels): "
            f"{trips} guard trips in {passes:,} static passes; `log l` at most {max(hi):.2f} against the "
            f"69.08 at which it trips, per tile at least {min(lo):.2f} against -41.45 "
            "(`python -m perf.attention_guard [--latent 32] [--dtype bfloat16] [--merged] --save`)."
        )
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for r in wan:
        groups.setdefault((r.config.get("weights"), r.config.get("layer"), r.config.get("dtype")), []).append(
            r
        )
    for (weights, layer, dtype), rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        rs = sorted(rs, key=lambda r: r.config["qk_gain"])
        first = rs[0]
        onset = first.extra.get("trip_onset_bracket", [None, None])
        all_trip = next(
            (r.config["qk_gain"] for r in rs if r.extra["heads_tripping"] == r.extra["heads"]), None
        )
        sweep = ", ".join(f"{r.config['qk_gain']:g}: {r.extra['heads_tripping']}" for r in rs)
        what = "Wan's init" if weights == "wan_init" else f"checkpoint layer {layer}"
        at = next((r for r in rs if r.extra["heads_tripping"]), None)
        bound = ""
        if at is not None and dtype != "float32":
            low = (at.extra.get("tile_log_l_min") or 0.0) < at.extra.get("tile_log_l_limit", -41.45)
            high = (at.extra.get("tile_log_l_max") or 0.0) > at.extra.get("guard_log_l_limit", 69.08)
            bound = {
                (True, False): " (the lower bound first)",
                (False, True): " (the upper bound first)",
            }.get((low, high), "")
        tile = (
            f", per tile [{first.extra['tile_log_l_min']}, {first.extra['tile_log_l_max']}]"
            if dtype != "float32"
            else ""
        )
        cmd = "python -m perf.attention_guard --model wan-layer" + (
            " --dtype float32" if dtype == "float32" else ""
        )
        on = (
            f"trips begin between q/k-norm gain {onset[0]:g} and {onset[1]:g}"
            if onset[1] is not None and onset[0] is not None
            else ("no head trips in the sweep" if onset[1] is None else f"trips at gain {onset[1]:g}")
        )
        L.append(
            f"- **One Wan2.1-1.3B self-attention layer, {what}** ({dtype}, {first.config['keys']:,} keys, "
            f"{first.extra['tiles_sampled']} sampled 128-query tiles, LayerNorm-ed i.i.d. tokens): at gain "
            f"{first.config['qk_gain']:g} {first.extra['heads_tripping']} of {first.extra['heads']} heads "
            f"trip (`log l` at most {first.extra['guard_log_l_max']}{tile}); {on}{bound}"
            + (f", every head from {all_trip:g}" if all_trip is not None else "")
            + f". Heads tripping per gain: {sweep} (a lower bound: sampled rows). `{cmd} --save`."
        )
    L.append(
        "\nThe real Wan2.1 / Rolling Forcing checkpoint's q/k norms are unknown here (no checkpoint): the "
        "gain stands in for trained norm weights and sharper attention. With the checkpoint, measure first "
        "`python -m perf.attention_guard --model wan-layer --checkpoint PATH --layer all --qk-gain 1` (its "
        "trained q/k weights and norms, every layer, on the same synthetic tokens; a head tripping there "
        "prices as the rows above).\n"
    )
    return L
