"""The Targets section's words on the HBM-best placement's frame rate (all *modelled*)."""

from __future__ import annotations

from perf.e2e.chunk import ChunkModel
from perf.e2e.compact import text_kv_gather_bytes
from perf.e2e.run import COMPACT_MODES, E2EResult
from perf.footprint import Footprint

__all__ = ["compact_note", "text_gather_s"]


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
        f"FSDP row, {vae_txt}); the stream "
        "runs this layout eager only (kv_cache='sp_compact' refuses compile=), serialised: "
        f"{elo.fps:.2f}-{ehi.fps:.2f} fps (chunk {elo.chunk_s * 1e3:.1f}-{ehi.chunk_s * 1e3:.1f} ms, text "
        f"gather {text_gather_s(elo, eager=True) * 1e3:.2f}-{text_gather_s(ehi, eager=True) * 1e3:.2f} ms "
        "with its graph cuts))"
    )
