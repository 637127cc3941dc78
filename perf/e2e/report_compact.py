"""The Targets section's HBM rows: the best placement, its frame rate at both ends, what holds the target
(the persistent floor, ``perf/footprint_phases.py``), the compact layout's collective (all *modelled*)."""

from __future__ import annotations

from perf.e2e.chunk import ChunkModel
from perf.e2e.compact import text_kv_gather_bytes
from perf.e2e.report_fmt import _gb
from perf.e2e.run import COMPACT_MODES, LEAN, LEAN_LABEL, E2EResult
from perf.footprint import Footprint

__all__ = ["compact_note", "text_gather_s", "hbm_target_rows", "floor_text", "floor_footprint", "lean_note"]


def text_gather_s(cm: ChunkModel, *, eager: bool = False) -> float:
    """Seconds per chunk the compact layout's text k/v all-gather costs ``cm``: its component
    ``text_kv_gather`` (exposed wait + contention, or its serial time) + its collective barriers, and
    (``eager``: host collectives, :func:`perf.e2e.launches.neffs_per_chunk`) the two NEFF launches each
    one adds (a graph segment + the collective's launch)."""
    comps = [c for c in cm.components if c.name.endswith("text_kv_gather")]
    if not comps:
        raise ValueError(f"chunk {cm.variant} ({cm.end}) has no text_kv_gather component")
    each = cm.params.at(cm.end).collective_barrier_s + (2 * cm.params.neff_launch_s if eager else 0.0)
    return sum(c.total_s + each * c.collectives * c.calls for c in comps)


def _pair(r: E2EResult, mode: str) -> tuple[ChunkModel, ChunkModel]:
    return r.compact[(mode, "pessimistic")], r.compact[(mode, "optimistic")]


def compact_note(fp: Footprint, r: E2EResult) -> str:
    """The compact KV layout's collective and the placement's frame rate, said beside the HBM figure that
    assumes it ("" for a footprint without the compact layout)."""
    if "compact" not in fp.label:
        return ""
    m = r.model
    per_core = m.num_layers * text_kv_gather_bytes(m, r.cores)
    head = (
        f" (the compact layout token-shards the text k/v and all-gathers it before each layer's "
        f"cross-attention: {per_core / 1e6:.1f} MB per core per forward, one collective per layer"
    )
    if set(r.compact) != {(mode, end) for mode in COMPACT_MODES for end in ("pessimistic", "optimistic")}:
        return head + "; not priced at this plan)"
    lo, hi = _pair(r, "fullgraph")
    elo, ehi = _pair(r, "eager_sharded")
    vae = [c.total_s for cm in (lo, hi) for c in cm.components if c.name == "vae_weight_gather"]
    vae_txt = (
        f"the VAE weights' gather {vae[0] * 1e3:.2f}-{vae[1] * 1e3:.2f} ms unhidden"
        if len(vae) == 2
        else "no VAE decode priced"
    )
    return (
        f"{head}. The placement streams at {lo.fps:.2f}-{hi.fps:.2f} fps (chunk {lo.chunk_s * 1e3:.1f}-"
        f"{hi.chunk_s * 1e3:.1f} ms) as one graph per forward, the gather on the collective stream under the "
        f"layer's self-attention, of which the text gather exposes {text_gather_s(lo) * 1e3:.2f}-"
        f"{text_gather_s(hi) * 1e3:.2f} ms (wait + HBM contention + barriers; the FSDP weight gathers as the "
        f"FSDP row, {vae_txt}); the sharded stream compiles this layout as one graph per rank "
        "(compile= with kv_cache='sp_compact', tests/test_sharding_compact_compile.py); without compile= "
        "it runs serialised: "
        f"{elo.fps:.2f}-{ehi.fps:.2f} fps (chunk {elo.chunk_s * 1e3:.1f}-{ehi.chunk_s * 1e3:.1f} ms, text "
        f"gather {text_gather_s(elo, eager=True) * 1e3:.2f}-{text_gather_s(ehi, eager=True) * 1e3:.2f} ms "
        "with its graph cuts))"
    )


def _kv_label(kv: str) -> str:
    return "bf16" if kv == "bf16" else "fp8 KV cache"


def _best(r: E2EResult, kv: str) -> Footprint | None:
    """The smallest modelled placement of ``kv`` ("bf16" or "fp8"); the one-shared-copy bound excluded."""
    lines = [fp for fp in r.footprints if fp.label.startswith(kv) and "shared weight copy" not in fp.label]
    return min(lines, key=lambda fp: fp.per_chip) if lines else None


def floor_footprint(r: E2EResult, kv: str) -> Footprint | None:
    """The persistent floor of ``kv`` ("bf16" or "fp8") among ``r.lower_bounds`` (``None`` if absent)."""
    for lb in r.lower_bounds:
        if lb.label.startswith(f"floor ({_kv_label(kv)})"):
            return lb
    return None


def floor_text(floor: Footprint, fp: Footprint, target: float) -> str:
    """What holds ``target`` (bytes per chip) for placement ``fp`` given the persistent ``floor``."""
    items = ", ".join(f"{i.name} {_gb(i.per_chip)}" for i in sorted(floor.items, key=lambda i: -i.per_chip))
    head = f"persistent floor {_gb(floor.per_chip)} GB ({items})"
    if floor.per_chip > target:
        return (
            f"{head} is {_gb(floor.per_chip - target)} GB over the target by itself: not reachable with "
            "the Wan VAE whatever the transients' placement"
        )
    trans = fp.per_chip - floor.per_chip
    verdict = "fit" if fp.per_chip <= target else f"need {_gb(trans)} GB"
    cache = [i for i in floor.items if i.name == "vae_causal_cache"]
    held = (
        f"; the VAE causal cache is {_gb(cache[0].per_chip)} GB of the floor (the placement without it: "
        f"{(fp.per_chip - cache[0].per_chip) / 1e9:.3f} GB)"
        if cache
        else ""
    )
    return f"{head} leaves {_gb(target - floor.per_chip)} GB for the transients, which {verdict}{held}"


def lean_note(r: E2EResult, name: str) -> str:
    """The :data:`perf.e2e.run.LEAN` placement ``name``'s frame rate at both ends in both compile modes and
    what its per-linear gathers cost against the block gathers (:data:`perf.e2e.run.COMPACT`)."""
    keys = {(name, mode, end) for mode in COMPACT_MODES for end in ("pessimistic", "optimistic")}
    if not keys <= set(r.lean):
        return "not priced at this plan"
    lo, hi = r.lean[(name, "fullgraph", "pessimistic")], r.lean[(name, "fullgraph", "optimistic")]
    elo, ehi = r.lean[(name, "eager_sharded", "pessimistic")], r.lean[(name, "eager_sharded", "optimistic")]
    txt = (
        f"{lo.fps:.2f}-{hi.fps:.2f} fps (chunk {lo.chunk_s * 1e3:.1f}-{hi.chunk_s * 1e3:.1f} ms) as one "
        f"graph per forward, {elo.fps:.2f}-{ehi.fps:.2f} fps eager (host collectives, chunk "
        f"{elo.chunk_s * 1e3:.1f}-"
        f"{ehi.chunk_s * 1e3:.1f} ms)"
    )
    if ("fullgraph", "pessimistic") in r.compact and ("fullgraph", "optimistic") in r.compact:
        blo, bhi = r.compact[("fullgraph", "pessimistic")], r.compact[("fullgraph", "optimistic")]
        txt += (
            f"; its {lo.collectives - blo.collectives} more, smaller weight collectives per chunk (one per "
            f"linear) change the one-graph chunk by {(lo.chunk_s - blo.chunk_s) * 1e3:+.2f} / "
            f"{(hi.chunk_s - bhi.chunk_s) * 1e3:+.2f} ms against the block gathers (gathers + barriers"
            + (", VAE per-frame calls" if LEAN[name].get("vae_split") == "output_frame" else "")
            + ")"
        )
    return txt


def _placement_text(fp: Footprint, r: E2EResult) -> str:
    for name, lab in LEAN_LABEL.items():
        if fp.label.endswith(lab):
            return f"{_gb(fp.per_chip)} GB ({fp.label}) at {lean_note(r, name)}"
    return f"{_gb(fp.per_chip)} GB ({fp.label}){compact_note(fp, r)}"


def hbm_target_rows(r: E2EResult) -> list[str]:
    """The Targets table's HBM rows (bf16 and FP8 KV cache): the best modelled placement, its GB and fps at
    both ends, met or missed by how much, what holds the target (:func:`floor_text`), the runner-up
    placements, and the tiny decoder as a separate row (never the headline)."""
    prm = r.params
    out: list[str] = []
    for kv, target, what in (
        ("bf16", prm.target_hbm_bytes, "in bf16"),
        ("fp8", prm.target_hbm_fp8_bytes, "with the FP8 KV cache"),
    ):
        best = _best(r, kv)
        if best is None:
            continue
        ok = best.per_chip <= target
        cell = f"best modelled placement {_placement_text(best, r)}; "
        cell += f"{'met with' if ok else 'missed by'} {_gb(abs(target - best.per_chip))} GB"
        floor = floor_footprint(r, kv)
        if floor is not None:
            cell += f"; {floor_text(floor, best, target)}"
        others = [
            fp
            for fp in r.footprints
            if fp is not best and fp.label.startswith(kv) and ("compact" in fp.label)
        ]
        if others:
            cell += "; also " + "; ".join(_placement_text(fp, r) for fp in others)
        if kv == "bf16":
            base = r.footprints[0]
            cell = f"baseline {_gb(base.per_chip)} GB ({base.label}); " + cell
        out.append(f"| HBM <= {_gb(target)} GB {what} | {cell} | {'yes' if ok else 'no'} |")
        tiny = [
            fp for fp in r.footprints if fp.label.startswith("tiny decoder") and _kv_label(kv) in fp.label
        ]
        for fp in tiny:
            fits = fp.per_chip <= target
            dec = ", ".join(f"{i.name} {_gb(i.per_chip)}" for i in fp.items if i.name.startswith("vae"))
            out.append(
                f"| HBM <= {_gb(target)} GB {what}, a tiny decoder instead of the Wan VAE (separate row, not "
                f"the headline) | {_gb(fp.per_chip)} GB ({fp.label}; the DiT placed as the best placement; "
                f"decoder items {dec} GB) | {'yes' if fits else 'no'}, quality not measured |"
            )
    return out
